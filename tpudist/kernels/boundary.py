"""torch <-> JAX at a kernel call: CPU tensors in without a copy, JAX results out as torch views.

Measured on this machine (FACTS.md, benchmarks/kernel_overhead.py): handing a jitted function the
numpy view of a CPU tensor (from its address, ~1-2 us) costs ~10 us over passing it ``jax.Array``s,
against 36-71 us for ``jax.dlpack.from_dlpack`` and 120-160 us for ``jax.device_put``; XLA:CPU reads
the host buffer in place. Results come back as torch views of the JAX buffers through numpy
(``np.asarray`` of a CPU ``jax.Array`` is a view): ~15 us per output less than ``torch.from_dlpack``
(61 -> 46 us per 8x64 call, min of 40 interleaved rounds); an accelerator's results come as host copies,
row-major whatever layout XLA gave them on the chip. The view is read-only for numpy, and
torch warns once per process about wrapping one; that one warning is consumed here, silently
(writing into the result is as safe as into a DLPack view: no one else holds the buffer).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tpudist._hostmem import numpy_view
from tpudist.kernels.tpu_blocks import pallas_interpret_unless_tpu  # noqa: F401  (kernels' interpret switch)

_X64_DTYPES = frozenset({torch.int64, torch.float64, torch.complex128, torch.uint64})
_NULL = contextlib.nullcontext()


def host_view(t: torch.Tensor | None):
    """A numpy view of a CPU tensor (made contiguous first; bfloat16 through ml_dtypes), built from
    its address: never ``Tensor.numpy()``, which would leave the storage non-resizable for good
    (FSDP2 frees parameters with ``resize_``). The view holds the tensor alive."""
    if t is None:
        return None
    return numpy_view(t)[0]


def to_torch(array) -> torch.Tensor:
    """A row-major torch tensor of a single-device JAX array, the strides the ops' fake kernels state:
    a view of a CPU array's buffer (no copy), a host copy of an accelerator's (which DLPack cannot hand
    over: JAX exports CPU and GPU arrays only)."""
    if _numpy_out is None:
        _consume_readonly_warning()
    kind = _numpy_out[array.dtype]  # every dtype of tpudist.ops.to_torch_dtype, which a kernel's results have
    view = np.asarray(array)
    if not view.flags.c_contiguous:
        # np.asarray keeps the dim order of the array's layout, which XLA:TPU picks per program: on a
        # v5e, a (3, 5, 8) float32 result as major_to_minor (1, 0, 2), strides (8, 24, 1) (2026-12-06)
        view = np.ascontiguousarray(view)
    if kind is not True:  # bfloat16: numpy's is ml_dtypes', torch reads its bits through int16
        return torch.from_numpy(view.view(np.int16)).view(kind)
    return torch.from_numpy(view)


_numpy_out: dict | None = None


def _consume_readonly_warning() -> None:
    global _numpy_out
    import warnings

    import ml_dtypes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        readonly = np.zeros(1)
        readonly.flags.writeable = False
        torch.from_numpy(readonly)  # torch warns once per process: here, not in the user's output
    table = {np.dtype(d): True for d in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16,
                                         np.float32, np.float64, np.complex64, np.complex128)}
    table[np.dtype(ml_dtypes.bfloat16)] = torch.bfloat16
    _numpy_out = table


def needs_x64(dtypes) -> bool:
    """JAX truncates 64-bit types unless x64 is on for the call (FACTS.md)."""
    return any(d in _X64_DTYPES for d in dtypes)


def x64_scope(on: bool):
    """``jax.enable_x64(True)`` when ``on``; the user's JAX config is left alone otherwise."""
    if not on:
        return _NULL
    import jax

    return jax.enable_x64(True)


def numpy_dtype_of(dtype: torch.dtype):
    """The JAX dtype of a torch dtype (``to_jax_dtype``), as a numpy dtype."""
    from tpudist.ops import to_jax_dtype

    return np.dtype(to_jax_dtype(dtype))


__all__ = ["host_view", "needs_x64", "numpy_dtype_of", "pallas_interpret_unless_tpu", "to_torch", "x64_scope"]
