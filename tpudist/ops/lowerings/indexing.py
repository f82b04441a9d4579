"""Indexing: index/index_put, gather/scatter, index_select/add/copy/fill, embedding, nonzero, masks.

Boolean index tensors have data-dependent shapes: ``index`` / ``nonzero`` / ``masked_select`` with a
mask work only outside ``jax.jit`` (on concrete arrays); inside a traced program they raise. The one
exception is ``index_put`` with a single mask (``x[mask] = v``, ``+=`` with accumulate), which becomes a
``where``.
Out-of-range indices are not checked inside jit (JAX clamps gathers and drops scatters).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.ops.lowerings._util import concrete, dim_of, is_array, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _concrete_mask(mask, op):
    return concrete(mask, f"{op} with a boolean mask", "run it eagerly or use torch.where")


def _index_tuple(indices, op):
    index = []
    for i in indices:
        if i is None:
            index.append(slice(None))
        elif i.dtype == jnp.bool_ or i.dtype == jnp.uint8:
            index.extend(np.nonzero(_concrete_mask(i, op)))
        else:
            index.append(i)
    return tuple(index)


@lowers(aten.index.Tensor, aten._unsafe_index.Tensor)
def index(x, indices):
    return x[_index_tuple(indices, "aten.index")]


def _per_true(x, mask, values):
    """values (number of Trues, *x.shape[mask.ndim:]) laid out in x's shape, the k-th True's place holding
    values[k], inside jit too: a running count of the mask picks it, so no data-dependent shape arises."""
    from tpudist.ops.lowerings.asserts import check as _check  # checked now, or by the program when it runs

    _check(jnp.sum(mask) == values.shape[0], f"shape mismatch: value tensor of shape {list(values.shape)} "
           "cannot be broadcast to indexing result: x[mask] = values needs one value per True element of mask")
    position = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, max(values.shape[0] - 1, 0)).reshape(mask.shape)
    return values[position] if values.shape[0] else jnp.zeros(mask.shape + values.shape[1:], values.dtype)


def _put_mask(x, mask, values, accumulate):
    """``x[mask] = values`` (``+=`` with ``accumulate``) as a ``where``, or None where values' shape is neither
    broadcast over the selected elements nor one row per True element."""
    tail = x.ndim - mask.ndim
    if values.ndim <= tail or values.size == 1:  # the same values for every selected element
        placed = values.reshape(values.shape[-tail:] if values.ndim and tail else ())
    elif values.shape[1:] == x.shape[mask.ndim:]:  # one value per True element, in order
        placed = _per_true(x, mask, values)
    else:
        return None
    keep = mask.reshape(mask.shape + (1,) * tail)
    if not accumulate:
        return jnp.where(keep, placed, x)
    if x.dtype == jnp.bool_:  # accumulating bools is a logical or
        return x | (keep & placed)
    return jnp.where(keep, x + placed, x)  # not x + where(keep, placed, 0): -0.0 elsewhere stays -0.0


@lowers(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(x, indices, values, accumulate=False):
    values = values.astype(x.dtype)
    if len(indices) == 1 and indices[0] is not None and indices[0].dtype == jnp.bool_:
        out = _put_mask(x, indices[0], values, accumulate)
        if out is not None:
            return out
    index = _index_tuple(indices, "aten.index_put")
    if accumulate and x.dtype == jnp.bool_:  # accumulating bools is a logical or
        return x.astype(jnp.int8).at[index].add(values.astype(jnp.int8)) != 0
    return x.at[index].add(values) if accumulate else x.at[index].set(values)


@lowers(aten._index_put_impl.default)
def index_put_impl(x, indices, values, accumulate=False, unsafe=False):
    # what autograd's backward of x[index] writes with (index_put_ with accumulate): unsafe only skips
    # torch's own bounds checks, which Debug mode makes for every index
    return index_put(x, indices, values, accumulate)


@lowers(aten.index_select.default)
def index_select(x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, index.reshape(-1), axis=dim_of(dim, x.ndim))


def _grid(index, dim):
    """Index tuples for x[...] where dim takes ``index`` and every other dim its own position."""
    grid = [jax.lax.broadcasted_iota(jnp.int64, index.shape, d) for d in range(index.ndim)]
    grid[dim] = index
    return tuple(grid)


@lowers(aten.take.default)
def take(x, index):
    """x viewed as 1-d, indexed (negative indices count from the end, as in torch). Lowered rather than
    decomposed: torch's decomposition checks the bounds with item(), which a traced program cannot."""
    return x.reshape(-1)[index]


@lowers(aten.gather.default)
def gather(x, dim, index, *, sparse_grad=False):
    if index.size == 0:  # torch checks the index's rank against x's only when it has elements
        return jnp.zeros(index.shape, x.dtype)
    if x.ndim == 0:
        return jnp.broadcast_to(x, index.shape)
    d = dim_of(dim, x.ndim)
    return x[_grid(index, d)]


