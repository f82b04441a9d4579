"""torch tensor <-> numpy/JAX blocks, without copies where the layout allows.

Numeric ops see the tensor in a dtype XLA reduces natively; data-moving ops see its raw bytes.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

# torch dtype -> numpy dtype XLA reduces (bool is reduced as uint8: SUM/MAX = or, MIN/PRODUCT = and).
_NUMERIC = {
    torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32,
    torch.float64: np.float64, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.uint8,
    torch.complex64: np.complex64, torch.complex128: np.complex128,
}
# Transport views for dtypes numpy cannot hold directly.
_VIEW_AS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}
FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
COMPLEX = frozenset({torch.complex64, torch.complex128})


def numeric_supported(dtype: torch.dtype) -> bool:
    return dtype in _NUMERIC


def transport_view(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a tensor of ``dtype`` is viewed as before ``.numpy()`` (None: itself)."""
    return _VIEW_AS.get(dtype)


def as_numeric(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t`` (contiguous first) in the dtype XLA computes with."""
    t = t.detach().contiguous()
    view_as = _VIEW_AS.get(t.dtype)
    arr = (t.view(view_as) if view_as is not None else t).numpy()
    return arr.view(_NUMERIC[t.dtype])


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``t`` as a flat numpy view: int32 words when they divide, else uint8."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(np.int32) if flat.size % 4 == 0 else flat  # numpy views ignore alignment


def byte_unit(nbytes: int) -> np.dtype:
    return np.dtype(np.int32) if nbytes % 4 == 0 else np.dtype(np.uint8)


def write_numeric(out: torch.Tensor, arr: np.ndarray) -> None:
    """Copies a result computed under :func:`as_numeric` rules into ``out`` (any strides)."""
    if out.dtype == torch.bool:
        arr = np.not_equal(arr, 0)
    _copy_into(out, arr.view(np.uint8) if out.dtype == torch.bool else arr)


def write_bytes(out: torch.Tensor, arr: np.ndarray) -> None:
    """Copies raw bytes (as produced by :func:`as_bytes`) into ``out`` (any strides)."""
    _copy_into(out, arr)


def _copy_into(out: torch.Tensor, arr: np.ndarray) -> None:
    """The one real copy of a collective: the result's bytes into the caller's tensor."""
    raw = arr.reshape(-1).view(np.uint8)
    if out.is_contiguous():
        view_as = _VIEW_AS.get(out.dtype)  # numpy ops are cheaper than torch's on this path
        dst = (out.detach().view(view_as) if view_as is not None else out.detach()).numpy()
        dst = dst.reshape(-1).view(np.uint8)
        if dst.ctypes.data != raw.ctypes.data or dst.nbytes != raw.nbytes:  # else: assembled in place
            np.copyto(dst, raw)
        return
    staged = torch.empty(out.shape, dtype=out.dtype)
    np.copyto(staged.reshape(-1).view(torch.uint8).numpy(), raw)
    with torch.no_grad():
        out.copy_(staged)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Sized:
    """Stands for an output a rank does not hold (gather on a non-root rank): only its size."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def nbytes_of(t: Any) -> int:
    return t.nbytes if isinstance(t, Sized) else nbytes(t)


def raw(t: torch.Tensor, unit: np.dtype) -> np.ndarray:
    return as_bytes(t).view(unit)


def write_raw(t: Any, raw: np.ndarray) -> None:
    if isinstance(t, torch.Tensor):
        write_bytes(t, raw)


def padded(arr: np.ndarray, width: int) -> np.ndarray:
    """``arr`` zero-padded to ``width`` rows: a numpy block, or a traced JAX array inside a device
    program (:mod:`~tpudist.process_group.device_arrays` runs the same lowerings)."""
    if arr.shape[0] == width:
        return arr
    if not isinstance(arr, np.ndarray):
        import jax.numpy as jnp

        return jnp.pad(arr, [(0, width - arr.shape[0])] + [(0, 0)] * (arr.ndim - 1))
    out = np.zeros(width, arr.dtype)
    out[:arr.shape[0]] = arr
    return out
