"""Hugging Face accelerate (and so ``Trainer``) under ``torchrun`` with the model on the "tpu" device.

accelerate has a distributed type per accelerator it knows (``MULTI_GPU``, ``MULTI_XPU``, ...) and none
for a "tpu" PrivateUse1 device: a multi-process run on one quietly became one process per rank
(``DistributedType.NO``): no DDP, no sharded data, each rank training alone. Once accelerate's state
module is imported, its ``PartialState`` takes such a run as ``MULTI_CPU`` processes (DDP, data
sharding and barriers without device ids, which fit a Python backend) on a "tpu" process group, with
the device ``tpu:<current>``: what ``recipes/accelerate_ddp.py`` sets up by hand, for unmodified code.
``cpu=True`` (``use_cpu``), another backend asked for or made before, and every other accelerator
keep accelerate's own choice.

FSDP asked for on such a run (a ``FullyShardedDataParallelPlugin``, ``ACCELERATE_USE_FSDP=true``, or
``TrainingArguments(fsdp=..., fsdp_config=...)``) is FSDP: accelerate turns it on only for GPU-like types,
and a ``MULTI_CPU`` run silently trained with DDP (full replicas). ``AcceleratorState`` now sets
``DistributedType.FSDP`` and its plugin for it, as accelerate does on GPUs, so ``prepare`` takes
accelerate's FSDP2 path (``fully_shard`` on the "tpu" group). FSDP1 (``fsdp_version=1``, accelerate's
default) raises: its flat parameters resize their storage, which a tpu tensor cannot.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from tpudist._after_import import when_imported
from tpudist._backend_names import our_backend_name

_FLAG = "_tpudist_device"  # on accelerate's shared state: this run's ranks are "tpu" devices


def _on_tpu() -> bool:
    """torch's accelerator is the "tpu" device, and no process group of another backend exists (gloo
    made by an earlier ``cpu=True`` state in this process, say: DDP of tpu parameters cannot use it)."""
    import torch.distributed as dist

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "tpu":
        return False
    return not dist.is_initialized() or dist.get_backend() == our_backend_name()


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
        ours = backend in (None, our_backend_name())
        if distributed_type == no and launched and ours and not cpu and not sagemaker_dp and _on_tpu():
            setattr(self, _FLAG, True)
            return our_backend_name(), multi_cpu
        return chosen, distributed_type

    @functools.wraps(set_device)
    def _set_device(self):
        if self.device is None and getattr(self, _FLAG, False):
            self.device = torch.device("tpu", torch.tpu.current_device())
            return
        set_device(self)

    _prepare_backend.tpudist = True
    cls._prepare_backend, cls.set_device = _prepare_backend, _set_device  # noqa: SLF001
    _patch_fsdp(state_module)


def _patch_fsdp(state_module) -> None:
    """FSDP for a run of ``MULTI_CPU`` processes on the device, as ``AcceleratorState`` does for GPU-like
    types (accelerate 1.16 turns an FSDP plugin on only for those, and otherwise trains with DDP)."""
    cls = state_module.AcceleratorState
    init, distributed_type = cls.__init__, state_module.DistributedType
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)  # accelerate makes its state often: the cheap tests first
        if not (getattr(self, _FLAG, False) and self.distributed_type == distributed_type.MULTI_CPU):
            return
        plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
            return
        if plugin is not None and plugin.fsdp_version != 2:
            # FSDP1 frees and re-allocates its flat parameters with UntypedStorage.resize_, which a tpu
            # storage (a jax.Array) cannot do; FSDP2's equivalents are wrapped (tpudist.device._fsdp).
            raise NotImplementedError(
                f"FSDP on the tpu device needs fsdp_version=2 (torch's fully_shard); got fsdp_version="
                f"{plugin.fsdp_version}, whose flat parameters resize their storage, which tpu tensors cannot. "
                "Pass fsdp_version=2 to FullyShardedDataParallelPlugin, set FSDP_VERSION=2 with "
                'ACCELERATE_USE_FSDP=true, or pass fsdp_config={"version": 2} to TrainingArguments.')
        self.distributed_type = distributed_type.FSDP
        if plugin is not None and self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        state_module.PartialState._shared_state["distributed_type"] = self.distributed_type

    __init__.tpudist = True
    cls.__init__ = __init__


def register() -> None:
    """Patches accelerate's ``PartialState`` now if accelerate is imported, else when it is."""
    when_imported("accelerate.state", _patch)
