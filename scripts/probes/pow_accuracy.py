"""Chip probe: float32 ``number ** y`` on the TPU, XLA's pow against tpudist's (tpudist/ops/lowerings/_number_pow.py).

Needs JAX only (no torch): run it on the device machine from the repository root,
    python3 scripts/probes/pow_accuracy.py
Per base: the worst error in ulps of the float32 result against float64 and how many results are not
correctly rounded, over integer exponents (optimizer steps) and random ones, where |y * log(base)| <= 1/8
(the range _number_pow computes) and beyond it (where it returns XLA's pow). Then Dekker's product of
random float32 pairs, which must be exact (p + e == a * b in float64) for the module's sums to hold.
"""
import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

path = pathlib.Path(__file__).resolve().parents[2] / "tpudist" / "ops" / "lowerings" / "_number_pow.py"
spec = importlib.util.spec_from_file_location("_number_pow", path)
number_pow = importlib.util.module_from_spec(spec)
spec.loader.exec_module(number_pow)
print("device:", jax.devices()[0].device_kind, flush=True)


def ulps(r, ref):
    return np.abs(r.astype(np.float64) - ref) / np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)


rng = np.random.default_rng(0)
for base in (0.999, 0.9999, 0.99, 0.95, 0.9, 0.5, 2.0, 10.0):
    b32 = np.float32(base)
    log = math.log(float(b32))
    near = (np.concatenate([np.arange(1, min(int(number_pow.NEAR / abs(log)), 20000) + 1),
                            rng.uniform(-number_pow.NEAR, number_pow.NEAR, 1 << 16) / log])).astype(np.float32)
    far = (rng.uniform(-20, 20, 1 << 16) / log).astype(np.float32)
    far = far[np.abs(far.astype(np.float64) * log) > number_pow.NEAR]
    row = [f"base {base}:"]
    for name, ys in (("near", near), ("far", far)):
        ref = np.float64(b32) ** ys.astype(np.float64)
        keep = np.isfinite(ref) & (np.abs(ref) > 1e-37)
        ys, ref = ys[keep], ref[keep]
        for label, fn in (("xla pow", lambda y: jnp.power(b32, y)),
                          ("tpudist", lambda y: number_pow.number_pow(base, y))):
            got = np.asarray(jax.jit(fn)(jnp.asarray(ys)))
            u = ulps(got, ref)
            row.append(f"{name} {label} max {u.max():.3f} ulp, {int((u > 0.5).sum())}/{len(u)} not rounded")
    print(" | ".join(row), flush=True)
    steps = np.arange(1, 4, dtype=np.float32)
    print(f"  {base} ** [1, 2, 3]: float64 {np.float64(b32) ** steps.astype(np.float64)}, "
          f"xla pow {np.asarray(jax.jit(lambda y: jnp.power(b32, y))(jnp.asarray(steps))).tolist()}, "
          f"tpudist {np.asarray(jax.jit(lambda y: number_pow.number_pow(base, y))(jnp.asarray(steps))).tolist()}",
          flush=True)

a = (rng.standard_normal(1 << 16) * 100).astype(np.float32)
b = (rng.standard_normal(1 << 16) * 0.01).astype(np.float32)
p, e = (np.asarray(v) for v in jax.jit(number_pow._two_product)(jnp.asarray(a), jnp.asarray(b)))  # noqa: SLF001
residual = np.abs(p.astype(np.float64) + e.astype(np.float64) - a.astype(np.float64) * b.astype(np.float64))
print(f"two-product: {int((residual != 0).sum())} of {len(a)} inexact (must be 0), worst {residual.max():.3g}")
