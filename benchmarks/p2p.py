"""Point to point on "tpu" device tensors vs gloo on CPU tensors: latency and bandwidth. Measured, not asserted.

    python benchmarks/p2p.py [--rounds 3] [--max-mib 16] [--pipeline [--ranks 4]]

Two ranks play ping-pong: rank 0 sends a message, rank 1 receives it and sends it back. One way =
round trip / 2; bandwidth = message bytes / one way. Three transports in the same ranks, interleaved
round by round (the machine is shared, so its load moves): "tpu dev" (tpu device tensors over the
"tpu" group: a 2-device permute program, no host copy), "tpu cpu" (CPU tensors over the "tpu" group)
and "gloo" (CPU tensors over torch's gloo). Each figure is the median over rounds; the ratio is
tpu dev / gloo time (below 1: faster than gloo).

``--pipeline``: the step time of torch.distributed.pipelining schedules (GPipe, 1F1B) over a stack
of Linear+Tanh blocks, one stage per rank (``--ranks``, default 2), stage weights on the tpu device
(Strict and Fused) vs CPU tensors over gloo, interleaved round by round; the ratio is tpu / gloo.

Measured 2026-12-02 on the shared 2-core machine (load average 5-7 from other sessions: gloo's own
times moved 2-10x between runs), medians of 5 rounds, before -> after the one-program transfer
(p2p.py: pairing and the mismatch check through the store, no fingerprint exchange in XLA, inline
send/recv, blocking store waits): one-way "tpu dev" 4 B 4.6 -> 2.2 ms, 64 B 5.9 -> 1.2 ms, 1 KiB
5.4 -> 1.2 ms, 16 KiB 3.1 -> 1.3 ms (gloo 50-160 us: 8-40x, was 33-63x); 1-4 MiB within noise
(2.5-9x gloo). Pipeline step (2 ranks): GPipe 9.2x/8.0x -> 3.9x/4.3x gloo (Strict/Fused), 1F1B
5.5x/7.6x -> 4.7x/3.3x; 4 ranks: GPipe 7.2x/6.0x -> 4.7x/3.9x, 1F1B 8.8x/7.1x -> 5.2x/4.3x. What
remains per small transfer: two store round trips to pair (~0.1-0.3 ms each under load), the
XLA:CPU 2-device permute (~60 us when both sides arrive together) and ~0.2 ms of Python a side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = (4, 64, 1024, 16 * 1024, 256 * 1024, 2**20, 4 * 2**20, 16 * 2**20)  # bytes


def _reps(nbytes: int) -> int:
    return 20 if nbytes <= 64 * 1024 else 8 if nbytes <= 2**20 else 3


def _ping_pong(x: torch.Tensor, group, reps: int) -> float:
    """Seconds per one-way message, over ``reps`` round trips."""
    r = dist.get_rank()
    t0 = time.perf_counter()
    for _ in range(reps):
        if r == 0:
            dist.send(x, 1, group=group)
            dist.recv(x, 1, group=group)
        else:
            dist.recv(x, 0, group=group)
            dist.send(x, 0, group=group)
    if x.device.type == "tpu":
        x[:1].cpu()  # the last recv has landed (device programs run asynchronously)
    return (time.perf_counter() - t0) / (2 * reps)


def rank_main(rounds: int, max_bytes: int) -> dict:
    import tpudist.device  # noqa: F401

    gloo = dist.new_group(backend="gloo")
    transports = (("tpu dev", None, "tpu"), ("tpu cpu", None, "cpu"), ("gloo", gloo, "cpu"))
    sizes = [s for s in SIZES if s <= max_bytes]
    times: dict = {}
    for nbytes in sizes:
        tensors = {name: torch.ones(max(1, nbytes // 4)).to(device) for name, _, device in transports}
        for name, group, _ in transports:  # warm up: compiles the programs of this size
            _ping_pong(tensors[name], group, 1)
        for _ in range(rounds):
            for name, group, _ in transports:
                dist.barrier(group=gloo)
                times.setdefault((name, nbytes), []).append(_ping_pong(tensors[name], group, _reps(nbytes)))
    return {key: statistics.median(v) for key, v in times.items()}


def pipeline_main(rounds: int, width: int = 256, batch: int = 32, microbatches: int = 8,
                  steps: int = 3) -> dict:
    """Seconds per schedule step (median over rounds), per (schedule, transport)."""
    import contextlib

    import tpudist.device  # noqa: F401
    from torch.distributed import pipelining

    r, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    runs = {}
    for schedule in ("ScheduleGPipe", "Schedule1F1B"):
        for name, device, mode, group in (("tpu strict", "tpu", "strict", None), ("tpu fused", "tpu", "fused", None),
                                          ("gloo", "cpu", None, gloo)):
            torch.manual_seed(0)
            block = torch.nn.Sequential(*[torch.nn.Linear(width, width), torch.nn.Tanh()] * 2).to(device)
            stage = pipelining.PipelineStage(block, r, world, torch.device(device), group=group)
            sched = getattr(pipelining, schedule)(stage, n_microbatches=microbatches,
                                                  loss_fn=torch.nn.functional.mse_loss)
            x, y = torch.randn(batch, width).to(device), torch.randn(batch, width).to(device)
            runs[(schedule, name)] = (sched, x, y, mode)
    times: dict = {}

    def step(sched, x, y, mode):
        scope = torch.tpu.eager_mode(mode) if mode else contextlib.nullcontext()
        with scope:
            t0 = time.perf_counter()
            for _ in range(steps):
                sched.step(*((x,) if r == 0 else ()), **({"target": y} if r == world - 1 else {}))
            if x.device.type == "tpu":
                torch.tpu.synchronize()
            return (time.perf_counter() - t0) / steps

    for args in runs.values():  # warm up: compiles
        step(*args)
    for _ in range(rounds):
        for key, args in runs.items():
            dist.barrier(group=gloo)
            times.setdefault(key, []).append(step(*args))
    return {key: statistics.median(v) for key, v in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-mib", type=float, default=16)
    parser.add_argument("--pipeline", action="store_true", help="pipeline schedule step times instead")
    parser.add_argument("--ranks", type=int, default=2, help="--pipeline: ranks (one stage each)")
    args = parser.parse_args(argv)
    from tpudist.testing import RankPool

    import p2p as this  # rank processes import by module name

    if args.pipeline:
        with RankPool(args.ranks, backend="tpu", timeout=1800) as pool:
            res = pool.run(this.pipeline_main, args.rounds)[0]
        for schedule in ("ScheduleGPipe", "Schedule1F1B"):
            ref = res[(schedule, "gloo")]
            print(f"{schedule:>14}: gloo {ref * 1e3:.1f} ms/step; " + ", ".join(
                f"{name} {res[(schedule, name)] * 1e3:.1f} ms ({res[(schedule, name)] / ref:.2f}x)"
                for name in ("tpu strict", "tpu fused")))
        return

    with RankPool(2, backend="tpu", timeout=1800) as pool:
        res = pool.run(this.rank_main, args.rounds, int(args.max_mib * 2**20))[0]
    print(f"{'bytes':>9} | {'tpu dev us':>10} {'MB/s':>8} | {'tpu cpu us':>10} {'MB/s':>8} | "
          f"{'gloo us':>9} {'MB/s':>8} | dev/gloo cpu/gloo")
    for nbytes in sorted({n for _, n in res}):
        dev, cpu, ref = (res[(name, nbytes)] for name in ("tpu dev", "tpu cpu", "gloo"))
        print(f"{nbytes:>9} | {dev * 1e6:>10.0f} {nbytes / dev / 1e6:>8.1f} | {cpu * 1e6:>10.0f} "
              f"{nbytes / cpu / 1e6:>8.1f} | {ref * 1e6:>9.0f} {nbytes / ref / 1e6:>8.1f} | "
              f"{dev / ref:>8.2f} {cpu / ref:>8.2f}")


if __name__ == "__main__":
    main()
