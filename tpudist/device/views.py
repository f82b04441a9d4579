"""Views over a flat storage, as static slices and reshapes (no gathers or scatters where avoidable).

A "tpu" tensor is ``(sizes, strides, storage_offset)`` over its storage, and the storage holds one
flat ``jax.Array``. ``read`` turns a view into its value; ``write`` puts a value into the elements a
view covers and returns the new flat storage. A non-overlapping strided view (slices, transposes,
narrows, selects: every view torch's view ops produce except ``unfold``-like overlaps) is walked dim
by dim, outermost stride first: reshape the covered span to ``(size, stride)`` rows, keep the first
column(s), recurse; a view whose offset lies inside its innermost rows (``x[..., 32:]``) starts at those
rows and takes its columns from there (``column``). Everything is static, so XLA sees slices, reshapes
and dynamic_update_slice with constant offsets (an index scatter would cost ~1 ms per write on
XLA:CPU; FACTS.md).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist._strides import contiguous_strides, inverse, is_contiguous, permuted_order  # noqa: F401

Geometry = tuple  # (sizes, strides, offset)


def _plan(sizes, strides):
    """Dims that matter (size > 1, stride > 0), outermost stride first; None if they overlap.

    Each dim's stride must cover the span of the dims inside it (``x[:, ::2]`` of a width-5 row: stride
    5, inner span 5): the row walk pads a row to ``size * stride`` and never touches the padding.
    """
    dims = [d for d, (n, s) in enumerate(zip(sizes, strides)) if n > 1 and s > 0]
    dims.sort(key=lambda d: -strides[d])
    inner_span = 1
    for d in reversed(dims):
        if strides[d] < inner_span:
            return None
        inner_span += (sizes[d] - 1) * strides[d]
    return dims


def _element_index(sizes, strides, offset):
    """The storage index of every element of a view, as a numpy array of the view's shape."""
    index = np.full((), offset, np.int64)
    for n, s in zip(sizes, strides):
        index = index[..., None] + np.arange(n) * s
    return index


def _span(flat, offset, length):
    """``flat[offset:offset+length]``, zero-padded past the end (the padding is never read back)."""
    n = flat.shape[0]
    end = min(n, offset + length)
    part = lax.slice(flat, (offset,), (end,)) if (offset, end) != (0, n) else flat
    if end - offset < length:
        part = jnp.pad(part, (0, length - (end - offset)))
    return part


# The most phases one view's site compiles: each phase is its own program, so only an interleaving of
# a few elements (RoPE's pairs, a complex's (re, im), RGB triples) keeps its offset a constant. An offset
# below a wider step is a position (column t of a (batch, capacity) mask: one program per t).
MAX_PHASES = 4


def phase(sizes, strides, offset) -> int:
    """The phase of an interleaving a view's offset picks (the odd elements of pairs: 1), or 0: an offset
    below every stride of the view's dims that step (size > 1, stride > 0), where that stride is at most
    ``MAX_PHASES``. A position (a cache's row t, a mask's column t) is no phase."""
    steps = [s for n, s in zip(sizes, strides) if n > 1 and s > 0]
    return offset if steps and 0 < offset < min(steps) <= MAX_PHASES else 0


