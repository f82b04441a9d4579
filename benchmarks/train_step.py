"""FSDP2 training-step time on the "tpu" backend vs torch's gloo, in the same ranks and the same run.

    torchrun --nproc-per-node 2 benchmarks/train_step.py              # defaults: the recipe's model
    torchrun --nproc-per-node 4 benchmarks/train_step.py --steps 30 --dim 128

Two identical models are sharded with ``fully_shard``: one over the default "tpu" world group, one
over a gloo group of the same ranks. Steps alternate between them (so machine noise hits both alike),
and rank 0 prints the median step times, their ratio, and how many XLA programs the "tpu" backend
built after its first step (a correct cache builds none: every later step reuses step 1's programs).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpudist.training import MarkovTask, ModelArgs, Transformer, option, parse_config
from tpudist.training.parallelize import apply_fsdp


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Time FSDP2 steps of a Llama-style decoder on "tpu" and on gloo."""

    steps: int = option(20, "timed steps per backend (after FUSE_AFTER + 1 untimed warm-up steps each: "
                            "recurring collectives reach their one-program form before the timing)")
    vocab_size: int = option(128, "vocabulary size")
    dim: int = option(64, "model width")
    n_layers: int = option(2, "transformer blocks")
    n_heads: int = option(4, "attention heads")
    n_kv_heads: int = option(2, "key/value heads")
    seq_len: int = option(32, "tokens per sequence")
    global_batch: int = option(16, "sequences per step over all ranks")
    json_out: str = option("", "also write the result as JSON to this file (rank 0)")


def build(cfg: BenchConfig, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
                                  n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, max_seq_len=cfg.seq_len))
    apply_fsdp(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, optimizer, inputs, targets) -> float:
    start = time.perf_counter()
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from tpudist.process_group.programs import FUSE_AFTER, cache_stats

    cfg = parse_config(BenchConfig, argv)
    dist.init_process_group("tpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {
        "tpu": build(cfg, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))),
        "gloo": build(cfg, DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu", mesh_dim_names=("dp_shard",))),
    }
    task = MarkovTask(cfg.vocab_size, cfg.seq_len)
    times: dict[str, list[float]] = {name: [] for name in runs}
    first_step_s = {name: step(*runs[name], *task.batch(0, cfg.global_batch, rank, world)) for name in runs}
    for _ in range(FUSE_AFTER):  # the steady state of a training loop: call FUSE_AFTER + 1 is fused
        for name in runs:
            step(*runs[name], *task.batch(0, cfg.global_batch, rank, world))
    programs_after_warm_up = cache_stats().misses
    for index in range(1, cfg.steps + 1):
        batch = task.batch(index, cfg.global_batch, rank, world)
        for name in (("tpu", "gloo") if index % 2 else ("gloo", "tpu")):
            times[name].append(step(*runs[name], *batch))
    programs_after_last_step = cache_stats().misses
    result = {
        "world_size": world, "steps": cfg.steps,
        "params": sum(p.numel() for p in runs["tpu"][0].parameters()),  # DTensor numel is global
        "first_step_ms": {n: round(1000 * t, 1) for n, t in first_step_s.items()},
        "median_step_ms": {n: round(1000 * statistics.median(t), 2) for n, t in times.items()},
        "p90_step_ms": {n: round(1000 * _p90(t), 2) for n, t in times.items()},
        "tpu_over_gloo": round(statistics.median(times["tpu"]) / statistics.median(times["gloo"]), 2),
        "tpu_over_gloo_p90": round(_p90(times["tpu"]) / _p90(times["gloo"]), 2),
        "programs_built_in_warm_up": programs_after_warm_up,
        "programs_built_while_timed": programs_after_last_step - programs_after_warm_up,
        "cache_hits": cache_stats().hits,
    }
    if rank == 0:
        print(f"FSDP2 step, {world} ranks: tpu {result['median_step_ms']['tpu']} ms, gloo "
              f"{result['median_step_ms']['gloo']} ms (median of {cfg.steps}); tpu/gloo = {result['tpu_over_gloo']}x "
              f"(p90: {result['tpu_over_gloo_p90']}x); "
              f"XLA programs built: {programs_after_warm_up} in the warm-up, "
              f"{result['programs_built_while_timed']} while timed", flush=True)
        print(json.dumps(result), flush=True)
        if cfg.json_out:
            with open(cfg.json_out, "w", encoding="utf-8") as f:
                json.dump(result, f)
    dist.destroy_process_group()
    return result


def _p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1] if len(samples) > 1 else samples[0]


if __name__ == "__main__":
    main(sys.argv[1:])
