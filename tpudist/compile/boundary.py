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

from typing import Any

import ml_dtypes
import numpy as np
import torch

# torch dtype -> (numpy dtype of the raw view, numpy dtype XLA sees)
_NUMPY = {
    torch.bool: (np.bool_, np.bool_), torch.uint8: (np.uint8, np.uint8), torch.int8: (np.int8, np.int8),
    torch.int16: (np.int16, np.int16), torch.int32: (np.int32, np.int32), torch.int64: (np.int64, np.int64),
    torch.float16: (np.float16, np.float16), torch.bfloat16: (np.uint16, ml_dtypes.bfloat16),
    torch.float32: (np.float32, np.float32), torch.float64: (np.float64, np.float64),
    torch.complex64: (np.complex64, np.complex64), torch.complex128: (np.complex128, np.complex128),
}


class _Pointer:
    """An object numpy turns into a view of ``nbytes`` at ``address`` (no copy, no storage flag);
    ``owner`` (the memory's owner, if any) lives as long as the view."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str, owner: Any = None):
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": typestr,
                                    "version": 3}
        self.owner = owner


def numpy_view(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """A numpy view of ``t``'s data and the tensor it points into (``t``, or a contiguous copy).

    Keep the second value alive while anything reads the view.
    """
    if t.device.type != "cpu":
        raise TypeError(f"tensor on device={t.device} cannot enter a CPU program; the compile backend "
                        "takes CPU tensors here ('tpu' device tensors go through device_io)")
    try:
        raw_dtype, xla_dtype = _NUMPY[t.dtype]
    except KeyError:
        raise TypeError(f"dtype={t.dtype} has no XLA equivalent; supported: "
                        f"{', '.join(map(str, _NUMPY))}") from None
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return np.empty(tuple(t.shape), xla_dtype), t
    arr = np.asarray(_Pointer(t.data_ptr(), tuple(t.shape), np.dtype(raw_dtype).str))
    return (arr if raw_dtype is xla_dtype else arr.view(xla_dtype)), t


# Zero-copy arrays by (address, shape, dtype, device): a jax.Array that aliases a tensor's memory
# stays valid for whatever tensor of that layout occupies the address later (it holds no data of its
# own), so parameters and reused activation buffers enter a program without a new device_put
# (17-45 us each, measured; a lookup is ~1 us). Only arrays XLA really aliased are kept.
_ALIASES: dict[tuple, Any] = {}
_ALIASES_MAX = 4096


def to_jax(tensors: list[Any], avals: list[Any], sharding: Any, device: Any, keep: list[Any]) -> list[Any]:
    """Each tensor as a ``jax.Array`` on ``device`` (a single-device sharding); temporaries it needed
    go into ``keep``. The caller keeps ``tensors`` alive until the program has read them."""
    from jax._src.lib import xla_client

    out = []
    for t, aval in zip(tensors, avals):
        plain = t.is_contiguous() and not (t.is_conj() or t.is_neg()) and t.numel() > 0
        key = (t.data_ptr(), aval.shape, aval.dtype, device.id) if plain else None
        arr = _ALIASES.get(key) if plain else None
        if arr is None:
            view, owner = numpy_view(t.detach())
            keep.append(owner)
            arr = xla_client.batched_device_put(aval, sharding, [view], [device], True)
            if plain and arr.unsafe_buffer_pointer() == key[0]:
                if len(_ALIASES) >= _ALIASES_MAX:
                    _ALIASES.clear()
                _ALIASES[key] = arr
        out.append(arr)
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
