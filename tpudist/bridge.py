"""torch <-> JAX, the one bridge every layer crosses: dtypes, the 64-bit rule, host memory both ways.

- **dtypes**: :func:`to_jax_dtype` / :func:`to_torch_dtype` for every dtype the lowering table handles;
  ``NUMPY`` gives the numpy dtype of a raw view and the one XLA sees (bfloat16 through ml_dtypes).
- **the 64-bit rule**: JAX truncates int64, float64, complex128 and uint64 to 32 bits unless x64 is on
  for the call (FACTS.md): :func:`needs_x64` says when, :func:`x64_scope` turns it on for a call only.
- **a CPU tensor as an array**: :func:`numpy_view`, a numpy view built from the tensor's address, never
  ``Tensor.numpy()``: that marks the storage non-resizable for good, which breaks FSDP2 (it frees
  unsharded parameters with ``untyped_storage().resize_(0)``, FACTS.md). XLA:CPU reads it in place.
- **an array as a CPU tensor**: :func:`torch_view`, a tensor over a CPU ``jax.Array``'s buffer (no
  copy), or a row-major host copy of an accelerator's; :func:`host_copy`, a tensor of its own.

The "tpu" device's storages (``jax.Array`` values of device tensors) are the device's:
``tpudist.device.interop`` offers them to the layers above.
"""

from __future__ import annotations

import contextlib
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

_X64_DTYPES = frozenset({torch.int64, torch.float64, torch.complex128, torch.uint64})
_NULL = contextlib.nullcontext()
# filled at the first lookup: JAX's dtypes (jnp.float32, ...) without importing JAX with this module
_TORCH_TO_JAX: dict = {}
_JAX_TO_TORCH: dict = {}


def _fill_dtype_tables() -> None:
    import jax.numpy as jnp

    _TORCH_TO_JAX.update({
        torch.bool: jnp.bool_, torch.uint8: jnp.uint8, torch.int8: jnp.int8, torch.int16: jnp.int16,
        torch.int32: jnp.int32, torch.int64: jnp.int64, torch.float16: jnp.float16,
        torch.bfloat16: jnp.bfloat16, torch.float32: jnp.float32, torch.float64: jnp.float64,
        torch.complex64: jnp.complex64, torch.complex128: jnp.complex128})
    _JAX_TO_TORCH.update({np.dtype(v): k for k, v in _TORCH_TO_JAX.items()})


def to_jax_dtype(dtype: torch.dtype):
    """The JAX dtype of a torch dtype; TypeError naming the dtype where JAX has none."""
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        if not _TORCH_TO_JAX:
            _fill_dtype_tables()
            return to_jax_dtype(dtype)
        raise TypeError(f"dtype={dtype} has no JAX equivalent; supported: "
                        f"{', '.join(str(d) for d in _TORCH_TO_JAX)}") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype."""
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        if not _JAX_TO_TORCH:
            _fill_dtype_tables()
            return to_torch_dtype(dtype)
        raise TypeError(f"JAX dtype={dtype} has no torch equivalent") from None


def needs_x64(dtypes) -> bool:
    """Whether any of ``dtypes`` (torch dtypes) is one JAX truncates to 32 bits without x64."""
    return any(d in _X64_DTYPES for d in dtypes)


def x64_scope(on: bool):
    """``jax.enable_x64(True)`` when ``on``; the user's JAX config is left alone otherwise."""
    if not on:
        return _NULL
    import jax

    return jax.enable_x64(True)


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
    """A row-major CPU tensor of its own holding ``array``'s values (a ``jax.Array``): on a TPU
    ``np.asarray`` is already a fresh copy, but keeps the dim order of the layout XLA picked for it
    (a (3, 5, 8) float32 result as major_to_minor (1, 0, 2) on a v5e), and DLPack refuses it; a CPU
    array's view is read-only. bfloat16 through its bits."""
    host = np.asarray(array)
    if not host.flags.writeable or not host.flags.c_contiguous:
        host = np.array(host, order="C")
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


def torch_view(array) -> torch.Tensor:
    """A row-major torch tensor of a single-device JAX array: a view of a CPU array's buffer (no copy),
    a host copy of an accelerator's (DLPack cannot hand it over: JAX exports CPU and GPU arrays only).

    ``np.asarray`` of a CPU ``jax.Array`` is a view (~1-2 us; ~15 us per output less than
    ``torch.from_dlpack``, benchmarks/kernel_overhead.py). It is read-only for numpy, and torch warns
    once per process about wrapping one; that one warning is consumed here, silently (writing into
    the result is as safe as into a DLPack view: no one else holds the buffer)."""
    if not _warning_consumed:
        _consume_readonly_warning()
    view = np.asarray(array)
    if not view.flags.c_contiguous:  # an accelerator's copy in the layout XLA picked (host_copy)
        view = np.ascontiguousarray(view)
    if view.dtype == ml_dtypes.bfloat16:  # numpy's is ml_dtypes', torch reads its bits through int16
        return torch.from_numpy(view.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(view)


_warning_consumed = False


def _consume_readonly_warning() -> None:
    global _warning_consumed
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        readonly = np.zeros(1)
        readonly.flags.writeable = False
        torch.from_numpy(readonly)  # torch warns once per process: here, not in the user's output
    _warning_consumed = True
