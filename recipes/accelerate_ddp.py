"""A Hugging Face accelerate training script on the "tpu" process group, with DDP or FSDP2.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 recipes/accelerate_ddp.py                  # DDP, CPU tensors
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 recipes/accelerate_ddp.py --parallelism fsdp2
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 recipes/accelerate_ddp.py --device tpu     # model on the device
    python recipes/accelerate_ddp.py --help

The training loop is plain accelerate (``prepare``, ``backward``, ``clip_grad_norm_``, ``reduce``,
``get_state_dict``). What running it on "tpu" takes, all in ``make_accelerator`` (accelerate 1.16):

1. ``dist.init_process_group("tpu")`` before ``Accelerator()``. accelerate joins a process group that
   already exists; left to itself it would start gloo (and it refuses ``backend="tpu"`` in
   ``InitProcessGroupKwargs``: it only knows the CUDA-family backends, gloo and mpi).
2. ``Accelerator(cpu=True)``: accelerate has no distributed mode for a "tpu" device, so without it a
   multi-process run falls back to one process (``DistributedType.NO``). With it, ranks are
   ``MULTI_CPU`` processes on the existing "tpu" group (its repr still says "Backend: gloo": a name).
3. ``--device tpu``: ``ACCELERATE_TORCH_DEVICE=tpu`` (accelerate's own variable, read when its state is
   first made) so that ``prepare`` puts the model and batches on the "tpu" device instead of the CPU.
4. FSDP2: accelerate turns a ``FullyShardedDataParallelPlugin`` on only for GPU-like distributed types;
   on CPU processes it silently trains with DDP instead. The script sets the distributed type to FSDP
   (in both of accelerate's shared states, as accelerate does for GPUs) and hands the state the plugin;
   ``prepare`` then takes accelerate's own FSDP2 path (``fully_shard`` per block, then the root).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from tpudist.training.config import option, parse_config


@dataclasses.dataclass(frozen=True)
class AccelerateConfig:
    """Train a small residual MLP classifier with accelerate on the "tpu" process group."""

    parallelism: str = option("ddp", "accelerate's DDP, or FSDP2 through its FullyShardedDataParallelPlugin",
                              ("ddp", "fsdp2"))
    device: str = option("cpu", "where the model computes: cpu (torch's CPU kernels) or tpu (the tpudist device)",
                         ("cpu", "tpu"))
    backend: str = option("tpu", "c10d backend of the process group (gloo: the reference run)", ("tpu", "gloo"))
    steps: int = option(5, "optimizer steps")
    batch_size: int = option(4, "samples per rank and step")
    dim: int = option(32, "model width")
    n_blocks: int = option(2, "residual blocks (FSDP2 shards each one separately)")
    n_classes: int = option(8, "classes of the synthetic task")
    lr: float = option(1e-2, "AdamW learning rate")
    seed: int = option(0, "model and data seed")


@dataclasses.dataclass
class Result:
    """Per-step global mean loss and gradient norm (the same on every rank), the final weights, and
    what accelerate ran: its distributed type, the prepared model's class and its parameters' device."""

    losses: list[float]
    grad_norms: list[float]
    state_dict: dict[str, torch.Tensor]
    setup: tuple[str, str, str]


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, cfg: AccelerateConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg.dim) for _ in range(cfg.n_blocks))
        self.head = nn.Linear(cfg.dim, cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset(cfg: AccelerateConfig, world_size: int) -> torch.utils.data.TensorDataset:
    """Inputs whose class is a fixed linear function of them: enough samples for every step."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.steps * cfg.batch_size * world_size, cfg.dim, generator=g)
    labels = (x @ torch.randn(cfg.dim, cfg.n_classes, generator=g)).argmax(-1)
    return torch.utils.data.TensorDataset(x, labels)


def make_accelerator(cfg: AccelerateConfig):
    """An ``Accelerator`` on this job's process group ("tpu" unless ``cfg.backend`` says otherwise)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if cfg.device == "tpu":
        import tpudist.device  # noqa: F401  (installs the "tpu" device)

        os.environ["ACCELERATE_TORCH_DEVICE"] = "tpu"
    if not dist.is_initialized():
        dist.init_process_group(cfg.backend)
    elif dist.get_backend() != cfg.backend:
        raise ValueError(f"backend={cfg.backend!r} but the process group in place is {dist.get_backend()!r}; "
                         "pass --backend to match it")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
    ) if cfg.parallelism == "fsdp2" else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    if plugin is not None and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # what AcceleratorState does for a GPU-like type: FSDP in both of accelerate's shared states
        # (AcceleratorState() re-reads PartialState's, e.g. when prepare() meets a DataLoader)
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator


def main(argv: Sequence[str] | None = None) -> Result:
    cfg = parse_config(AccelerateConfig, argv)
    owns_group = not dist.is_initialized()  # called as a library inside a running job: leave its group alone
    accelerator = make_accelerator(cfg)
    accelerator.print(f"accelerate {accelerator.distributed_type.value} on backend={dist.get_backend()} "
                      f"world_size={accelerator.num_processes} device={accelerator.device}")
    torch.manual_seed(cfg.seed)
    model = Classifier(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loader = torch.utils.data.DataLoader(dataset(cfg, accelerator.num_processes), batch_size=cfg.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    setup = (accelerator.distributed_type.value, type(model).__name__, next(model.parameters()).device.type)

    losses, grad_norms = [], []
    for step, (x, labels) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), labels)
        accelerator.backward(loss)
        grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm=1e3)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        accelerator.print(f"step {step} loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f}")
    state_dict = {k: v.detach().cpu() for k, v in accelerator.get_state_dict(model).items()}
    if owns_group:
        accelerator.end_training()  # destroys the process group
    return Result(losses, grad_norms, state_dict, setup)


if __name__ == "__main__":
    main(sys.argv[1:])
