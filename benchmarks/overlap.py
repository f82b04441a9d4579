"""Does ``async_op=True`` overlap communication with computation? Measured, not asserted.

    python benchmarks/overlap.py [--ranks 2] [--mbytes 16]

Per rank: T_work (the host work), T_comm (an all_reduce), T_both (the all_reduce issued with
async_op=True, the host work, then wait). Overlap = (T_work + T_comm - T_both) / min(T_work,
T_comm): 0 = serial, 1 = the shorter one is fully hidden. Run for "tpu" and gloo in the same ranks,
for two kinds of host work: matmuls (CPU-bound: on 2 cores the collective's memcpy, reduction and
TCP need the same core) and a wait that needs no CPU (an input pipeline or I/O), which shows
whether the collective really progresses while the caller does something else.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _compute(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a @ a


def _wait(a: torch.Tensor, reps: int) -> None:
    time.sleep(reps * 0.5e-3)


def rank_main(mbytes: int, rounds: int = 5):
    gloo = dist.new_group(backend="gloo")
    a = torch.randn(256, 256)
    buf = torch.ones(mbytes * 2**20 // 4)
    results = {}
    for (name, group), (kind, work_fn) in [(g, w) for w in (("matmuls", _compute), ("wait", _wait))
                                           for g in (("tpu", dist.group.WORLD), ("gloo", gloo))]:
        dist.all_reduce(buf, group=group)  # warm up (and compile)
        best = {"compute": 1e9, "comm": 1e9, "both": 1e9}
        for _ in range(rounds):
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            work_fn(a, 20)
            t1 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            t2 = time.perf_counter()
            work = dist.all_reduce(buf, group=group, async_op=True)
            work_fn(a, 20)
            work.wait()
            t3 = time.perf_counter()
            for k, v in zip(best, (t1 - t0, t2 - t1, t3 - t2)):
                best[k] = min(best[k], v)
        hidden = best["compute"] + best["comm"] - best["both"]
        results[(kind, name)] = {**best, "overlap": hidden / min(best["compute"], best["comm"])}
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mbytes", type=int, default=16)
    args = parser.parse_args(argv)
    from tpudist.testing import RankPool

    import overlap as this  # rank processes import by module name

    with RankPool(args.ranks, backend="tpu", timeout=1200) as pool:
        res = pool.run(this.rank_main, args.mbytes)[0]
    for (kind, name), r in res.items():
        print(f"{kind:>7} {name:>4}: work {r['compute'] * 1e3:.1f} ms, all_reduce {r['comm'] * 1e3:.1f} ms, "
              f"async all_reduce + work {r['both'] * 1e3:.1f} ms -> overlap {r['overlap']:.2f}")


if __name__ == "__main__":
    main()
