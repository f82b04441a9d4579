"""FSDP2's storage resize/free for "tpu" tensors without tpudist's C++ hooks.

FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``) frees an unsharded
parameter's memory with ``free_storage`` (``untyped_storage().resize_(0)``) after forward/backward
and re-allocates it with ``alloc_storage`` (``resize_(numel * itemsize)``) before the all-gather
writes into it. ``UntypedStorage.resize_`` on PrivateUse1 goes to the hooks' ``resizePrivateUse1Bytes``:
tpudist's C++ hooks (``csrc/hooks.cpp``) implement it (``_storage.resize_storage``), and tpu storages
report their sizes, so FSDP2's own functions work. torch's Python hooks, which stand in where the C++
ones could not be built, cannot resize, and every storage then reports 0 bytes (FSDP's functions would
never free one): only then are those two module functions wrapped for tpu tensors: freeing drops the
storage's ``jax.Array`` (its memory returns to XLA), allocating leaves an unwritten storage (it reads as
zeros until FSDP's all-gather copies into it). Other devices go to FSDP's own functions. The wrap
happens when FSDP2's modules are imported (an import hook), so ``import tpudist.device`` does not pay
FSDP's import time.

Allocating can be a no-op because FSDP2 writes every element of a re-allocated storage before it
reads one: the all-gather's copy-out (``split_with_sizes_copy``) fills the parameters' all-gather
outputs, whose storages back the unsharded parameters. With the "tpu" process group those writes
are device programs too (``tpudist.process_group.device_arrays``), on any number of ranks
(``tests/device/test_device_dist.py``: 2 and 4 ranks, HSDP and FSDP+TP).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGETS = ("torch.distributed.fsdp._fully_shard._fsdp_param", "torch.distributed.fsdp._fully_shard._fsdp_param_group")


def alloc_storage_for(original):
    def alloc_storage(tensor):
        if tensor.device.type == "tpu":
            return None  # the storage is addressable already; an unwritten (freed) one reads as zeros
        return original(tensor)

    alloc_storage.__wrapped__ = original
    return alloc_storage


def free_storage_for(original):
    def free_storage(tensor):
        if tensor.device.type == "tpu":
            from tpudist.device import _core

            _core.buffer_of(tensor).value = None
            return None
        return original(tensor)

    free_storage.__wrapped__ = original
    return free_storage


def _patch(module) -> None:
    for name, wrap in (("alloc_storage", alloc_storage_for), ("free_storage", free_storage_for)):
        fn = getattr(module, name, None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            setattr(module, name, wrap(fn))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._busy = False

    def find_spec(self, name, path, target=None):
        if name not in _TARGETS or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def register() -> None:
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport())