def _scatter(x, dim, index, src, reduce):
    if x.ndim == 0:
        x, index = x.reshape(1), index.reshape(1)
        src = src.reshape(1) if is_array(src) and src.ndim == 0 else src
        return _scatter(x, 0, index, src, reduce).reshape(())
    d = dim_of(dim, x.ndim)
    if is_array(src):
        src = src[tuple(slice(0, n) for n in index.shape)].astype(x.dtype)
    else:
        src = jnp.full(index.shape, src, x.dtype)
    if x.dtype == jnp.bool_ and reduce is not None:  # or/and on bools: reduce as int8
        return _scatter(x.astype(jnp.int8), dim, index, src.astype(jnp.int8), reduce) != 0
    at = x.at[_grid(index, d)]
    if reduce is None:
        return at.set(src)
    if reduce in ("add", "sum"):
        return at.add(src)
    if reduce in ("multiply", "prod"):
        return at.multiply(src)
    if reduce == "amax":
        return at.max(src)
    if reduce == "amin":
        return at.min(src)
    raise ValueError(f"reduce={reduce!r}: scatter takes 'add', 'multiply', 'sum', 'prod', 'mean', 'amax', 'amin'")


@lowers(aten.scatter.src, aten.scatter.value)
def scatter(x, dim, index, src):
    return _scatter(x, dim, index, src, None)


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    return _scatter(x, dim, index, src, reduce)


@lowers(aten.scatter_add.default)
def scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, "add")


@lowers(aten.scatter_reduce.two)
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    if x.dtype == jnp.bool_:
        return scatter_reduce(x.astype(jnp.int8), dim, index, src.astype(jnp.int8), reduce,
                              include_self=include_self) != 0
    if reduce == "mean":
        count = _scatter(jnp.ones(x.shape, jnp.int64) if include_self else jnp.zeros(x.shape, jnp.int64),
                         dim, index, jnp.ones(index.shape, jnp.int64), "add")
        total = _scatter(upcast(x) if include_self else jnp.zeros(x.shape, upcast(x).dtype), dim, index,
                         upcast(src), "add")
        mean = total / jnp.maximum(count, 1)
        mean = jnp.floor_divide(total, jnp.maximum(count, 1)) if jnp.issubdtype(x.dtype, jnp.integer) else mean
        return jnp.where(count > 0, mean, x).astype(x.dtype)
    if include_self:
        return _scatter(x, dim, index, src, reduce)
    identity = {"sum": 0, "prod": 1}
    if reduce in identity:
        base = _scatter(x, dim, index, jnp.full(index.shape, identity[reduce], x.dtype), None)
    else:
        info = jnp.finfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype)
        fill = info.min if reduce == "amax" else info.max
        if jnp.issubdtype(x.dtype, jnp.floating):
            fill = -jnp.inf if reduce == "amax" else jnp.inf
        base = _scatter(x, dim, index, jnp.full(index.shape, fill, x.dtype), None)
    return _scatter(base, dim, index, src, reduce)


@lowers(aten.index_add.default)
def index_add(x, dim, index, source, *, alpha=1):
    d = dim_of(dim, x.ndim) if x.ndim else 0
    idx = [slice(None)] * x.ndim
    if x.ndim == 0:
        return x + (source * alpha).astype(x.dtype).sum()
    idx[d] = index
    src = source.astype(x.dtype)
    return x.at[tuple(idx)].add(src if alpha == 1 else src * alpha)


@lowers(aten.index_reduce.default)
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    if x.dtype == jnp.bool_:
        return index_reduce(x.astype(jnp.int8), dim, index, source.astype(jnp.int8), reduce,
                            include_self=include_self) != 0
    if x.ndim == 0:
        x, source = x.reshape(1), source.reshape(1)
        return index_reduce(x, 0, index.reshape(1), source, reduce, include_self=include_self).reshape(())
    d = dim_of(dim, x.ndim)
    idx = [slice(None)] * x.ndim
    idx[d] = index
    idx = tuple(idx)
    src = source.astype(x.dtype)
    if reduce == "mean":
        ones = jnp.ones(source.shape, jnp.int64)
        count = jnp.zeros(x.shape, jnp.int64).at[idx].add(ones) + (1 if include_self else 0)
        total = (x if include_self else jnp.zeros_like(x)).astype(upcast(x).dtype).at[idx].add(upcast(src))
        mean = (jnp.floor_divide(total, jnp.maximum(count, 1)) if jnp.issubdtype(x.dtype, jnp.integer)
                else total / jnp.maximum(count, 1))
        return jnp.where(count > 0, mean, x)
    if not include_self:
        fill = {"prod": 1, "amax": -jnp.inf, "amin": jnp.inf}[reduce]
        if jnp.issubdtype(x.dtype, jnp.integer):
            info = jnp.iinfo(x.dtype)
            fill = {"prod": 1, "amax": info.min, "amin": info.max}[reduce]
        x = x.at[idx].set(jnp.asarray(fill).astype(x.dtype))
    at = x.at[idx]
    if reduce == "prod":
        return at.multiply(src)
    if reduce == "amax":
        return at.max(src)
    if reduce == "amin":
        return at.min(src)
    raise ValueError(f"reduce={reduce!r}: index_reduce takes 'prod', 'mean', 'amax' or 'amin'")


