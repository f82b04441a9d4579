"""Tensor factories: full/empty/zeros/ones/arange/eye/..., their ``*_like`` and ``new_*`` forms, scalars.

Device, layout, pin_memory and memory_format arguments are ignored (the caller places arrays);
``dtype`` is honoured (``call`` casts to torch's inferred dtype when it is None). ``empty*`` returns
zeros: deterministic, and XLA has no uninitialised buffers anyway.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.ops.dtypes import to_jax_dtype
from tpudist.ops.lowerings._util import is_array, is_low_precision, rounding_to
from tpudist.ops.registry import lowers

aten = torch.ops.aten
prims = torch.ops.prims


def _dtype(dtype, fill=None, like=None):
    if dtype is not None:
        return to_jax_dtype(dtype)
    if like is not None:
        return like.dtype
    if fill is None or isinstance(fill, float):
        return to_jax_dtype(torch.get_default_dtype())
    if isinstance(fill, bool):
        return jnp.bool_
    if isinstance(fill, int):
        return jnp.int64
    if is_array(fill):
        return fill.dtype
    return jnp.complex64


@lowers(aten.full.default, prims.full.default)
def full(size, fill_value, *, dtype=None, **_placement):
    return jnp.full(tuple(size), fill_value, _dtype(dtype, fill_value))


@lowers(aten.full_like.default)
def full_like(x, fill_value, *, dtype=None, **_placement):
    return jnp.full(x.shape, fill_value, _dtype(dtype, like=x))


@lowers(aten.new_full.default)
def new_full(x, size, fill_value, *, dtype=None, **_placement):
    return jnp.full(tuple(size), fill_value, _dtype(dtype, like=x))


@lowers(aten.empty.memory_format, aten.zeros.default, aten._efficientzerotensor.default)
def zeros(size, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.empty_strided.default, prims.empty_strided.default)
def empty_strided(size, stride, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, *, dtype=None, **_placement):
    # the layout is an order of strides, which values in a jax.Array do not show (silu_backward's
    # decomposition makes its result this way)
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.ones.default)
def ones(size, *, dtype=None, **_placement):
    return jnp.ones(tuple(size), _dtype(dtype))


@lowers(aten.empty_like.default, aten.zeros_like.default, aten.zero.default)
def zeros_like(x, *, dtype=None, **_placement):
    return jnp.zeros(x.shape, _dtype(dtype, like=x))


@lowers(aten.ones_like.default)
def ones_like(x, *, dtype=None, **_placement):
    return jnp.ones(x.shape, _dtype(dtype, like=x))


@lowers(aten.new_empty.default, aten.new_zeros.default)
def new_zeros(x, size, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype, like=x))


@lowers(aten.new_empty_strided.default)
def new_empty_strided(x, size, stride, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype, like=x))


@lowers(aten.new_ones.default)
def new_ones(x, size, *, dtype=None, **_placement):
    return jnp.ones(tuple(size), _dtype(dtype, like=x))


@lowers(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, jnp.asarray(value).astype(x.dtype) if is_array(value) else value, x.dtype)


@lowers(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, **_placement):
    return jnp.asarray(s, _dtype(dtype if dtype is not None else torch.get_default_dtype()))


@lowers(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(*args, dtype=None, **_placement):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3] if len(args) == 2 else args
    if step == 0:
        raise RuntimeError("arange: step must be nonzero")
    n = max(0, math.ceil((end - start) / step))
    if dtype is None:
        dtype = torch.int64 if all(isinstance(v, int) for v in (start, end, step)) else torch.get_default_dtype()
    if dtype.is_floating_point:
        # torch computes start + i * step in double, then casts
        return (start + np.arange(n, dtype=np.float64) * step).astype(to_jax_dtype(dtype))
    return jnp.asarray(start + np.arange(n, dtype=np.int64) * step, to_jax_dtype(dtype))


@lowers(prims.iota.default)
def iota(length, *, start, step, dtype, device=None, requires_grad=False):
    return start + jnp.arange(length, dtype=to_jax_dtype(dtype)) * step


@lowers(aten.linspace.default)
def linspace(start, end, steps, *, dtype=None, **_placement):
    """torch's CPU kernel: start and end cast to the result's dtype, the step computed in that dtype (in
    float64 for integer results, then truncated), the first half counted up from start and the second half
    down from end, every operation rounded to the dtype (16-bit floats too). start and end may be traced:
    the device passes Python floats as program inputs. Measured against CPU (7 dtypes, 7 lengths up to 1001,
    7 ranges, strict and fused): equal, except complex64 within an ulp."""
    dtype = to_jax_dtype(dtype or torch.get_default_dtype())
    if steps <= 1:
        return jnp.full((steps,), start).astype(dtype)
    i = np.arange(steps)
    upper = i >= steps // 2
    if jnp.issubdtype(dtype, jnp.integer):
        s, e = (jnp.trunc(jnp.real(jnp.asarray(x, jnp.float64))) for x in (start, end))
        step = (e - s) / jax.lax.optimization_barrier(jnp.asarray(steps - 1, jnp.float64))
        return jnp.trunc(jnp.where(upper, e - step * (steps - 1 - i), s + step * i)).astype(dtype)
    low = is_low_precision(dtype)
    compute = jnp.float32 if low else dtype
    r = rounding_to(dtype) if low else (lambda x: x)  # each operation on c10::Half / BFloat16 rounds
    s, e = (r(jnp.asarray(x).astype(compute)) for x in (start, end))
    # a barrier: XLA turns a division by a constant into a multiplication by its rounded reciprocal
    step = r(r(e - s) / jax.lax.optimization_barrier(r(jnp.asarray(steps - 1, compute))))
    if dtype == jnp.float32:
        # torch's float kernel is compiled with fused multiply-adds: start + step * i rounded once. In
        # float64 the product of two floats is exact, so one rounding to float32 is that FMA's
        s, e, step = (x.astype(jnp.float64) for x in (s, e, step))
        up = s + step * i.astype(np.float64)
        down = e - step * (steps - 1 - i).astype(np.float64)
    else:
        up = r(s + r(step * r(jnp.asarray(i, compute))))
        down = r(e - r(step * r(jnp.asarray(steps - 1 - i, compute))))
    return jnp.where(upper, down, up).astype(dtype)


@lowers(aten.eye.default, aten.eye.m)
def eye(n, m=None, *, dtype=None, **_placement):
    return jnp.eye(n, n if m is None else m, dtype=_dtype(dtype))


@lowers(aten._local_scalar_dense.default)
def local_scalar_dense(x):
    if isinstance(x, jax.core.Tracer):
        # JAX's own error for a traced value used as a Python one: the device then rebuilds the op with
        # its float arguments as constants (torch's norm decomposition calls p.item() on a float p
        # that the device passed in as a program input: F.pairwise_distance, triplet_margin_loss)
        raise jax.errors.ConcretizationTypeError(
            x, "aten._local_scalar_dense (Tensor.item()) needs a concrete value and cannot run inside jax.jit; "
               "it is a sync point: the caller must run the program first")
    return np.asarray(x).item()
