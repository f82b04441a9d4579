"""Chip probe: writing half of a tensor's last dim, as the device's view writes do it and two other ways.

    python3 scripts/probes/view_write.py [--shape 8 16 1024 64]     # needs torch (scripts/chip_env.sh)

Hugging Face Llama's ``rotate_half`` slices the head dim in halves (``x[..., :32]``, ``x[..., 32:]``);
the backward of each slice is ``slice_backward``: zeros, then the gradient written into that half
(``copy_`` into a view). The device lowers such a write through ``tpudist.device.views.write`` on the
flat storage. On the TPU v5e the HF model's Fused step (2026-12-06, 8 x 16 x 1024 x 64 bf16) spent
about 15 ms of 137 in ``dynamic-update-slice`` ops of those shapes, about 0.5 ms each for 16 MiB: then
the upper half's offset was a runtime input (the two writes share a site) and a nonzero offset a span of
the whole storage shifted by it. Since then both halves are constants written in their rows
(``views.column``, ``views.few_columns``), as an N-d ``dynamic_update_slice``; this probe says whether
``concatenate`` or ``pad`` would be faster on the chip.

Each variant computes ``grad = g + slice_backward(u_hi, [..., :half]) + slice_backward(u_lo, [..., half:])``
(the rotate_half backward's sum), jitted, timed as the median of ``--runs`` calls after a warm-up,
and checked equal to the first:

- ``views.write``: the device's lowering (flat storages, ``views.write``, reshape);
- ``dynamic_update_slice``: each half written into N-d zeros at its start index;
- ``concatenate``: the two halves concatenated along the last dim;
- ``pad``: each half zero-padded to the full width (``lax.pad``), then added.
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist.device import views

p = argparse.ArgumentParser()
p.add_argument("--shape", type=int, nargs="+", default=[8, 16, 1024, 64])
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--runs", type=int, default=20)
a = p.parse_args()
shape = tuple(a.shape)
half = shape[-1] // 2
half_shape = (*shape[:-1], half)
strides = tuple(int(np.prod(shape[d + 1:])) for d in range(len(shape)))
numel = int(np.prod(shape))
print("device:", jax.devices()[0].device_kind, "shape", shape, a.dtype)

keys = jax.random.split(jax.random.key(0), 3)
g = jax.random.normal(keys[0], shape, jnp.float32).astype(a.dtype)
u_hi = jax.random.normal(keys[1], half_shape, jnp.float32).astype(a.dtype)
u_lo = jax.random.normal(keys[2], half_shape, jnp.float32).astype(a.dtype)


def with_views(g, u_hi, u_lo):
    first = views.write(jnp.zeros((numel,), g.dtype), u_hi, half_shape, strides, 0).reshape(shape)
    second = views.write(jnp.zeros((numel,), g.dtype), u_lo, half_shape, strides, half).reshape(shape)
    return g + first + second


def with_dus(g, u_hi, u_lo):
    zeros = jnp.zeros(shape, g.dtype)
    starts = (0,) * (len(shape) - 1)
    return (g + lax.dynamic_update_slice(zeros, u_hi, (*starts, 0))
            + lax.dynamic_update_slice(zeros, u_lo, (*starts, half)))


def with_concatenate(g, u_hi, u_lo):
    zeros = jnp.zeros(half_shape, g.dtype)
    return g + jnp.concatenate([u_hi, zeros], -1) + jnp.concatenate([zeros, u_lo], -1)


def with_pad(g, u_hi, u_lo):
    zero = jnp.zeros((), g.dtype)
    lead = [(0, 0, 0)] * (len(shape) - 1)
    return g + lax.pad(u_hi, zero, [*lead, (0, half, 0)]) + lax.pad(u_lo, zero, [*lead, (half, 0, 0)])


want = None
for name, fn in [("views.write", with_views), ("dynamic_update_slice", with_dus),
                 ("concatenate", with_concatenate), ("pad", with_pad)]:
    jitted = jax.jit(fn)
    out = jitted(g, u_hi, u_lo).block_until_ready()
    want = out if want is None else want
    equal = bool(jnp.array_equal(out, want))
    times = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        jitted(g, u_hi, u_lo).block_until_ready()
        times.append(time.perf_counter() - t0)
    ops = sorted({line.split("=")[1].split("(")[0].split()[-1] for line in jitted.lower(g, u_hi, u_lo).compile()
                  .as_text().splitlines() if " = " in line and "ENTRY" not in line and "(" in line})
    print(f"{name:<22} median {statistics.median(times) * 1e3:7.3f} ms  (min {min(times) * 1e3:7.3f})  "
          f"equal to the first: {equal}  ops: {' '.join(o for o in ops if o not in ('parameter', 'constant'))[:160]}")
