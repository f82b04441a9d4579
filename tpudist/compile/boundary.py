"""CPU torch tensors <-> JAX arrays at a compiled graph's edge, without copies where layout allows.

Inputs are handed to XLA as numpy views built from the tensor's raw pointer (``__array_interface__``)
and placed with ``batched_device_put`` (zero-copy on the CPU client when aligned). Never
``Tensor.numpy()``: it marks the storage non-resizable for good, which breaks FSDP2's
``resize_``-based parameter freeing inside compiled blocks (FACTS.md). A non-contiguous input is
made contiguous first; that temporary must outlive the program (XLA reads it asynchronously), so the
caller keeps what :func:`to_jax` returns in ``keep`` until the results are ready.
Results come back as tensors over XLA's buffers (through their address; no copy).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from tpudist._hostmem import NUMPY as _NUMPY
from tpudist._hostmem import Pointer as _Pointer
from tpudist._hostmem import numpy_view

# Zero-copy arrays by (address, shape, dtype, device): a jax.Array that aliases a tensor's memory
# stays valid for whatever tensor of that layout occupies the address later (it holds no data of its
# own), so parameters and reused activation buffers enter a program without a new device_put
# (17-45 us each, measured; a lookup is ~1 us). Only arrays XLA really aliased are kept.
_ALIASES: dict[tuple, Any] = {}
_ALIASES_MAX = 4096
# Program results by (address, device): a result tensor entering a later program (the activations
# a forward saves, going into the backward) enters as the very array XLA produced, without a new
# device_put (a result's address changes from step to step, so the alias cache rarely knows it).
# Weak: the tensor holds its array alive, and an entry goes with its array.
_RESULTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def to_jax(tensors: list[Any], avals: list[Any], sharding: Any, device: Any, keep: list[Any]) -> list[Any]:
    """Each tensor as a ``jax.Array`` on ``device`` (a single-device sharding); temporaries it needed
    go into ``keep``. The caller keeps ``tensors`` alive until the program has read them."""
    from jax._src.lib import xla_client

    out = []
    for t, aval in zip(tensors, avals):
        plain = t.is_contiguous() and not (t.is_conj() or t.is_neg()) and t.numel() > 0
        key = (t.data_ptr(), aval.shape, aval.dtype, device.id) if plain else None
        arr = None
        if plain:
            arr = _RESULTS.get((key[0], key[3]))
            if arr is None or arr.shape != aval.shape or arr.dtype != aval.dtype:
                arr = _ALIASES.get(key)
        if arr is None:
            view, owner = numpy_view(t.detach(), hold=False)
            keep.append(owner)
            arr = xla_client.batched_device_put(aval, sharding, [view], [device], True)
            if plain and arr.unsafe_buffer_pointer() == key[0]:
                if len(_ALIASES) >= _ALIASES_MAX:
                    _ALIASES.clear()
                _ALIASES[key] = arr
        out.append(arr)
    return out


class ResultLayout(NamedTuple):
    """What :func:`results` needs of one program result, worked out once per program."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    typestr: str  # numpy's name of the raw element type
    view_as: torch.dtype | None  # torch reads bfloat16 bits through int16/uint16
    empty: bool


def result_layout(val: torch.Tensor) -> ResultLayout:
    raw = _NUMPY[val.dtype][0]
    raw_torch = torch.from_numpy(np.empty(0, raw)).dtype
    return ResultLayout(tuple(val.shape), val.dtype, np.dtype(raw).str,
                        None if raw_torch == val.dtype else val.dtype, val.numel() == 0)


def results(arrays: list[Any], layouts: list[ResultLayout], device_id: int) -> list[torch.Tensor]:
    """:func:`to_torch` of a program's ready results, with each one's layout known in advance
    (~6 us a result instead of 15-25 us); each array is remembered for :func:`to_jax`."""
    out = []
    for array, layout in zip(arrays, layouts):
        try:
            address = None if layout.empty else array.unsafe_buffer_pointer()
        except (AttributeError, RuntimeError, ValueError):
            address = None
        if address is None:
            out.append(to_torch(array, layout.dtype))
            continue
        t = torch.from_numpy(np.asarray(_Pointer(address, layout.shape, layout.typestr, array)))
        out.append(t if layout.view_as is None else t.view(layout.view_as))
        _RESULTS[(address, device_id)] = array
    return out


def to_torch(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over a ready single-device ``jax.Array``'s buffer (no copy).

    The buffer's address becomes a numpy view that holds the array alive, then a tensor: ~4 us,
    where DLPack's hand-over took 20-270 us per result (measured, the first after a program the
    most). DLPack, then one copy, where the address is not available."""
    if array.size == 0:
        return torch.empty(tuple(array.shape), dtype=dtype)
    try:
        address = array.unsafe_buffer_pointer()
    except (AttributeError, RuntimeError, ValueError):
        address = None
    if address is not None:
        raw_dtype = _NUMPY[dtype][0]
        view = np.asarray(_Pointer(address, tuple(array.shape), np.dtype(raw_dtype).str, array))
        out = torch.from_numpy(view)
        return out if out.dtype == dtype else out.view(dtype)
    try:
        return torch.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError):
        # e.g. a dtype DLPack cannot name on this version: one copy through numpy
        host = np.asarray(array)
        raw_dtype = _NUMPY[dtype][0]
        return torch.from_numpy(host.view(raw_dtype).copy()).view(dtype)


def drop_leading(t: torch.Tensor, n: int = 1) -> torch.Tensor:
    """A ``(1, ..., 1, *shape)`` block (``n`` ones) as a tensor of ``shape`` of its own over the same
    memory (not a view: FSDP2 warns about blocks returning views, whose in-place use would skip its
    backward hook)."""
    out = torch.empty(0, dtype=t.dtype)
    with torch.no_grad():
        out.set_(t.untyped_storage(), t.storage_offset(), t.shape[n:], t.stride()[n:])
    return out
