"""The training loop: build the parallel model from a :class:`TrainConfig`, then step, log, checkpoint."""

from __future__ import annotations

import math
import os
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpudist.training.advisor import advise, resolve_generation
from tpudist.training.checkpoint import Checkpointer
from tpudist.training.config import TrainConfig, load_buckets, parse_config
from tpudist.training.data import MarkovTask
from tpudist.training.metrics import MetricsLogger, StepMetrics
from tpudist.training.model import Transformer
from tpudist.training.parallelize import (ParallelDims, build_mesh, dp_coordinate, mesh_layout,
                                          parallelize)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warm-up, cosine decay to 10%."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clips the global 2-norm of the gradients to ``max_norm``; returns the norm before clipping.

    Works for any mix of plain-tensor and DTensor gradients (FSDP+TP puts block weights on the
    ``(dp_shard, tp)`` mesh and norms on ``dp_shard`` alone, which torch's ``clip_grad_norm_`` cannot
    stack) with one all-reduce in total: each rank adds the squares of its local shards, weighted by
    1 / (number of ranks holding the same elements). Every rank of the default group must hold the
    model (true for DDP, FSDP, HSDP and TP here); gradients must be Shard or Replicate, not Partial.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    world_size = dist.get_world_size()
    local_sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for grad in grads:
        if isinstance(grad, DTensor):
            assert not any(p.is_partial() for p in grad.placements), f"partial gradient {grad.placements}"
            copies = world_size // grad.device_mesh.size()
            for axis, placement in enumerate(grad.placements):
                copies *= grad.device_mesh.size(axis) if placement.is_replicate() else 1
            local = grad.to_local()
        else:
            copies, local = world_size, grad
        local_sq += local.double().pow(2).sum() / copies
    # The norm is needed on the host anyway (the clipping decision, the metrics): reduce it there, so
    # gradients on the "tpu" device need no device-tensor collective for it.
    local_sq = local_sq.to("cpu", copy=True)
    dist.all_reduce(local_sq)
    total = float(local_sq.sqrt())
    if max_norm > 0:
        # multiplied by 1.0 (exact) when under the bound, as torch's clip_grad_norm_ does: the same ops every
        # step, so a Fused step is one program whether or not this step clips
        coef = min(1.0, max_norm / (total + 1e-6))
        for grad in grads:
            grad.mul_(coef)
    return total


def resolve_device(name: str) -> torch.device:
    """``--device``: "auto" is "tpu" on real TPU chips, "cpu" where CPU processes emulate them.

    In emulation torch's CPU kernels are faster than XLA:CPU programs of one op each, and the
    compute runs on the same host cores either way; on a TPU VM only the "tpu" device uses the chip.
    """
    if name == "auto":
        from tpudist.process_group.runtime import platform

        name = "tpu" if platform() == "tpu" else "cpu"
    if name == "tpu":
        import tpudist.device  # noqa: F401  (the opt-in: installs the "tpu" device)
    return torch.device(name)


def _setup_tpu_device(cfg: TrainConfig, world_size: int) -> None:
    """Sets the eager mode; checks that the process group can run this config on device tensors.

    FSDP2 on one rank issues no collective (it copies shards to parameters), and the trainer's own
    reductions run on host copies; everything else (FSDP2 on several ranks, DDP, TP) hands device
    tensors to the process group. Whether it takes them is found out by trying, once.
    """
    if world_size > 1 and dist.get_backend() != "tpu":
        raise ValueError(f"device='tpu' with world_size={world_size} needs backend='tpu' (got "
                         f"backend={dist.get_backend()!r}): each rank's device is the chip the \"tpu\" process "
                         "group's runtime gives it. Pass --backend tpu, or --device cpu.")
    torch.tpu.set_eager_mode(cfg.eager_mode)
    probe = torch.ones(1, device="tpu")
    try:
        dist.all_reduce(probe)
        error = None if float(probe) == world_size else f"all_reduce of ones gave {float(probe)}"
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        error = f"{type(e).__name__}: {e}"
    if error is not None and (world_size > 1 or cfg.parallelism != "fsdp"):
        raise ValueError(
            f"device='tpu' with world_size={world_size} and parallelism={cfg.parallelism!r} needs a process "
            f"group that takes tpu tensors, and backend={dist.get_backend()!r} does not yet ({error}). "
            "Run one rank with --parallelism fsdp (torchrun --nproc-per-node 1, or plain python), or keep "
            "several ranks and pass --device cpu.")