def column(sub_sizes, sub_strides, offset) -> int:
    """Where a view's innermost run starts inside its storage's innermost rows, when its offset lies there.

    ``x[..., 32:]`` of a (..., 64) tensor has offset 32: its elements are columns 32-63 of the rows of 64.
    The row walk starting at ``offset`` reads (and writes back) a span shifted by 32 elements, a copy of the
    whole storage in a flat array's layout (on a TPU a relayout; the v5e's profile of HF Llama's Fused step
    showed the rotary halves' updates at about 0.5 ms per 16 MiB). Started at ``offset - c`` instead, the rows
    are the storage's own and the innermost level slices columns ``c`` onward. ``c`` is ``offset`` modulo the
    row length (the second-innermost stride) where the rest of the view fits beside it at every level; 0
    otherwise (and for phases, ``phase``, which the innermost pick takes)."""
    if len(sub_sizes) < 2:
        return 0
    c = offset % sub_strides[-2]
    if not c or phase(sub_sizes, sub_strides, offset):
        return 0
    inner_span = 1 + (sub_sizes[-1] - 1) * sub_strides[-1]
    for n, s in zip(reversed(sub_sizes[:-1]), reversed(sub_strides[:-1])):  # the levels outside the innermost
        if c + inner_span > s:  # the rows shifted by c do not fit in this level's
            return 0
        inner_span += (n - 1) * s
    # the innermost run itself, from column c, inside its row (no padding of the row)
    return c if c + sub_sizes[-1] * sub_strides[-1] <= sub_strides[-2] else 0


def few_columns(sizes, strides, offset) -> bool:
    """Whether a view's offset is a column (``column``) picking one of at most ``MAX_PHASES`` runs of its
    row: a half of a head dim (``rotate_half``), not a position (a cache's slot ``t`` among many). As a
    phase does, it stays a constant where the offset changes (tpudist.device._core): static, its rows are
    read in place; as a runtime input, the read is a dynamic slice of the whole flat storage."""
    dims = _plan(sizes, strides)
    if not dims or len(dims) < 2:
        return False
    sub_sizes, sub_strides = [sizes[d] for d in dims], [strides[d] for d in dims]
    run = sub_sizes[-1] * sub_strides[-1]
    return bool(column(sub_sizes, sub_strides, offset)) and sub_strides[-2] <= MAX_PHASES * run


def _rows_read(block, sizes, strides, phase=0, col=0):
    """block: (*lead, L); returns (*lead, *sizes) picking the strided elements of each row, each the
    ``phase``-th of its innermost step."""
    if not sizes:
        return block[..., phase]
    size, stride = sizes[0], strides[0]
    lead = block.shape[:-1]
    need = size * stride
    start = col if len(sizes) == 1 else 0  # the innermost run starts at its column (column())
    if block.shape[-1] < start + need:
        block = jnp.pad(block, [(0, 0)] * len(lead) + [(0, start + need - block.shape[-1])])
    sub = block[..., start:start + need].reshape(*lead, size, stride)
    return _rows_read(sub, sizes[1:], strides[1:], phase, col)


def _rows_write(block, value, sizes, strides, col=0):
    """Writes value (*lead, *sizes) into the strided elements of block's rows (*lead, L), the innermost run
    from column ``col`` (column())."""
    lead = block.shape[:-1]
    zeros = (0,) * block.ndim
    if not sizes:
        return lax.dynamic_update_slice(block, value[..., None].astype(block.dtype), zeros)
    size, stride = sizes[0], strides[0]
    need = size * stride
    start = col if len(sizes) == 1 else 0
    length = block.shape[-1]
    if length < start + need:
        block = jnp.pad(block, [(0, 0)] * len(lead) + [(0, start + need - length)])
    sub = block[..., start:start + need].reshape(*lead, size, stride)
    sub = _rows_write(sub, value, sizes[1:], strides[1:], col)
    block = lax.dynamic_update_slice(block, sub.reshape(*lead, need), (*zeros[:-1], start))
    return block[..., :length] if length < start + need else block


