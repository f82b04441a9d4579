"""Hugging Face accelerate (and so ``Trainer``) under ``torchrun`` with the model on the "tpu" device.

accelerate has a distributed type per accelerator it knows (``MULTI_GPU``, ``MULTI_XPU``, ...) and none
for a "tpu" PrivateUse1 device: a multi-process run on one quietly became one process per rank
(``DistributedType.NO``): no DDP, no sharded data, each rank training alone. Once accelerate's state
module is imported, its ``PartialState`` takes such a run as ``MULTI_CPU`` processes (DDP, data
sharding and barriers without device ids, which fit a Python backend) on a "tpu" process group, with
the device ``tpu:<current>``: what ``recipes/accelerate_ddp.py`` sets up by hand, for unmodified code.
``cpu=True`` (``use_cpu``), another backend asked for or made before, and every other accelerator
keep accelerate's own choice.
"""

from __future__ import annotations

import functools
import os

import torch

from tpudist._after_import import when_imported

_FLAG = "_tpudist_device"  # on accelerate's shared state: this run's ranks are "tpu" devices


def _backend_name() -> str:
    import torch.distributed as dist

    from tpudist.process_group._autoload import ALIAS_NAME, BACKEND_NAME

    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())  # noqa: SLF001 - torch keeps no public map
    return BACKEND_NAME if plugin is not None and getattr(plugin.creator_fn, "tpudist", False) else ALIAS_NAME


def _on_tpu() -> bool:
    """torch's accelerator is the "tpu" device, and no process group of another backend exists (gloo
    made by an earlier ``cpu=True`` state in this process, say: DDP of tpu parameters cannot use it)."""
    import torch.distributed as dist

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "tpu":
        return False
    return not dist.is_initialized() or dist.get_backend() == _backend_name()


def _patch(state_module) -> None:
    cls = state_module.PartialState
    if getattr(cls._prepare_backend, "tpudist", False):  # noqa: SLF001
        return
    multi_cpu, no = state_module.DistributedType.MULTI_CPU, state_module.DistributedType.NO
    prepare_backend, set_device = cls._prepare_backend, cls.set_device  # noqa: SLF001

    @functools.wraps(prepare_backend)
    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
        ours = backend in (None, _backend_name())
        if distributed_type == no and launched and ours and not cpu and not sagemaker_dp and _on_tpu():
            setattr(self, _FLAG, True)
            return _backend_name(), multi_cpu
        return chosen, distributed_type

    @functools.wraps(set_device)
    def _set_device(self):
        if self.device is None and getattr(self, _FLAG, False):
            self.device = torch.device("tpu", torch.tpu.current_device())
            return
        set_device(self)

    _prepare_backend.tpudist = True
    cls._prepare_backend, cls.set_device = _prepare_backend, _set_device  # noqa: SLF001


def register() -> None:
    """Patches accelerate's ``PartialState`` now if accelerate is imported, else when it is."""
    when_imported("accelerate.state", _patch)