class Trainer:
    """Owns the model, optimizer, data, checkpoints and metrics of one run.

    Example (under ``torchrun``):
        >>> Trainer(TrainConfig(steps=10)).train()   # doctest: +SKIP
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            if "WORLD_SIZE" in os.environ:  # torchrun (env:// rendezvous)
                dist.init_process_group(cfg.backend)
            else:  # a plain `python recipes/...`: a world of one process
                dist.init_process_group(cfg.backend, store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # after init_process_group: in a "tpu" world the device is the chip JAX's runtime gave this rank
        self.device = resolve_device(cfg.device)
        if self.device.type == "tpu":
            _setup_tpu_device(cfg, self.world_size)
        self.dims = ParallelDims.from_sizes(cfg.mesh, self.world_size)
        if cfg.global_batch % self.dims.dp:
            raise ValueError(f"global_batch={cfg.global_batch} must be divisible by the data-parallel degree "
                             f"dp_replicate*dp_shard={self.dims.dp}")
        self.model_args = cfg.model_args()
        self.log = MetricsLogger(enabled=self.rank == 0, path=cfg.metrics_path, log_every=cfg.log_every)
        self.mesh = build_mesh(self.dims, self.device.type)
        self.dp_rank, self.dp_size = dp_coordinate(self.mesh)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank before sharding
        model = Transformer(self.model_args).to(self.device)  # initialised on the host: the same on any device
        self.model = parallelize(model, self.mesh, parallelism=cfg.parallelism,
                                 param_dtype=_DTYPES[cfg.param_dtype],
                                 reshard_after_forward=cfg.reshard_after_forward,
                                 activation_checkpoint=cfg.activation_checkpoint,
                                 compile_backend=cfg.compile_backend if cfg.compile else "")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.task = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=cfg.data_seed, branching=cfg.branching)
        self.buckets = cfg.buckets() if cfg.variable_length else None
        self.checkpointer = Checkpointer(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        if self.device.type == "tpu":
            # Fused mode: the set-up's pending ops (FSDP2's copies into its parameters, the probe) run now
            # as a program of their own, so step 1's graph is the step alone: the program later steps run
            torch.tpu.synchronize()

    def _announce(self) -> None:
        generation = resolve_generation(self.cfg.tpu_generation)
        self.log.print(f"{self.cfg.parallelism} on backend={dist.get_backend()} world_size={self.world_size} "
                       f"mesh(dp_replicate,dp_shard,tp)={self.dims.sizes} params={self.model_args.num_params():,} "
                       f"loss floor={self.task.entropy_rate():.3f} device={self.device.type}"
                       + (f" eager_mode={torch.tpu.get_eager_mode()}" if self.device.type == "tpu" else ""))
        if self.buckets is not None:
            self.log.print(f"variable length: {max(1, self.cfg.seq_len // 8)}..{self.cfg.seq_len} tokens, "
                           f"padded to buckets {self.buckets.sizes}")
        names = self.mesh.mesh_dim_names
        layout = mesh_layout(tuple(self.mesh.mesh.shape), names, self.world_size)
        for line in layout.describe().splitlines():
            self.log.print(f"layout: {line}")
        for advice in advise(self.model_args, generation, tp=self.dims.tp):
            self.log.print(f"advisor[{generation}]: {advice}")

    def train_step(self, step: int) -> StepMetrics:
        """One optimizer step on the batch of ``step``; returns the metrics (loss averaged over ranks)."""
        cfg = self.cfg
        start = time.perf_counter()
        inputs, targets = self.task.batch(step, cfg.global_batch, self.dp_rank, self.dp_size)
        length, mask = cfg.seq_len, None
        if self.buckets is not None:
            # padded on the host, before the copy to the device: the device only sees bucket shapes
            length = self.task.length_of(step)
            batch = load_buckets().pad_batch(inputs[:, :length], targets[:, :length], self.buckets)
            inputs, targets = batch.tokens, batch.targets
            mask = None if self.model_args.causal else batch.key_padding_mask.to(self.device)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        logits = self.model(inputs) if mask is None else self.model(inputs, mask)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # ignore_index=-100: padding
        loss.backward()
        grad_norm = clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().to("cpu", copy=True)  # a sync point; the reduction runs on the host
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        return StepMetrics(step=step, loss=float(mean_loss), lr=lr, grad_norm=grad_norm,
                           step_time_s=time.perf_counter() - start, tokens=cfg.global_batch * length)

    def train(self) -> list[StepMetrics]:
        """Runs (or resumes) to ``cfg.steps``; returns this run's metrics, one per step taken."""
        cfg = self.cfg
        self._announce()
        start_step = 0
        if cfg.resume:
            start_step = self.checkpointer.load_latest(self.model, self.optimizer)
            self.log.print(f"resumed from step {start_step}" if start_step else
                           f"no complete checkpoint in {cfg.checkpoint_dir}: starting at step 0")
        history = []
        last_step = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
        for step in range(start_step + 1, last_step + 1):
            metrics = self.train_step(step)
            history.append(metrics)
            self.log.log(metrics)
            if self.checkpointer and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                path = self.checkpointer.save(self.model, self.optimizer, step)
                self.log.print(f"checkpoint saved: {path}")
        return history

    def close(self) -> None:
        self.log.close()
        if self._owns_group:
            dist.destroy_process_group()


def run(config_type: type[TrainConfig], argv: Sequence[str] | None = None) -> list[StepMetrics]:
    """What a recipe's ``main`` does: parse ``config_type`` from ``argv``, train, clean up."""
    trainer = Trainer(parse_config(config_type, argv))
    try:
        return trainer.train()
    finally:
        trainer.close()
