"""Chip probe: float64 (and NaN bits) on a TPU: what a copy, a constant, a bitcast and arithmetic keep.

    python3 scripts/probes/f64_in_range.py      # pure JAX, no torch

A TPU has no float64 unit: XLA emulates it. Values inside float32's exponent range: how many come back
exact and how many ulps the rest lose; then the edges (out of range, -0.0), integer conversions, and
the NaN bits a program writes.
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
    """|got - want| in ulps of ``want``'s own dtype (float32's for the conversion)."""
    spacing = np.spacing(np.abs(want)).astype(np.float64)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want) / spacing


for name, got, want in [
    ("device_put and back", jax.device_put(x), x),
    ("device_put ints < 2**53", jax.device_put(ints), ints),
    ("jit constant", jax.jit(lambda: jnp.asarray(x))(), x),
    ("jit bitcast int64 -> f64", jax.jit(lambda b: jax.lax.bitcast_convert_type(b, jnp.float64))(x.view(np.int64)), x),
    ("a + b", jax.jit(jnp.add)(x, y), x + y),
    ("a * b", jax.jit(jnp.multiply)(x, y), x * y),
    ("a / b", jax.jit(jnp.divide)(x, y), x / y),
    ("sqrt |a|", jax.jit(lambda a: jnp.sqrt(jnp.abs(a)))(x), np.sqrt(np.abs(x))),
    ("exp b/100", jax.jit(lambda a: jnp.exp(a / 100))(y), np.exp(y / 100)),
    ("f64 -> f32", jax.jit(lambda a: a.astype(jnp.float32))(x), x.astype(np.float32)),
]:
    u = ulps(got, want)
    print(f"{name:26s} exact {np.mean(u == 0):.4f}  max {np.max(u):.3g} ulp  median {np.median(u):.3g} ulp  "
          f"bits lost (max) {np.log2(max(np.max(u), 1)):.1f}")
for v in [3.5e38, 1e-39, 1e300, -0.0, 2.0**-126, 2.0**-149]:
    print(f"device_put {v!r:>24} -> {np.asarray(jax.device_put(np.array([v])))[0]!r}")
big = np.array([2.0**50 + 1, 2.0**52 + 3, -(2.0**49) - 1, 123456789012345.0])
print(f"{'jit f64 -> int64':26s} {np.asarray(jax.jit(lambda a: a.astype(jnp.int64))(big)).tolist()} "
      f"want {big.astype(np.int64).tolist()}")
wide = rng.integers(-2**62, 2**62, n, dtype=np.int64)
print(f"{'jit int64 + 1':26s} exact {(np.asarray(jax.jit(lambda a: a + 1)(wide)) == wide + 1).mean():.4f}")
nan16 = np.array([0xFE00, 0x7E00, 0x7C01, 0xFFFF], np.uint16).view(np.float16)
for name, fn in [("f16 NaN device_put", lambda: jax.device_put(nan16)),
                 ("f16 NaN jit constant", lambda: jax.jit(lambda: jnp.asarray(nan16))()),
                 ("f16 NaN jit copy", lambda: jax.jit(lambda a: jnp.flip(jnp.flip(a)))(nan16))]:
    print(f"{name:26s} {[hex(v) for v in np.asarray(fn()).view(np.uint16)]} from "
          f"{[hex(v) for v in nan16.view(np.uint16)]}")