def read(flat, sizes, strides, offset):
    """The value of the view ``(sizes, strides, offset)`` of the flat storage array ``flat``."""
    sizes, strides = tuple(sizes), tuple(strides)
    numel = math.prod(sizes)
    if numel == 0:
        return jnp.zeros(sizes, flat.dtype)
    if is_contiguous(sizes, strides):
        return _span(flat, offset, numel).reshape(sizes)
    order = permuted_order(sizes, strides)
    if order is not None:  # a dense permuted layout (channels_last, a transpose of a whole tensor)
        physical = _span(flat, offset, numel).reshape([sizes[d] for d in order])
        return jnp.transpose(physical, inverse(order))
    dims = _plan(sizes, strides)
    if dims is None:  # overlapping view (unfold, as_strided tricks): one gather
        return flat[_element_index(sizes, strides, offset)]
    if not dims:
        value = _span(flat, offset, 1).reshape(())
    else:
        sub_sizes = [sizes[d] for d in dims]
        sub_strides = [strides[d] for d in dims]
        first = sub_sizes[0] * sub_strides[0]
        # An offset below the innermost step is a phase (the odd elements of pairs): the rows start at
        # 0 and the innermost pick takes the phase, static slices of the storage's own rows where a
        # span from the offset was a shifted copy of the whole storage (padded at its end)
        picked = phase(sizes, strides, offset)
        col = column(sub_sizes, sub_strides, offset)
        block = _span(flat, offset - picked - col, first).reshape(sub_sizes[0], sub_strides[0])
        value = _rows_read(block, sub_sizes[1:], sub_strides[1:], picked, col)
        # value has shape (sub_sizes...); put the dims back in the view's order
        order = [dims.index(d) for d in sorted(dims)]
        value = jnp.transpose(value, order) if order != sorted(order) else value
    kept = sorted(dims)
    shape_kept = [sizes[d] if d in kept else 1 for d in range(len(sizes))]
    value = value.reshape(shape_kept)
    return jnp.broadcast_to(value, sizes) if tuple(shape_kept) != sizes else value


def write(flat, value, sizes, strides, offset):
    """``flat`` with the elements of the view ``(sizes, strides, offset)`` replaced by ``value``."""
    sizes, strides = tuple(sizes), tuple(strides)
    numel = math.prod(sizes)
    value = jnp.broadcast_to(value.astype(flat.dtype), sizes)
    if numel == 0:
        return flat
    if is_contiguous(sizes, strides):
        if offset == 0 and numel == flat.shape[0]:
            return value.reshape(-1)
        return lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
    order = permuted_order(sizes, strides)
    if order is not None:
        physical = jnp.transpose(value, order).reshape(-1)
        if offset == 0 and numel == flat.shape[0]:
            return physical
        return lax.dynamic_update_slice(flat, physical, (offset,))
    dims = _plan(sizes, strides)
    if dims is None:
        index = _element_index(sizes, strides, offset)
        if np.unique(index).size == index.size:  # interleaved, not overlapping (as_strided): one scatter
            return flat.at[index.reshape(-1)].set(value.reshape(-1))
        raise NotImplementedError(
            f"writing through an overlapping view (sizes={sizes}, strides={strides}) is not supported "
            "on the tpu device; torch also refuses most writes to overlapping memory: clone() first")
    for d in range(len(sizes)):
        if sizes[d] > 1 and strides[d] == 0:
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor "
                               "refers to a single memory location. Please clone() the tensor before "
                               "performing the operation.")
    if not dims:
        return lax.dynamic_update_slice(flat, value.reshape(1), (offset,))
    value = value.reshape([sizes[d] for d in sorted(dims)])
    kept = sorted(dims)
    value = jnp.transpose(value, [kept.index(d) for d in dims])  # outermost stride first
    sub_sizes = [sizes[d] for d in dims]
    sub_strides = [strides[d] for d in dims]
    first = sub_sizes[0] * sub_strides[0]
    n = flat.shape[0]
    col = column(sub_sizes, sub_strides, offset)
    offset -= col  # the rows start there; the innermost run from column col
    block = _span(flat, offset, first).reshape(sub_sizes[0], sub_strides[0])
    block = _rows_write(block, value, sub_sizes[1:], sub_strides[1:], col).reshape(-1)
    keep = min(first, n - offset)
    block = block[:keep] if keep < first else block
    return block if offset == 0 and keep == n else lax.dynamic_update_slice(flat, block, (offset,))


