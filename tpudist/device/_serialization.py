"""torch.save / torch.load / deepcopy / printing of tpu tensors: the data travels as a CPU tensor.

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


def register() -> None:
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal  # noqa: SLF001
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
