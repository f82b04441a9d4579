"""What float64 (and NaN bits) survive on a TPU: transfers, copies, constants, bitcasts, arithmetic.

    python3 scripts/probes/f64_on_tpu.py      # pure JAX, no torch; prints one line per check

A TPU has no float64 unit: XLA emulates it. This measures which paths keep every bit.
"""
import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
n = 4096
bits = rng.integers(0, 2**63, n, dtype=np.uint64) | (rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(63))
x = bits.view(np.float64)
x = np.where(np.isfinite(x), x, 1.5)
x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]
normal = np.abs(x) > 1e-300
print("device:", jax.devices()[0].device_kind)


def report(name, got, want=x):
    got, want = np.asarray(got), np.asarray(want)
    same = (got.view(np.uint64) == want.view(np.uint64)) | (np.isnan(got) & np.isnan(want))
    close = np.abs(got - want) <= np.abs(want) * 2.0**-52
    bad = np.flatnonzero(~same)
    rel = np.abs(got - want)[normal] / np.abs(want)[normal]
    print(f"{name:34s} exact {same.mean():.4f}  within 1 ulp {close.mean():.4f}  max rel {np.nanmax(rel):.2e}"
          + (f"  e.g. {want[bad[0]]!r} -> {got[bad[0]]!r}" if len(bad) else ""))


d = jax.device_put(x)
report("device_put and back", d)
report("jit flip twice (copies)", jax.jit(lambda a: jnp.flip(jnp.flip(a)))(d))
report("jit a * 1.0", jax.jit(lambda a: a * jnp.float64(1.0))(d))
report("jit constant", jax.jit(lambda: jnp.asarray(x))())
report("jit bitcast u64 -> f64", jax.jit(lambda b: jax.lax.bitcast_convert_type(b, jnp.float64))(jax.device_put(bits)),
       bits.view(np.float64))
halves = bits.view(np.uint32).reshape(n, 2)
report("jit bitcast u32x2 -> f64", jax.jit(lambda h: jax.lax.bitcast_convert_type(h, jnp.float64))(
    jax.device_put(halves)), bits.view(np.float64))
report("jit constant u64 bitcast -> f64", jax.jit(lambda: jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float64))(),
       bits.view(np.float64))
y = rng.standard_normal(n)
report("jit a + b", jax.jit(jnp.add)(d, jax.device_put(y)), x + y)
report("jit a * b", jax.jit(jnp.multiply)(d, jax.device_put(y)), x * y)
report("jit a / b", jax.jit(jnp.divide)(d, jax.device_put(y)), x / y)
report("jit f64 -> f32 -> f64", jax.jit(lambda a: a.astype(jnp.float32).astype(jnp.float64))(d),
       x.astype(np.float32).astype(np.float64))
big = np.array([2.0**50 + 1, 2.0**52 + 3, -(2.0**49) - 1, 123456789012345.0])
got = np.asarray(jax.jit(lambda a: a.astype(jnp.int64))(jax.device_put(big)))
print(f"{'jit f64 -> int64':34s} {list(got)} want {list(big.astype(np.int64))}")
ints = rng.integers(-2**62, 2**62, n, dtype=np.int64)
got = np.asarray(jax.jit(lambda a: a + 1)(jax.device_put(ints)))
print(f"{'jit int64 + 1':34s} exact {(got == ints + 1).mean():.4f}")
nan16 = np.array([0xFE00, 0x7E00, 0x7C01, 0xFFFF], np.uint16).view(np.float16)
for name, fn in [("f16 NaN device_put", lambda: jax.device_put(nan16)),
                 ("f16 NaN jit constant", lambda: jax.jit(lambda: jnp.asarray(nan16))()),
                 ("f16 NaN jit copy", lambda: jax.jit(lambda a: jnp.flip(jnp.flip(a)))(jax.device_put(nan16)))]:
    print(f"{name:34s} {[hex(v) for v in np.asarray(fn()).view(np.uint16)]} from {[hex(v) for v in nan16.view(np.uint16)]}")
