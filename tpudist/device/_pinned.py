"""Pinned host memory for the tpu device: ``Tensor.pin_memory()`` and ``is_pinned()`` on CPU tensors.

Once the tpu device is torch's accelerator, torch pins host memory through the PrivateUse1 hooks'
``getPinnedMemoryAllocator``, which only a C++ backend can provide: ``DataLoader(pin_memory=True)``
(Hugging Face's Trainer sets it by default) raised NotImplementedError in its pinning thread. Host
memory needs no page-locking here (a host-to-device copy is a JAX ``device_put`` from any host
buffer), so a pinned tensor is a copy in ordinary host memory that ``is_pinned()`` reports as pinned,
as long as its storage lives. What still needs the C++ allocator (``torch.empty(..., pin_memory=True)``,
DDP's ``find_unused_parameters``/``static_graph`` staging buffer) still raises torch's error.
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


def register() -> None:
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept for the process's lifetime
    _LIB.impl("_pin_memory", _pin_memory, "CPU")
    _LIB.impl("is_pinned", _is_pinned, "CPU")
