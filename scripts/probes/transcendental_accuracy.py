"""Chip probe: float32 transcendental accuracy on TPU, default vs lax's accuracy=HIGHEST, and speed."""
import math, time
import numpy as np, jax, jax.numpy as jnp
from jax import lax
rng = np.random.default_rng(0)
x = (rng.standard_normal(1 << 22) * 3).astype(np.float32)
pos = np.abs(x) + 1e-3
def ref_erf(v):
    return np.vectorize(math.erf)(v.astype(np.float64))
cases = [("exp", lax.exp, np.exp, x / 2), ("log", lax.log, np.log, pos), ("tanh", lax.tanh, np.tanh, x),
         ("logistic", lax.logistic, lambda v: 1 / (1 + np.exp(-v)), x), ("log1p", lax.log1p, np.log1p, pos),
         ("expm1", lax.expm1, np.expm1, x / 2), ("sin", lax.sin, np.sin, x), ("cos", lax.cos, np.cos, x),
         ("rsqrt", lax.rsqrt, lambda v: 1 / np.sqrt(v), pos), ("sqrt", lax.sqrt, np.sqrt, pos),
         ("erf", lax.erf, ref_erf, x[:1 << 16]), ("pow2.5", lambda v: lax.pow(v, np.float32(2.5)), lambda v: v ** 2.5, pos)]
def ulps(r, ref):
    sp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return np.abs(r.astype(np.float64) - ref) / sp
for name, f, nf, v in cases:
    ref = nf(v.astype(np.float64))
    row = [name]
    for acc in (None, lax.AccuracyMode.HIGHEST, lax.Tolerance(atol=0, rtol=0, ulps=1)):
        try:
            g = jax.jit((lambda a, f=f, acc=acc: f(a, accuracy=acc)) if acc is not None and name != "pow2.5" else f)
            a = jnp.asarray(v)
            r = np.asarray(g(a)); jax.block_until_ready(g(a))
            t = time.perf_counter()
            for _ in range(20): o = g(a)
            jax.block_until_ready(o); dt = (time.perf_counter() - t) / 20
            u = ulps(r, ref)
            row.append(f"{'default' if acc is None else str(acc)[:14]}: max {u.max():.0f} p99 {np.percentile(u, 99):.1f} ulp {dt*1e6:.0f}us")
        except Exception as e:
            row.append(f"{acc}: ERR {type(e).__name__}: {str(e)[:120]}")
    print(" | ".join(row), flush=True)
