"""``torch.compile(model)`` (inductor, the default backend) on tpu tensors compiles with tpudist's backend.

torch 2.13's inductor has Pallas code generation for a device named "tpu", written for Google's
TorchTPU runtime: on tpudist's device the compiled module imported ``torch_tpu`` and failed
(``ModuleNotFoundError: No module named 'torch_tpu'``). A graph whose inputs are tpu tensors now goes
to ``backend="tpu"`` (the same XLA lowering), with a warning once per process; inductor's options
(``mode=``, ``options=``) do not apply to it. Graphs of CPU tensors still go to inductor.
"""

from __future__ import annotations

import warnings

import torch

_original_call = torch._TorchCompileInductorWrapper.__call__  # noqa: SLF001
# tpudist's own name for its backend: "tpu" is another package's where one registered it too (TorchTPU)
_BACKEND = "tpudist"
_warned = False


def _on_tpu(inputs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in inputs)


def _inductor_or_tpu(self, model_, inputs_, *, config_patches=None):
    if not _on_tpu(inputs_):
        return _original_call(self, model_, inputs_, config_patches=config_patches)
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("torch.compile's default backend (inductor) has no code generation for tpudist's 'tpu' "
                      "device: graphs of tpu tensors compile with backend='tpu' (tpudist's XLA backend); "
                      "pass backend='tpu' to say so and silence this warning", stacklevel=2)
    # through Dynamo's registry (the package's torch_dynamo_backends entry point), as backend="tpudist"
    # finds it: the compile backend is a layer above the device, which never imports it
    return torch._dynamo.lookup_backend(_BACKEND)(model_, inputs_)  # noqa: SLF001


def register() -> None:
    torch._TorchCompileInductorWrapper.__call__ = _inductor_or_tpu  # noqa: SLF001
