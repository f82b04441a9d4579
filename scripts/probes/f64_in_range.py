"""Chip probe: float64 on a TPU for values inside float32's exponent range: bits kept, ulps lost.

    python3 scripts/probes/f64_in_range.py      # pure JAX, no torch
"""
import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
n = 20000
x = rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)
y = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)
ints = rng.integers(-2**53, 2**53, n).astype(np.float64)
print("device:", jax.devices()[0].device_kind)


def ulps(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    spacing = np.spacing(np.abs(want))
    return np.abs(got - want) / spacing


for name, got, want in [
    ("device_put and back", jax.device_put(x), x),
    ("device_put ints < 2**53", jax.device_put(ints), ints),
    ("jit constant", jax.jit(lambda: jnp.asarray(x))(), x),
    ("a + b", jax.jit(jnp.add)(x, y), x + y),
    ("a * b", jax.jit(jnp.multiply)(x, y), x * y),
    ("a / b", jax.jit(jnp.divide)(x, y), x / y),
    ("sqrt |a|", jax.jit(lambda a: jnp.sqrt(jnp.abs(a)))(x), np.sqrt(np.abs(x))),
    ("exp b/100", jax.jit(lambda a: jnp.exp(a / 100))(y), np.exp(y / 100)),
]:
    u = ulps(got, want)
    print(f"{name:26s} exact {np.mean(u == 0):.4f}  max {np.max(u):.3g} ulp  median {np.median(u):.3g} ulp  "
          f"bits lost (max) {np.log2(max(np.max(u), 1)):.1f}")
for v in [3.5e38, 1e-39, 1e300, -0.0, 2.0**-126, 2.0**-149]:
    print(f"device_put {v!r:>24} -> {np.asarray(jax.device_put(np.array([v])))[0]!r}")
