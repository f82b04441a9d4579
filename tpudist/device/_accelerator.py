"""``torch.accelerator``'s memory API and ``synchronize`` for the tpu device.

Once tpu is torch's accelerator, device-generic code calls ``torch.accelerator.empty_cache()``,
``memory_allocated()``, ``synchronize()``...: accelerate does for every backend it does not know by
name (``Trainer.train()`` calls ``empty_cache`` through ``accelerator.free_memory()``). Those go to a
C++ ``DeviceAllocator`` a Python backend cannot register and fail with an internal assert ("Allocator
for tpu is not a DeviceAllocator"). Here they call the ``torch.tpu`` functions of the same name.
``get_device_capability`` and ``Graph`` are left to torch (they raise its own error).
"""

from __future__ import annotations

import collections
import functools

import torch
import torch.accelerator
import torch.accelerator.memory

from tpudist.device import _module


def empty_host_cache() -> None:
    """Nothing to release: pinned host tensors are ordinary host memory, freed with their storage."""


def _reset_accumulated_memory_stats(device=None) -> None:
    """Nothing to reset: ``memory_stats()`` keeps no accumulated (historical) counters, only current and peak."""


def _memory_stats(device=None) -> collections.OrderedDict:
    return collections.OrderedDict(sorted(_module.memory_stats(device).items()))


def _on_tpu(fn):
    """``fn(device)`` behind torch.accelerator's signature: a device index, "tpu:0", a torch.device."""

    @functools.wraps(fn)
    def routed(device_index=None, /):
        _module._get_device_index(device_index, optional=True)  # noqa: SLF001 - tpu:0 or a clear error
        return fn(device_index)

    return routed


def _routes() -> dict:
    routes = {name: _on_tpu(getattr(_module, name)) for name in (
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
        "reset_peak_memory_stats", "synchronize")}
    return {**routes, "get_memory_info": _on_tpu(_module.mem_get_info), "memory_stats": _on_tpu(_memory_stats),
            "reset_accumulated_memory_stats": _on_tpu(_reset_accumulated_memory_stats),
            "empty_cache": _module.empty_cache, "empty_host_cache": empty_host_cache}


def register() -> None:
    for name, fn in _routes().items():
        for module in (torch.accelerator, torch.accelerator.memory):
            if hasattr(module, name):
                setattr(module, name, fn)
