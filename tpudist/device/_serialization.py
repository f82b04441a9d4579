"""torch.save / torch.load / deepcopy / printing of tpu tensors: the data travels as a CPU tensor.

(deepcopy stays on the device: see ``__deepcopy__``.)

torch 2.13 pickles PrivateUse1 tensors through the CPU only when they have no storage; ours have one
(an empty storage holding the jax.Array), so ``_reduce_ex_internal`` is wrapped to take that path
for "tpu" tensors. Loading rebuilds them on "tpu" (``torch._utils._rebuild_device_tensor_from_cpu_tensor``,
allowed by ``weights_only``); ``map_location`` does not apply to them: move with ``.cpu()`` after load.
"""

from __future__ import annotations

import torch

_original = torch.Tensor._reduce_ex_internal  # noqa: SLF001


def _reduce_ex_internal(self, proto):
    if self.device.type != "tpu":
        return _original(self, proto)
    from tpudist.device import _core

    return (torch._utils._rebuild_device_tensor_from_cpu_tensor,  # noqa: SLF001
            (_core.to_cpu(self), self.dtype, str(self.device), self.requires_grad))


_original_deepcopy = torch.Tensor.__deepcopy__


def __deepcopy__(self, memo):
    """``copy.deepcopy`` of a plain tpu tensor, sharing storages as torch's storage path does.

    torch 2.13 deep-copies a plain tensor with a storage by cloning that storage, which allocates a
    PrivateUse1 storage through an allocator a Python backend does not have: the process segfaults
    (a module with BatchNorm buffers, say). Here each storage is copied once per deepcopy (its
    ``jax.Array`` is immutable, so the copy shares it) and every tensor over it becomes a view of the
    copy: tensors that shared a storage still do. Parameters and subclasses keep torch's paths.
    """
    if type(self) is not torch.Tensor or self.device.type != "tpu" or not self.is_leaf or id(self) in memo:
        return _original_deepcopy(self, memo)
    import copy

    from tpudist.device import _core

    buf = _core.buffer_of(self)
    base = memo.get(id(buf))
    if base is None:
        if isinstance(buf.value, _core.Lazy):
            _core.flush()
        base = memo[id(buf)] = _core.new_tensor((buf.numel,), buf.dtype, buf.value)
        memo.setdefault(id(memo), []).append(buf)  # keep buf alive while its id is a memo key
    if base.dtype != self.dtype:
        base = base.view(self.dtype)
    new = base.as_strided(tuple(self.shape), tuple(self.stride()), self.storage_offset()).detach()
    with torch.no_grad():
        new = new.conj_physical() if self.is_conj() else new
        new = new.neg() if self.is_neg() else new
    if self.requires_grad:
        new.requires_grad_()
    if self.grad is not None:
        new.grad = self.grad.__deepcopy__(memo)
    new.__dict__ = copy.deepcopy(self.__dict__, memo)
    memo[id(self)] = new
    return new


def register() -> None:
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal  # noqa: SLF001
    torch.Tensor.__deepcopy__ = __deepcopy__
    _patch_printing()


def _patch_printing() -> None:
    """Format tpu tensors from a host copy (torch would run its formatting ops on the device)."""
    import torch._tensor_str as tensor_str

    original = tensor_str._tensor_str  # noqa: SLF001

    def _tensor_str(self, indent):
        if self.device.type == "tpu":
            self = self.cpu()
        return original(self, indent)

    tensor_str._tensor_str = _tensor_str  # noqa: SLF001
