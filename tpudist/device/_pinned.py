"""Pinned host memory for the tpu device: ``Tensor.pin_memory()`` and ``is_pinned()`` on CPU tensors.

Once the tpu device is torch's accelerator, torch pins host memory through the PrivateUse1 hooks'
``getPinnedMemoryAllocator``. tpudist's C++ hooks (``_hooks.py``, ``csrc/hooks.cpp``) provide one, and
torch's own kernels then pin and answer ``is_pinned()``; only ``_pin_memory`` keeps a Python kernel there,
to refuse a device other than tpu with a clear error (torch's kernel asks that device's hooks: for
"cuda" on a CPU build, an error about the missing CUDA library).

Without the C++ hooks (no compiler, ``TPUDIST_CPP_HOOKS=0``) the Python hooks have no allocator, and
``DataLoader(pin_memory=True)`` (Hugging Face's Trainer sets it by default) raised NotImplementedError in
its pinning thread. Host memory needs no page-locking here (a host-to-device copy is a JAX
``device_put`` from any host buffer), so there a pinned tensor is a copy in ordinary host memory that
``is_pinned()`` reports as pinned, as long as its storage lives. What needs the C++ allocator
(``torch.empty(..., pin_memory=True)``, DDP's ``find_unused_parameters``/``static_graph`` staging
buffer) then still raises torch's error.
"""

from __future__ import annotations

import weakref

import torch

_PINNED: dict[int, weakref.ref] = {}  # data pointer -> the pinned storage allocated there
_LIB = None


def _check_device(device) -> None:
    if device is not None and torch.device(device).type != "tpu":
        raise ValueError(f"pin_memory(device={device!r}): in a process using the tpu device, host memory is "
                         "pinned for 'tpu' only; call pin_memory() without a device")


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    _check_device(device)
    storage = self.untyped_storage()
    ref = _PINNED.get(storage.data_ptr())
    return ref is not None and ref() is storage


def _forget(ptr: int, ref: weakref.ref) -> None:
    if _PINNED.get(ptr) is ref:
        del _PINNED[ptr]


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    _check_device(device)
    out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype)  # torch keeps the strides too
    out.copy_(self)
    storage = out.untyped_storage()  # the same Python object while the storage lives (torch keeps it)
    ptr = storage.data_ptr()
    if ptr:  # an empty tensor has no memory to pin
        ref = _PINNED[ptr] = weakref.ref(storage)
        weakref.finalize(storage, _forget, ptr, ref)
    return out


def _pin_memory_with_allocator(self: torch.Tensor, device=None) -> torch.Tensor:
    _check_device(device)
    out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, pin_memory=True)  # the C++ allocator
    return out.copy_(self)


def register(cpp_allocator: bool) -> None:
    """Python kernels for pinning: with the C++ hooks' allocator (``cpp_allocator``) only the device check."""
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept for the process's lifetime
    if cpp_allocator:
        _LIB.impl("_pin_memory", _pin_memory_with_allocator, "CPU")
        return
    _LIB.impl("_pin_memory", _pin_memory, "CPU")
    _LIB.impl("is_pinned", _is_pinned, "CPU")
