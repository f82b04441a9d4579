"""Views and shape ops as functional ops, plus copies and casts.

A view lowering returns a new array with the view's values: aliasing is the caller's business (the
device keeps views on a shared storage; a compiled graph is functional). ``as_strided`` reads its input
as the contiguous buffer it views (the storage, for the device). The ``*_copy`` ops functionalization
produces share the view lowerings.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.bridge import to_jax_dtype
from tpudist.ops.lowerings._util import dim_of
from tpudist.ops.registry import lowers

aten = torch.ops.aten
prims = torch.ops.prims


def _infer_size(shape, numel):
    shape = list(shape)
    if -1 in shape:
        i = shape.index(-1)
        rest = math.prod(s for j, s in enumerate(shape) if j != i)
        shape[i] = numel // rest if rest else 0
    return tuple(shape)


@lowers(aten.view.default, aten._unsafe_view.default, aten.view_copy.default,
        aten._reshape_alias.default, aten._reshape_alias_copy.default, prims.reshape.default)
def view(x, size, *_stride):
    return jnp.reshape(x, _infer_size(size, x.size))


@lowers(aten.view.dtype, aten.view_copy.dtype)
def view_dtype(x, dtype):
    want = jnp.dtype(to_jax_dtype(dtype))
    if want.itemsize == x.dtype.itemsize:
        return jax.lax.bitcast_convert_type(x, want)
    if want.itemsize < x.dtype.itemsize:
        y = jax.lax.bitcast_convert_type(x, want)  # adds a trailing dim of itemsize ratio
        return y.reshape(*x.shape[:-1], -1)
    ratio = want.itemsize // x.dtype.itemsize
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, ratio), want)


@lowers(aten.expand.default, aten.expand_copy.default)
def expand(x, size, *, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@lowers(prims.broadcast_in_dim.default)
def broadcast_in_dim(x, shape, broadcast_dimensions):
    return jax.lax.broadcast_in_dim(x, tuple(shape), tuple(broadcast_dimensions))


@lowers(aten.permute.default, aten.permute_copy.default, prims.transpose.default)
def permute(x, dims):
    return jnp.transpose(x, [dim_of(d, x.ndim) for d in dims]) if x.ndim else x


@lowers(aten.transpose.int, aten.transpose_copy.int)
def transpose(x, dim0, dim1):
    return jnp.swapaxes(x, dim_of(dim0, x.ndim), dim_of(dim1, x.ndim)) if x.ndim else x


@lowers(aten.t.default, aten.t_copy.default)
def t(x):
    return x.T if x.ndim == 2 else x


def _slice_bounds(n, start, end, step):
    start = 0 if start is None else start
    end = n if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    return start, end, step


@lowers(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(x, dim=0, start=None, end=None, step=1):
    d = dim_of(dim, x.ndim)
    start, end, step = _slice_bounds(x.shape[d], start, end, step)
    return jax.lax.slice_in_dim(x, start, end, step, axis=d)


@lowers(aten.select.int, aten.select_copy.int)
def select(x, dim, index):
    d = dim_of(dim, x.ndim)
    n = x.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size {tuple(x.shape)} at dimension {d}")
    return jax.lax.index_in_dim(x, index % n, axis=d, keepdims=False)


@lowers(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.default,
        aten.squeeze_copy.dim, aten.squeeze_copy.dims, prims.squeeze.default)
def squeeze(x, dim=None):
    if dim is None:
        return jnp.squeeze(x)
    dims = [dim] if isinstance(dim, int) else dim
    dims = {dim_of(d, x.ndim) for d in dims} if x.ndim else set()
    return jnp.squeeze(x, tuple(d for d in dims if x.shape[d] == 1))


@lowers(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(x, dim):
    return jnp.expand_dims(x, dim % (x.ndim + 1))


@lowers(aten.alias.default, aten.alias_copy.default, aten.clone.default, aten.lift_fresh_copy.default,
        aten.detach.default, aten.detach_copy.default, aten.lift_fresh.default)
def clone(x, *, memory_format=None):
    return x


@lowers(aten._to_copy.default)
def to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return x if dtype is None else x.astype(to_jax_dtype(dtype))


@lowers(prims.convert_element_type.default)
def convert_element_type(x, dtype):
    return x.astype(to_jax_dtype(dtype))


@lowers(aten.copy.default)
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(jnp.asarray(src).astype(x.dtype), x.shape)


def _strided_index(size, stride, storage_offset):
    """The flat input position of every element of an as_strided view."""
    index = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        index = index + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return index


@lowers(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(x, size, stride, storage_offset=None):
    flat = x.reshape(-1)
    index = _strided_index(size, stride, storage_offset)
    if index.size and (index.min() < 0 or index.max() >= max(flat.size, 1)):
        raise RuntimeError(f"as_strided: size={list(size)} stride={list(stride)} storage_offset={storage_offset} "
                           f"reaches outside the {flat.size} elements of its input")
    return flat[index] if index.size else jnp.zeros(tuple(size), x.dtype)


@lowers(aten.as_strided_scatter.default)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    flat = x.reshape(-1)
    index = _strided_index(size, stride, storage_offset)
    return flat.at[index].set(src.astype(x.dtype)).reshape(x.shape)


@lowers(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, dim_of(dim1, x.ndim), dim_of(dim2, x.ndim))


@lowers(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    d1, d2 = dim_of(dim1, x.ndim), dim_of(dim2, x.ndim)
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    n1, n2 = moved.shape[-2:]
    rows = np.arange(max(0, -offset), max(0, -offset) + src.shape[-1])
    cols = rows + offset
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@lowers(aten.split.Tensor, aten.split_copy.Tensor)
def split(x, split_size, dim=0):
    d = dim_of(dim, x.ndim)
    n = x.shape[d]
    if split_size == 0:
        return [x] if n == 0 else []
    return [jax.lax.slice_in_dim(x, i, min(i + split_size, n), axis=d) for i in range(0, max(n, 1), split_size)]


@lowers(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def split_with_sizes(x, split_sizes, dim=0):
    d = dim_of(dim, x.ndim)
    starts = np.cumsum([0, *split_sizes])
    return [jax.lax.slice_in_dim(x, int(s), int(s + n), axis=d) for s, n in zip(starts, split_sizes)]


@lowers(aten.unbind.int, aten.unbind_copy.int)
def unbind(x, dim=0):
    d = dim_of(dim, x.ndim)
    return [jax.lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


@lowers(aten.cat.default, prims.cat.default)
def cat(tensors, dim=0):
    # torch skips legacy empty 1-D tensors (shape (0,)) when concatenating higher-dim tensors
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return tensors[0] if tensors else jnp.zeros((0,))
    dtype = jnp.result_type(*tensors)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=dim_of(dim, kept[0].ndim))


@lowers(aten.stack.default)
def stack(tensors, dim=0):
    dtype = jnp.result_type(*tensors)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=dim % (tensors[0].ndim + 1))


@lowers(aten.flip.default, prims.rev.default)
def flip(x, dims):
    return jnp.flip(x, tuple(dim_of(d, x.ndim) for d in dims)) if x.ndim else x


@lowers(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(dim_of(d, x.ndim) for d in dims))


@lowers(aten.repeat.default)
def repeat(x, repeats):
    x = x.reshape((1,) * (len(repeats) - x.ndim) + tuple(x.shape))
    return jnp.tile(x, tuple(repeats))


@lowers(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    # pad lists (before, after) pairs from the last dim backwards; negative amounts crop
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return jax.lax.pad(x, jnp.asarray(value).astype(x.dtype), config)


@lowers(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    d = dim_of(dim, x.ndim)
    start, end, step = _slice_bounds(x.shape[d], start, end, step)
    index = [slice(None)] * x.ndim
    index[d] = slice(start, end, step)
    return x.at[tuple(index)].set(src.astype(x.dtype))


@lowers(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    d = dim_of(dim, x.ndim)
    idx = [slice(None)] * x.ndim
    idx[d] = index % x.shape[d]
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@lowers(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowers(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowers(aten.unfold.default, aten.unfold_copy.default)
def unfold(x, dimension, size, step):
    if x.ndim == 0:
        return x.reshape(1)
    d = dim_of(dimension, x.ndim)
    num = (x.shape[d] - size) // step + 1
    starts = np.arange(num) * step
    windows = jnp.take(x, (starts[:, None] + np.arange(size)[None, :]).reshape(-1), axis=d)
    windows = windows.reshape(*x.shape[:d], num, size, *x.shape[d + 1:])
    return jnp.moveaxis(windows, d + 1, -1)


@lowers(prims.collapse_view.default, prims.collapse.default)
def collapse(x, start, end):
    end = end + 1  # prims' end is inclusive
    return x.reshape(*x.shape[:start], math.prod(x.shape[start:end]), *x.shape[end:])


@lowers(prims.split_dim.default)
def split_dim(x, dim, outer_length):
    return x.reshape(*x.shape[:dim], outer_length, x.shape[dim] // outer_length, *x.shape[dim + 1:])



