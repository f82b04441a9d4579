"""Numpy views of CPU tensor memory without ``Tensor.numpy()``.

``Tensor.numpy()`` marks the tensor's storage non-resizable for good, which breaks FSDP2: it frees
unsharded parameters with ``untyped_storage().resize_(0)`` (FACTS.md). A view built from the raw
address (``__array_interface__``) leaves the storage alone. Shared by the compile backend's
boundary and by ``tpudist.kernels``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

# torch dtype -> (numpy dtype of the raw view, numpy dtype XLA sees)
NUMPY = {
    torch.bool: (np.bool_, np.bool_), torch.uint8: (np.uint8, np.uint8), torch.int8: (np.int8, np.int8),
    torch.int16: (np.int16, np.int16), torch.int32: (np.int32, np.int32), torch.int64: (np.int64, np.int64),
    torch.float16: (np.float16, np.float16), torch.bfloat16: (np.uint16, ml_dtypes.bfloat16),
    torch.float32: (np.float32, np.float32), torch.float64: (np.float64, np.float64),
    torch.complex64: (np.complex64, np.complex64), torch.complex128: (np.complex128, np.complex128),
}


class Pointer:
    """An object numpy turns into a view of the memory at ``address`` (no copy, no storage flag);
    ``owner`` (the memory's owner, if any) lives as long as the view."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str, owner: Any = None):
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": typestr,
                                    "version": 3}
        self.owner = owner


def numpy_view(t: torch.Tensor, hold: bool = True) -> tuple[np.ndarray, torch.Tensor]:
    """A numpy view of CPU tensor ``t``'s data and the tensor it points into (``t``, or a contiguous
    copy); bfloat16 comes as ml_dtypes' bfloat16. With ``hold`` the view keeps that tensor alive;
    without, the caller must (the compile boundary caches arrays over such views by address, and a
    cached array must not keep a step's tensors alive)."""
    if t.device.type != "cpu":
        raise TypeError(f"tensor on device={t.device} has no host memory to view; move it with .cpu() "
                        "('tpu' device tensors enter XLA as their own arrays)")
    try:
        raw_dtype, xla_dtype = NUMPY[t.dtype]
    except KeyError:
        raise TypeError(f"dtype={t.dtype} has no XLA equivalent; supported: "
                        f"{', '.join(map(str, NUMPY))}") from None
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return np.empty(tuple(t.shape), xla_dtype), t
    arr = np.asarray(Pointer(t.data_ptr(), tuple(t.shape), np.dtype(raw_dtype).str, t if hold else None))
    return (arr if raw_dtype is xla_dtype else arr.view(xla_dtype)), t


def host_copy(array) -> torch.Tensor:
    """A row-major CPU tensor holding a copy of ``array``'s values (a ``jax.Array``; on a TPU
    ``np.asarray`` alone keeps the dim order of the layout XLA picked for it, and DLPack refuses it);
    bfloat16 through its bits."""
    host = np.array(array, order="C")
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)
