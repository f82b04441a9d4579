"""Counting and scattering by value: histc, bincount, unique*, put, embedding_renorm.

``bincount`` and the ``unique`` family have data-dependent output shapes: like ``nonzero`` they run on
concrete arrays (the device runs them outside jax.jit) and raise JAX's concretization error on a
tracer, so a compiled graph containing one fails with that error rather than a wrong shape.
``histc``, ``put`` and ``embedding_renorm`` have static shapes and trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.ops.lowerings._util import concrete, dim_of
from tpudist.ops.lowerings.asserts import check as _check
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _concrete(x, op):
    return concrete(x, op, "run it eagerly (outside torch.compile) or give a static bound "
                           "(e.g. one_hot(...).sum() for bincount)")


@lowers(aten.histc.default)
def histc(x, bins=100, min=0, max=0):  # noqa: A002  (aten's argument names)
    """ATen's linear-interpolation histogram: bin floor((v - lo) * bins / (hi - lo)), v == hi in the last
    bin, values outside [lo, hi] (and NaN) dropped; min == max means the data's own range (widened by
    1 each way when the data is constant)."""
    v = x.reshape(-1)
    if min == max:
        lo, hi = (jnp.min(v), jnp.max(v)) if v.size else (jnp.zeros((), x.dtype), jnp.zeros((), x.dtype))
        lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
        _check(jnp.isfinite(lo) & jnp.isfinite(hi), "torch.histc: range of the data is not finite (it holds NaN "
               "or inf): pass min= and max= to count the finite values")
    elif min > max:
        raise RuntimeError(f"torch.histc: max must be larger than min; got min={min}, max={max}")
    else:
        lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    inside = (v >= lo) & (v <= hi)
    pos = jnp.floor((v - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(inside, jnp.clip(pos, 0, bins - 1), bins)  # bins: a dropped slot
    return jnp.zeros((bins + 1,), x.dtype).at[pos].add(jnp.ones_like(v))[:bins]


@lowers(aten.bincount.default)
def bincount(x, weights=None, minlength=0):
    values = _concrete(x, "aten.bincount")
    if values.ndim != 1 or (values.size and values.min() < 0):
        raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs; got shape {list(values.shape)}"
                           f"{' with negative values' if values.ndim == 1 else ''}")
    if minlength < 0:
        raise RuntimeError(f"bincount: minlength should be >= 0, got {minlength}")
    length = max(int(values.max()) + 1 if values.size else 0, minlength)
    if weights is None:
        return jnp.zeros((length,), jnp.int64).at[values].add(1)
    # ATen accumulates float32 weights in float32 and every other dtype in float64
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.zeros((length,), dtype).at[values].add(weights.astype(dtype))



def _empty_long():
    return jnp.zeros((0,), jnp.int64)


@lowers(aten._unique2.default)
def unique2(x, sorted=True, return_inverse=False, return_counts=False):  # noqa: A002
    # torch sorts whatever sorted says (its CPU kernel does too), and NaNs stay distinct as in np.unique
    values = _concrete(x, "aten._unique2")
    out, inverse, counts = np.unique(values.reshape(-1), return_inverse=True, return_counts=True,
                                     equal_nan=False)
    return (jnp.asarray(out, x.dtype),
            jnp.asarray(inverse.reshape(values.shape), jnp.int64) if return_inverse else _empty_long(),
            jnp.asarray(counts, jnp.int64) if return_counts else _empty_long())


@lowers(aten.unique_dim.default)
def unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):  # noqa: A002
    # ATen's unique_dim fills inverse and counts whether or not they were asked for
    values = _concrete(x, "aten.unique_dim")
    d = dim_of(dim, values.ndim)
    out, inverse, counts = np.unique(values, return_inverse=True, return_counts=True, axis=d)
    return jnp.asarray(out, x.dtype), jnp.asarray(inverse.reshape(-1), jnp.int64), jnp.asarray(counts, jnp.int64)


def _runs(values, axis):
    """Start mask of each run of equal consecutive slices along ``axis``."""
    if values.shape[axis] == 0:
        return np.zeros((0,), bool)
    moved = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
    change = np.any(moved[1:] != moved[:-1], axis=1)
    return np.concatenate([np.ones(1, bool), change])


@lowers(aten.unique_consecutive.default)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    values = _concrete(x, "aten.unique_consecutive")
    flat = dim is None
    axis = 0 if flat else dim_of(dim, values.ndim)
    data = values.reshape(-1) if flat else values
    starts = _runs(data, axis)
    inverse = np.cumsum(starts) - 1
    counts = np.diff(np.append(np.flatnonzero(starts), len(starts)))
    out = np.take(data, np.flatnonzero(starts), axis=axis)
    # with a dim, ATen fills inverse and counts whether or not they were asked for
    return (jnp.asarray(out, x.dtype),
            jnp.asarray(inverse.reshape(values.shape) if flat else inverse, jnp.int64)
            if return_inverse or not flat else _empty_long(),
            jnp.asarray(counts, jnp.int64) if return_counts or not flat else _empty_long())


@lowers(aten.put.default)
def put(x, index, source, accumulate=False):
    """x.flatten()[index] = source (negative indices count from the end), as a flat scatter."""
    flat = x.reshape(-1)
    index = index.reshape(-1)
    index = jnp.where(index < 0, index + flat.shape[0], index)
    source = source.reshape(-1).astype(x.dtype)
    if accumulate and x.dtype == jnp.bool_:  # accumulating bools is a logical or
        return put(x.astype(jnp.int8), index, source.astype(jnp.int8), True) != 0
    at = flat.at[index]
    return (at.add(source) if accumulate else at.set(source)).reshape(x.shape)


def _row_norm(a, p):
    """Each row's p-norm, p possibly a traced scalar (the device passes floats as program inputs)."""
    p = jnp.asarray(p, a.dtype)
    finite = jnp.where((p != 0) & ~jnp.isinf(p), p, 1)
    general = jnp.sum(a ** finite, axis=1) ** (1 / finite)
    return jnp.where(jnp.isinf(p), jnp.max(a, axis=1, initial=0),
                     jnp.where(p == 0, jnp.sum(a != 0, axis=1).astype(a.dtype), general))


@lowers(aten.embedding_renorm.default)
def embedding_renorm(weight, indices, max_norm, norm_type):
    """The functional twin of ``embedding_renorm_`` (nn.Embedding(max_norm=...)): each row ``indices``
    names whose ``norm_type``-norm exceeds max_norm is scaled by max_norm / (norm + 1e-7)."""
    touched = jnp.zeros((weight.shape[0],), bool).at[indices.reshape(-1)].set(True)
    w = weight.astype(jnp.promote_types(weight.dtype, jnp.float32))
    norm = _row_norm(jnp.abs(w), norm_type)
    scale = jnp.where(touched & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return (w * scale[:, None]).astype(weight.dtype)
