"""torch <-> JAX at a kernel call: CPU tensors in without a copy, JAX results out as torch views.

Measured on this machine (FACTS.md, benchmarks/kernel_overhead.py): handing a jitted function the
numpy view of a CPU tensor (``Tensor.numpy()``, ~1 us) costs ~10 us over passing it ``jax.Array``s,
against 36-71 us for ``jax.dlpack.from_dlpack`` and 120-160 us for ``jax.device_put``; XLA:CPU reads
the host buffer in place. Results come back through DLPack (``torch.from_dlpack``, a few us, a view
of the JAX buffer).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

_X64_DTYPES = frozenset({torch.int64, torch.float64, torch.complex128, torch.uint64})
_NULL = contextlib.nullcontext()


def host_view(t: torch.Tensor | None):
    """A numpy view of a CPU tensor (made contiguous first); bfloat16 through ml_dtypes."""
    if t is None:
        return None
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.numpy()


def to_torch(array) -> torch.Tensor:
    """A torch view of a single-device JAX array (DLPack, no copy)."""
    return torch.from_dlpack(array)


def needs_x64(dtypes) -> bool:
    """JAX truncates 64-bit types unless x64 is on for the call (FACTS.md)."""
    return any(d in _X64_DTYPES for d in dtypes)


def x64_scope(on: bool):
    """``jax.enable_x64(True)`` when ``on``; the user's JAX config is left alone otherwise."""
    if not on:
        return _NULL
    import jax

    return jax.enable_x64(True)


@contextlib.contextmanager
def pallas_interpret_unless_tpu():
    """Inside: ``pallas_call`` traces in interpret mode unless JAX runs on TPU (compiled there).

    Uses JAX's own switch (the config ``pl.pallas_call`` reads at trace time; jax 0.10). Set only
    while a kernel traces, so the user's setting outside kernels is untouched.
    """
    import jax
    from jax._src import config

    if jax.default_backend() == "tpu":
        yield
        return
    switch = config.pallas_tpu_interpret_mode_context_manager
    previous = switch.swap_local(switch.value or True)
    try:
        yield
    finally:
        switch.set_local(previous)


def numpy_dtype_of(dtype: torch.dtype):
    """The JAX dtype of a torch dtype (``to_jax_dtype``), as a numpy dtype."""
    from tpudist.ops import to_jax_dtype

    return np.dtype(to_jax_dtype(dtype))


__all__ = ["host_view", "needs_x64", "numpy_dtype_of", "pallas_interpret_unless_tpu", "to_torch", "x64_scope"]
