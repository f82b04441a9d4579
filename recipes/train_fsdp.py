"""Train a Llama-style decoder with FSDP2 (and optionally HSDP / tensor or pipeline parallelism) on TPU chips.

    torchrun --nproc-per-node 4 recipes/train_fsdp.py                       # FSDP over 4 emulated chips
    torchrun --nproc-per-node 4 recipes/train_fsdp.py --mesh 1,2,2          # FSDP x TP
    torchrun --nproc-per-node 4 recipes/train_fsdp.py --pp 2 --schedule 1f1b  # 2 pipeline stages x FSDP 2
    torchrun --nproc-per-node 4 recipes/train_fsdp.py --checkpoint-dir /tmp/ckpt --resume
    python recipes/train_fsdp.py --device tpu --eager-mode fused             # the "tpu" device, one process
    python recipes/train_fsdp.py --device tpu --variable-length --kernels jax
    python recipes/train_fsdp.py --help                                      # every option, documented

``--device auto`` (the default) computes on the "tpu" device on real TPU chips and with torch's CPU
kernels where CPU processes emulate them; ``--device tpu`` on several ranks needs a process group
that takes device tensors (the recipe checks at start-up and says so).

``--pp N`` splits the decoder into pipeline stages (``torch.distributed.pipelining``) over a 2-D mesh
(pp, dp_shard): each stage is FSDP2-sharded over the dp_shard ranks that hold it, activations and
their gradients go point to point between stages (on "tpu" tensors with ``--device tpu``, without a
host copy). ``--schedule`` picks GPipe, 1F1B or interleaved 1F1B (two stages per rank). The step is
the same as without pipelining (same data, loss, clipping and learning-rate schedule), so the losses
equal a one-process run's. ``--checkpoint-dir``/``--resume`` save and restore each rank's stages and
their optimizer state (one ``torch.distributed.checkpoint`` save, stages named by their index).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tpudist.training import Checkpointer, StepMetrics, TrainConfig
from tpudist.training.checkpoint import COMPLETE_MARKER
from tpudist.training.config import option, parse_config
from tpudist.training.data import MarkovTask
from tpudist.training.metrics import MetricsLogger
from tpudist.training.model import Transformer
from tpudist.training.parallelize import apply_fsdp
from tpudist.training.trainer import Trainer, lr_at, resolve_device

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B"}


@dataclasses.dataclass(frozen=True)
class FsdpConfig(TrainConfig):
    """Train a Llama-style decoder on a synthetic Markov-chain language task."""

    pp: int = option(1, "pipeline-parallel degree (ranks along the pp mesh axis); world_size/pp ranks "
                        "shard each stage with FSDP2; 1: no pipelining")
    schedule: str = option("1f1b", "--pp: pipeline schedule (interleaved1f1b: 2 stages per rank, looped)",
                           tuple(SCHEDULES))
    microbatches: int = option(0, "--pp: microbatches per step (each dp rank's batch is split into them); "
                                  "0: 2 per rank along pp (2 x --pp)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pp < 1:
            raise ValueError(f"pp={self.pp} must be >= 1")
        if self.pp > 1 and (self.mesh or self.parallelism != "fsdp"):
            raise ValueError(f"pp={self.pp} combines with FSDP2 over the remaining ranks only; got "
                             f"mesh={self.mesh} parallelism={self.parallelism!r}: drop --mesh and --parallelism")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {sorted(SCHEDULES)}")


class Stage(nn.Module):
    """Consecutive blocks of a :class:`Transformer` (sharing its modules), with the embeddings on the
    first stage and the final norm and output projection on the last."""

    def __init__(self, model: Transformer, blocks: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in blocks)
        self.norm, self.output = (model.norm, model.output) if last else (None, None)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        cos, sin = self.rope_cos[:h.shape[1]], self.rope_sin[:h.shape[1]]
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h)).float() if self.output is not None else h


class StageCheckpointer(Checkpointer):
    """:class:`Checkpointer` with the optimizer state flattened per parameter name.

    Pipeline ranks hold different parameters; the nested form keeps the optimizer's param_groups as
    one list under one key, and torch.distributed.checkpoint writes one copy of each key (rank 0's):
    the other stages' ranks loaded groups naming rank 0's parameters (measured: AdamW then lost its
    betas). Flattened, every key names one parameter. (Checkpointer taking ``StateDictOptions``
    would make this class unnecessary.)"""

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int):
        path = self.step_dir(step)
        model_state, optim_state = get_state_dict(model, optimizer, options=self.OPTIONS)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        dist.barrier()
        if dist.get_rank() == 0:
            (path / COMPLETE_MARKER).write_text(f"{step}\n")
        dist.barrier()
        return path

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        path = self.step_dir(step)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"no complete checkpoint for step={step}: {path}/{COMPLETE_MARKER} is missing")
        model_state, optim_state = get_state_dict(model, optimizer, options=self.OPTIONS)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self.OPTIONS)


class PipelineTrainer:
    """:class:`tpudist.training.Trainer`'s step with the model split into pipeline stages over the mesh
    axis "pp" and each stage FSDP2-sharded over "dp_shard"."""

    def __init__(self, cfg: FsdpConfig):
        from torch.distributed import pipelining
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(cfg.backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size % cfg.pp:
            raise ValueError(f"pp={cfg.pp} must divide world_size={self.world_size}")
        self.device = resolve_device(cfg.device)
        if self.device.type == "tpu":
            torch.tpu.set_eager_mode(cfg.eager_mode)
        dp = self.world_size // cfg.pp
        per_rank = 2 if cfg.schedule == "interleaved1f1b" else 1
        num_stages = cfg.pp * per_rank
        if cfg.n_layers % num_stages:
            raise ValueError(f"n_layers={cfg.n_layers} must divide into pp*stages_per_rank={num_stages} stages "
                             f"(schedule={cfg.schedule!r} has {per_rank} per rank)")
        self.microbatches = cfg.microbatches or 2 * cfg.pp
        if cfg.global_batch % (dp * self.microbatches):
            raise ValueError(f"global_batch={cfg.global_batch} must divide into dp_shard={dp} x "
                             f"microbatches={self.microbatches}")
        self.mesh = init_device_mesh(self.device.type, (cfg.pp, dp), mesh_dim_names=("pp", "dp_shard"))
        self.pp_rank, self.dp_rank, self.dp_size = (self.mesh["pp"].get_local_rank(),
                                                    self.mesh["dp_shard"].get_local_rank(), dp)
        torch.manual_seed(cfg.seed)  # the whole model on every rank, as one process would initialise it
        model = Transformer(cfg.model_args())
        per_stage = cfg.n_layers // num_stages
        self.stage_ids = [self.pp_rank + cfg.pp * k for k in range(per_rank)]  # looped placement
        stages = []
        for i in self.stage_ids:
            module = Stage(model, range(i * per_stage, (i + 1) * per_stage), i == 0, i == num_stages - 1)
            apply_fsdp(module.to(self.device), self.mesh["dp_shard"])
            stages.append(pipelining.PipelineStage(module, i, num_stages, self.device,
                                                   group=self.mesh["pp"].get_group()))
        self.stages = stages
        self.first, self.last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        schedule_cls = getattr(pipelining, SCHEDULES[cfg.schedule])
        multi = issubclass(schedule_cls, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = schedule_cls(stages if multi else stages[0], n_microbatches=self.microbatches,
                                     loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        self.parameters = [p for stage in stages for p in stage.submod.parameters()]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=cfg.lr, weight_decay=cfg.weight_decay)
        # what a checkpoint holds on this rank: its stages, named by stage index (ranks save disjoint names,
        # which one torch.distributed.checkpoint save joins; FSDP2 shards them over dp_shard)
        self.stage_modules = nn.ModuleDict({str(i): stage.submod for i, stage in zip(self.stage_ids, stages)})
        self.checkpointer = StageCheckpointer(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        self.task = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=cfg.data_seed, branching=cfg.branching)
        self.log = MetricsLogger(enabled=self.rank == 0, path=cfg.metrics_path, log_every=cfg.log_every)
        self.log.print(f"fsdp+pp on backend={dist.get_backend()} world_size={self.world_size} "
                       f"mesh(pp,dp_shard)=({cfg.pp}, {dp}) schedule={cfg.schedule} stages={num_stages} "
                       f"microbatches={self.microbatches} device={self.device.type}")

    def clip_grad_norm_(self) -> float:
        """The global gradient norm (clipped to ``max_grad_norm``): every element of every gradient is
        held by exactly one rank (stages are disjoint, FSDP2 shards them), so the squares add up."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        local_sq = torch.zeros((), dtype=torch.float64)
        for grad in grads:
            local_sq += grad.to_local().double().pow(2).sum().cpu()
        dist.all_reduce(local_sq)
        total = float(local_sq.sqrt())
        if self.cfg.max_grad_norm > 0 and total > self.cfg.max_grad_norm:
            for grad in grads:
                grad.mul_(self.cfg.max_grad_norm / (total + 1e-6))
        return total

    def train_step(self, step: int) -> StepMetrics:
        cfg = self.cfg
        start = time.perf_counter()
        inputs, targets = self.task.batch(step, cfg.global_batch, self.dp_rank, self.dp_size)
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        args = (inputs.to(self.device),) if self.first else ()
        kwargs = {"target": targets.to(self.device), "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)  # gradients: the mean over microbatches, as one batch's
        grad_norm = self.clip_grad_norm_()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the last stage's ranks hold the loss: their mean over microbatches, averaged over dp_shard
        loss = torch.stack([v.detach().cpu() for v in kwargs["losses"]]).mean() if self.last else torch.zeros(())
        dist.all_reduce(loss)
        return StepMetrics(step=step, loss=float(loss) / self.dp_size, lr=lr, grad_norm=grad_norm,
                           step_time_s=time.perf_counter() - start, tokens=cfg.global_batch * cfg.seq_len)

    def train(self) -> list[StepMetrics]:
        """Runs (or resumes) to ``cfg.steps``, checkpointing as :class:`tpudist.training.Trainer` does."""
        cfg = self.cfg
        start_step = 0
        if cfg.resume:
            start_step = self.checkpointer.load_latest(self.stage_modules, self.optimizer)
            self.log.print(f"resumed from step {start_step}" if start_step else
                           f"no complete checkpoint in {cfg.checkpoint_dir}: starting at step 0")
        last_step = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
        history = []
        for step in range(start_step + 1, last_step + 1):
            history.append(self.train_step(step))
            self.log.log(history[-1])
            if self.checkpointer and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                self.log.print(f"checkpoint saved: {self.checkpointer.save(self.stage_modules, self.optimizer, step)}")
        return history

    def close(self) -> None:
        self.log.close()
        if self._owns_group:
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> list[StepMetrics]:
    cfg = parse_config(FsdpConfig, argv)
    trainer = PipelineTrainer(cfg) if cfg.pp > 1 else Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