@lowers(aten.index_copy.default)
def index_copy(x, dim, index, source):
    if x.ndim == 0:
        return source.reshape(()).astype(x.dtype)
    idx = [slice(None)] * x.ndim
    idx[dim_of(dim, x.ndim)] = index
    return x.at[tuple(idx)].set(source.astype(x.dtype))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    if x.ndim == 0:
        return jnp.asarray(value).astype(x.dtype).reshape(())
    idx = [slice(None)] * x.ndim
    idx[dim_of(dim, x.ndim)] = index
    return x.at[tuple(idx)].set(jnp.asarray(value).astype(x.dtype))


@lowers(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    x, mask = jnp.broadcast_arrays(x, mask)  # the result takes both shapes, as torch's out-of-place op does
    positions = jnp.cumsum(mask.reshape(-1).astype(jnp.int64)) - 1
    values = source.reshape(-1)[jnp.clip(positions, 0, max(source.size - 1, 0))].reshape(x.shape)
    return jnp.where(mask, values.astype(x.dtype), x)


@lowers(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of masked_scatter's source: the masked elements of grad, in order, zero-padded."""
    numel = int(np.prod(sizes))
    mask = jnp.broadcast_to(mask, grad_output.shape).reshape(-1)
    dest = jnp.where(mask, jnp.cumsum(mask.astype(jnp.int64)) - 1, numel)  # numel: dropped
    out = jnp.zeros((numel,), grad_output.dtype).at[dest].set(grad_output.reshape(-1), mode="drop")
    return out.reshape(tuple(sizes))


@lowers(aten.masked_select.default)
def masked_select(x, mask):
    x, mask = jnp.broadcast_arrays(x, mask)
    return x[_concrete_mask(mask, "aten.masked_select")]


@lowers(aten.nonzero.default)
def nonzero(x):
    if x.ndim == 0:
        return jnp.zeros((int(_concrete_mask(x, "aten.nonzero") != 0), 0), jnp.int64)
    return jnp.stack(np.nonzero(_concrete_mask(x, "aten.nonzero")), axis=-1).astype(jnp.int64).reshape(-1, x.ndim)


@lowers(aten.repeat_interleave.Tensor)
def repeat_interleave_indices(repeats, *, output_size=None):
    """``i`` repeated ``repeats[i]`` times (``x.repeat_interleave(repeats, dim)`` gathers with it). Its
    length is the repeats' sum: read on the host unless ``output_size`` gives it (then it traces)."""
    if repeats.ndim != 1:
        raise RuntimeError(f"repeat_interleave: repeats must be a 1-d tensor here, got shape {tuple(repeats.shape)}")
    if output_size is not None:
        return jnp.repeat(jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats,
                          total_repeat_length=output_size)
    counts = concrete(repeats, "aten.repeat_interleave with tensor repeats", "pass output_size=")
    if (counts < 0).any():
        raise RuntimeError("repeats can not be negative")
    return jnp.asarray(np.repeat(np.arange(counts.shape[0]), counts), repeats.dtype)


@lowers(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    # a static shape, so it traces: the first ``size`` indices in row-major order, then fill_value rows
    if x.ndim == 0:
        found = jnp.zeros((size, 0), jnp.int64)
        return found
    indices = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(indices, axis=-1).astype(jnp.int64).reshape(size, x.ndim)


@lowers(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    grad = upcast(grad_output).reshape(flat.shape[0], -1)
    keep = flat != padding_idx
    grad = jnp.where(keep[:, None], grad, 0)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), jnp.int64).at[flat].add(1)
        grad = grad / counts[flat][:, None]
    out = jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[flat].add(grad)
    return out


@lowers(aten.searchsorted.Tensor)
def searchsorted(sorted_sequence, x, *, out_int32=False, right=False, side=None, sorter=None):
    side = side or ("right" if right else "left")
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    if sorted_sequence.ndim == 1:
        return jnp.searchsorted(sorted_sequence, x, side=side)
    flat_seq = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
    flat_x = x.reshape(flat_seq.shape[0], -1)
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(flat_seq, flat_x)
    return out.reshape(x.shape)


@lowers(aten.bucketize.Tensor)
def bucketize(x, boundaries, *, out_int32=False, right=False):
    return jnp.searchsorted(boundaries, x, side="right" if right else "left")
