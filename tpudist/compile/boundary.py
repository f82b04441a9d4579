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
from typing import Any

import numpy as np
import torch

from tpudist.bridge import NUMPY as _NUMPY
from tpudist.bridge import Pointer as _Pointer
from tpudist.bridge import host_copy, numpy_view

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


# torch dtype -> (numpy's name of the raw element type, the dtype torch views the raw tensor as, or
# None where torch reads it as it is): bfloat16 comes through uint16.
_RAW = {dtype: (np.dtype(raw).str, None if torch.from_numpy(np.empty(0, raw)).dtype == dtype else dtype)
        for dtype, (raw, _) in _NUMPY.items()}


def _over_buffer(array: Any, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor | None, int | None]:
    """A tensor over a ready single-device CPU array's buffer and the buffer's address (no copy; the
    tensor holds the array alive), or (None, None) where the address is not available. Only for an
    array on the host: an accelerator's array has an address in the chip's memory."""
    try:
        address = array.unsafe_buffer_pointer()
    except (AttributeError, RuntimeError, ValueError):
        return None, None
    typestr, view_as = _RAW[dtype]
    t = torch.from_numpy(np.asarray(_Pointer(address, shape, typestr, array)))
    return (t if view_as is None else t.view(view_as)), address


def _on_host(array: Any) -> bool:
    """Whether ``array`` lives in host memory (JAX's CPU backend), not on an accelerator."""
    return all(d.platform == "cpu" for d in array.devices())


def results(arrays: list[Any], types: list[tuple[tuple[int, ...], torch.dtype]], device_id: int) -> list[torch.Tensor]:
    """:func:`to_torch` of a program's ready results, each one's (shape, dtype) known in advance
    (~6 us a result instead of 15-25 us: no reading them off the array); each array is remembered
    for :func:`to_jax`."""
    if arrays and not _on_host(arrays[0]):  # a CPU tensor's graph run on the chip: results come back
        return [to_torch(array, dtype) for array, (_, dtype) in zip(arrays, types)]
    out = []
    for array, (shape, dtype) in zip(arrays, types):
        t, address = (None, None) if 0 in shape else _over_buffer(array, shape, dtype)
        if t is None:
            out.append(to_torch(array, dtype))
            continue
        out.append(t)
        _RESULTS[(address, device_id)] = array
    return out


def to_torch(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over a ready single-device ``jax.Array``'s buffer (no copy), or, for an array on
    an accelerator (a CPU tensor's graph run on the TPU chip), a copy of it on the host.

    The buffer's address becomes a numpy view that holds the array alive, then a tensor: ~4 us,
    where DLPack's hand-over took 20-270 us per result (measured, the first after a program the
    most). DLPack, then one copy, where the address is not available."""
    shape = tuple(array.shape)
    if 0 in shape:
        return torch.empty(shape, dtype=dtype)
    if not _on_host(array):
        return _copied(array, dtype)
    t, _ = _over_buffer(array, shape, dtype)
    if t is not None:
        return t
    try:
        return torch.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError):
        # e.g. a dtype DLPack cannot name on this version
        return _copied(array, dtype)


def _copied(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """One row-major copy of ``array`` on the host, as ``dtype`` (the result type the graph states)."""
    t = host_copy(array)
    return t if t.dtype == dtype else t.view(dtype)


def drop_leading(t: torch.Tensor, n: int = 1) -> torch.Tensor:
    """A ``(1, ..., 1, *shape)`` block (``n`` ones) as a tensor of ``shape`` of its own over the same
    memory (:func:`over_memory_of`)."""
    return over_memory_of(t, t.shape[n:], t.stride()[n:])


def over_memory_of(t: torch.Tensor, shape, strides) -> torch.Tensor:
    """A tensor of ``shape`` and ``strides`` over ``t``'s memory from its offset, a tensor of its own, not
    a view: FSDP2 warns about blocks returning views, whose in-place use would skip its backward hook."""
    out = torch.empty(0, dtype=t.dtype)
    with torch.no_grad():
        out.set_(t.untyped_storage(), t.storage_offset(), tuple(shape), tuple(strides))
    return out
