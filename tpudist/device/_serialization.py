"""torch.save / torch.load / deepcopy / printing of tpu tensors: the data travels as a CPU tensor.

(deepcopy stays on the device: see ``__deepcopy__``.)

torch 2.13 pickles PrivateUse1 tensors through the CPU only when they have no storage; ours have one
(an empty storage holding the jax.Array), so ``_reduce_ex_internal`` is wrapped to take that path
for "tpu" tensors. Loading rebuilds them on "tpu" (``torch._utils._rebuild_device_tensor_from_cpu_tensor``,
allowed by ``weights_only``); ``map_location`` does not apply to them: move with ``.cpu()`` after load.

``torch.load(f, map_location="tpu")`` (a string, ``torch.device`` or dict naming tpu) moves what was saved
elsewhere to the device. torch would restore each storage with ``UntypedStorage(size, device="tpu")``,
which needs a C++ allocator a Python backend does not have (the process segfaults); instead the storage
stays a CPU storage marked for "tpu", and each tensor rebuilt over it is moved, once per storage: tensors
that shared a storage (tied weights, views) still share one on the device.

Savers that find shared tensors by ``untyped_storage().data_ptr()`` (Hugging Face's ``save_pretrained``
and its tied-weight check, safetensors) saw 0 for every tpu storage (they hold no host memory) and took
all of a model's weights for one shared tensor. A tpu storage's ``data_ptr()`` is the address the C++
hooks give it (without them, the identity of its device buffer): equal for aliases, distinct otherwise,
an identity rather than an address to read.
"""

from __future__ import annotations

import torch

from tpudist.device._storage import _ATTR

_original = torch.Tensor._reduce_ex_internal  # noqa: SLF001


def _reduce_ex_internal(self, proto):
    if self.device.type != "tpu":
        return _original(self, proto)
    from tpudist.device import _core, _layouts

    # the strides of self.cpu(), what torch pickles for storage-less device tensors: a channels_last
    # tensor loads back channels_last
    return (torch._utils._rebuild_device_tensor_from_cpu_tensor,  # noqa: SLF001
            (_core.to_cpu(self, _layouts.copy_strides(self)), self.dtype, str(self.device), self.requires_grad))


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
        base = memo[id(buf)] = _core.new_tensor((buf.numel,), buf.dtype, _core.concrete(buf))
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


_MARK = "_tpudist_restore_on"   # attribute of a loaded CPU storage whose tensors go to the device


def _restore_on_tpu(storage, location: str):
    """``torch.load``'s deserializer for locations "tpu" / "tpu:N": mark the CPU storage (see the module doc)."""
    if not (location == "tpu" or location.startswith("tpu:")):
        return None
    from tpudist.device import _module

    index = _module._get_device_index(location, optional=True)  # noqa: SLF001
    setattr(storage, _MARK, {"device": torch.device("tpu", index), "moved": {}})
    return storage


_original_rebuild = torch._utils._rebuild_tensor  # noqa: SLF001


def _rebuild_tensor(storage, storage_offset, size, stride):
    untyped = storage._untyped_storage  # noqa: SLF001
    mark = getattr(untyped, _MARK, None)
    if mark is None:
        return _original_rebuild(storage, storage_offset, size, stride)
    dtype = storage.dtype
    flat = mark["moved"].get(dtype)
    if flat is None:
        numel = untyped.nbytes() // dtype.itemsize
        whole = torch.empty((0,), dtype=dtype).set_(untyped, 0, (numel,), (1,))
        flat = mark["moved"][dtype] = whole.to(mark["device"])
    return flat.as_strided(tuple(size), tuple(stride), storage_offset).detach()


_original_data_ptr = torch.UntypedStorage.data_ptr


def _storage_data_ptr(self) -> int:
    """The address the C++ hooks gave the storage (``tensor.data_ptr()`` is it plus the offset's bytes, as
    on CPU: safetensors' ``load_model`` and ``save_model`` compare the two), else its buffer's identity."""
    address = _original_data_ptr(self)
    if address:
        return address
    buf = getattr(self, _ATTR, None)
    return address if buf is None else id(buf)


def register() -> None:
    torch.UntypedStorage.data_ptr = _storage_data_ptr
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal  # noqa: SLF001
    torch.Tensor.__deepcopy__ = __deepcopy__
    torch.serialization.register_package(19, lambda storage: None, _restore_on_tpu)
    torch._utils._rebuild_tensor = _rebuild_tensor  # noqa: SLF001
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