# -- views of another dtype over the same bytes (view(dtype), view_as_real, view_as_complex, real, imag) --


def reinterpret(flat, dtype):
    """The flat storage ``flat`` read as elements of ``dtype`` (same bytes, element count scaled).

    torch lets a view change the element type of its storage: ``view_as_real`` reads a complex64
    storage as float32 pairs, ``view_as_complex`` the reverse, ``x.view(torch.uint8)`` bytes. The
    view's sizes, strides and offset count elements of its own dtype, so the storage is reinterpreted
    first and the view read from that. XLA's bitcast changes element sizes (adding or dropping a minor
    dim) but has no complex types: a complex storage is its (real, imag) pairs of the component type.
    A storage whose bytes do not fill a whole number of wider elements is zero-padded at the end
    (torch's views never read those bytes).
    """
    want = np.dtype(dtype)
    have = np.dtype(flat.dtype)
    if have == want:
        return flat
    if have == np.bool_:  # XLA bitcasts no bools: a bool is its byte (torch stores 0 or 1)
        return reinterpret(flat.astype(np.uint8), want)
    if want == np.bool_:
        return reinterpret(flat, np.uint8) != 0
    if have.kind == "c":
        pairs = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
        return reinterpret(pairs, want)
    if want.kind == "c":
        part = np.dtype(jnp.real(jnp.zeros((), want)).dtype)
        pairs = reinterpret(flat, part)
        if pairs.shape[0] % 2:
            pairs = jnp.pad(pairs, (0, 1))
        pairs = pairs.reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if have.itemsize == want.itemsize:
        return lax.bitcast_convert_type(flat, want)
    if have.itemsize > want.itemsize:
        return lax.bitcast_convert_type(flat, want).reshape(-1)
    ratio = want.itemsize // have.itemsize
    if flat.shape[0] % ratio:
        flat = jnp.pad(flat, (0, ratio - flat.shape[0] % ratio))
    return lax.bitcast_convert_type(flat.reshape(-1, ratio), want)


def _restore(flat, dtype, numel: int):
    """``reinterpret`` back to the storage's ``dtype`` and element count (drops the padding)."""
    back = reinterpret(flat, dtype)
    return back[:numel] if back.shape[0] != numel else back


def read_as(flat, sizes, strides, offset, dtype):
    """The value of the view ``(sizes, strides, offset)`` of dtype ``dtype`` over the flat storage."""
    return read(reinterpret(flat, dtype), sizes, strides, offset)


def extent(sizes, strides) -> int:
    """Elements from a view's first to its last, plus one: what it covers of its storage."""
    return 1 + sum((n - 1) * s for n, s in zip(sizes, strides))


def read_at(flat, sizes, strides, offset, dtype):
    """The view ``(sizes, strides)`` of dtype ``dtype`` at a traced storage ``offset``: a dynamic slice of
    the elements it spans, read as a view at offset 0. torch keeps a view inside its storage, so the
    slice never clamps."""
    window = lax.dynamic_slice(reinterpret(flat, dtype), (offset,), (extent(sizes, strides),))
    return read(window, sizes, strides, 0)


def write_at(flat, value, sizes, strides, offset):
    """``flat`` with the view ``(sizes, strides)`` at a traced ``offset`` replaced by ``value`` (same dtype)."""
    window = lax.dynamic_slice(flat, (offset,), (extent(sizes, strides),))
    window = write(window, value, sizes, strides, 0)
    return lax.dynamic_update_slice(flat, window, (offset,))


def write_as(flat, value, sizes, strides, offset):
    """``flat`` with the view ``(sizes, strides, offset)`` of ``value``'s dtype replaced by ``value``."""
    if np.dtype(value.dtype) == np.dtype(flat.dtype):
        return write(flat, value, sizes, strides, offset)
    written = write(reinterpret(flat, value.dtype), value, sizes, strides, offset)
    return _restore(written, flat.dtype, flat.shape[0])
