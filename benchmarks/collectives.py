"""Collective bandwidth and latency: "tpu" vs torch's gloo, interleaved in the same ranks.

    python benchmarks/collectives.py                  # 2 and 4 ranks, 4 B ... 64 MB
    python benchmarks/collectives.py --ranks 2 --max-bytes 1048576 --plot out.png

Each rank initialises the "tpu" world and a gloo group over the same ranks; every (op, size) is
timed on both, alternately, so machine noise hits both alike. Prints nccl-tests style algorithm
and bus bandwidth and the tpu/gloo time ratio (> 1: tpu slower), then where tpu's time goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# nccl-tests: bus bandwidth = algorithm bandwidth x this factor (n = ranks)
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0}


def _call(op: str, group, buf: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif op == "all_gather":
        dist.all_gather_single(out, buf, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(buf, out, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, buf, group=group)
    else:
        dist.broadcast(buf, dist.get_global_rank(group, 0), group=group)


def _time(op, group, buf, out, iters: int) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        _call(op, group, buf, out)
    return (time.perf_counter() - t0) / iters


def rank_main(sizes: list[int], ops: list[str], budget_s: float, verify: bool = True):
    """Runs on every rank: returns {(op, nbytes): (tpu seconds, gloo seconds)} (rank 0's view)."""
    from tpudist.process_group.programs import verify_collectives

    with verify_collectives(verify):
        return _rank_main(sizes, ops, budget_s)


def _rank_main(sizes: list[int], ops: list[str], budget_s: float):
    tpu = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    n = dist.get_world_size()
    results = {}
    for op in ops:
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            if op in ("all_to_all",):
                numel = max(n, numel - numel % n)
            buf = torch.ones(numel)
            out = torch.zeros(numel * n if op in ("all_gather", "reduce_scatter") else numel)
            _call(op, tpu, buf, out)  # compile
            _call(op, gloo, buf, out)
            probe = torch.tensor([_time(op, tpu, buf, out, 1) + _time(op, gloo, buf, out, 1)])
            dist.all_reduce(probe, dist.ReduceOp.MAX, group=gloo)  # every rank must loop alike
            iters = int(max(2, min(50, budget_s / max(probe.item(), 1e-6))))
            t_tpu = t_gloo = float("inf")
            for _ in range(3):  # interleaved rounds; keep each side's best
                t_tpu = min(t_tpu, _time(op, tpu, buf, out, iters))
                t_gloo = min(t_gloo, _time(op, gloo, buf, out, iters))
            results[(op, numel * 4)] = (t_tpu, t_gloo)
    return results


def breakdown(nbytes: int, iters: int = 20):
    """Where one all_reduce's time goes on "tpu": the XLA program(s) incl. host<->jax hand-over,
    the copy into the caller's tensor, and the rest (c10d dispatch, checks, Work)."""
    from tpudist.process_group import programs
    from tpudist.process_group import tensors as tz

    t = torch.ones(max(1, nbytes // 4))
    block = tz.as_numeric(t)
    key = programs.ProgramKey("all_reduce", tuple(block.shape), block.dtype.name,
                              tuple(range(dist.get_world_size())), programs.SUM)
    compiled = programs.program(key)
    fingerprint = compiled.call_fingerprint(0, 0)
    dist.all_reduce(t)
    parts = {"program": 0.0, "copy_back": 0.0, "end_to_end": 0.0}
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        res, _ = compiled.run(block, fingerprint)
        t1 = time.perf_counter()
        tz.write_numeric(t, res)
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        dist.all_reduce(t)
        t4 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t4 - t3)):
            parts[k] += v / iters
    parts["rest"] = parts["end_to_end"] - parts["program"] - parts["copy_back"]
    return parts


def exchange_costs(iters: int = 100):
    """The bare XLA programs a small collective could be: the envelope rows all_to_all tpudist uses,
    an all_gather of the 24-byte fingerprint alone, a 4-byte psum; and gloo's 4-byte all_reduce.
    Interleaved rounds, median per-call seconds (rank 0's view)."""
    import statistics

    import jax
    import numpy as np
    from jax._src import core
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpudist.process_group import envelope, programs, runtime

    n, axis = dist.get_world_size(), programs.AXIS
    mesh = programs.mesh_of(tuple(range(n)))
    sharding, device = NamedSharding(mesh, P(axis)), runtime.current().local_device

    def program(body, block):
        fn = jax.jit(jax.shard_map(lambda x: body(x[0])[None], mesh=mesh, in_specs=P(axis),
                                   out_specs=P(axis), check_vma=False))
        aval = core.ShapedArray((n, *block.shape), block.dtype)
        return lambda: np.asarray(fn(programs.xla_batched_put(aval, sharding, block, device))._arrays[0])

    gloo = dist.new_group(backend="gloo")
    t = torch.ones(1)
    calls = {
        "envelope all_to_all": program(lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True),
                                       np.zeros((n, envelope.WORDS), np.int32)),
        "fingerprint all_gather": program(lambda x: jax.lax.all_gather(x, axis),
                                          np.zeros(envelope.FP_WORDS, np.int32)),
        "4 B psum": program(lambda x: jax.lax.psum(x, axis), np.ones(1, np.float32)),
        "gloo 4 B all_reduce": lambda: dist.all_reduce(t, group=gloo),
    }
    times = {k: [] for k in calls}
    for f in calls.values():
        f()
    for _ in range(7):
        for k, f in calls.items():
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            times[k].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per timed round")
    parser.add_argument("--plot", default=None, help="write a PNG of the tpu/gloo time ratio")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the cross-rank fingerprint check (TPUDIST_VERIFY=0)")
    args = parser.parse_args(argv)
    sizes = [s for s in (4, 4096, 65536, 2**20, 16 * 2**20, 64 * 2**20) if s <= args.max_bytes]

    from tpudist.testing import RankPool

    import collectives as this  # rank processes import functions by module name, not __main__

    table = []
    for n in args.ranks:
        with RankPool(n, backend="tpu", timeout=3600) as pool:
            res = pool.run(this.rank_main, sizes, args.ops, args.budget, not args.no_verify)[0]
            parts = pool.run(this.breakdown, 4)[0], pool.run(this.breakdown, 2**20)[0]
            bare = pool.run(this.exchange_costs)[0]
        for (op, nbytes), (t_tpu, t_gloo) in res.items():
            algbw = nbytes / t_tpu / 1e9
            table.append((n, op, nbytes, t_tpu, t_gloo, algbw, algbw * _BUS_FACTOR[op](n),
                          nbytes / t_gloo / 1e9 * _BUS_FACTOR[op](n)))
        print(f"\n{n} ranks: where one all_reduce's time goes on tpu (microseconds)")
        for label, p in zip(("4 B", "1 MiB"), parts):
            print(f"  {label:>6}: " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in p.items()))
        print(f"{n} ranks: bare programs (median us): "
              + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in bare.items()))
    print("\n| ranks | op | bytes | tpu us | gloo us | tpu/gloo | tpu busbw GB/s | gloo busbw GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, op, nbytes, t_tpu, t_gloo, _, bus, gbus in table:
        print(f"| {n} | {op} | {nbytes} | {t_tpu * 1e6:.0f} | {t_gloo * 1e6:.0f} | "
              f"{t_tpu / t_gloo:.2f} | {bus:.3f} | {gbus:.3f} |")
    if args.plot:
        _plot(table, args.plot)


def _plot(table, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(n, op) for n, op, *_ in table})
    fig, axes = plt.subplots(1, len({n for n, _ in keys}), figsize=(12, 4), squeeze=False)
    for ax, n in zip(axes[0], sorted({n for n, _ in keys})):
        for _, op in [k for k in keys if k[0] == n]:
            rows = [r for r in table if r[0] == n and r[1] == op]
            ax.loglog([r[2] for r in rows], [r[3] / r[4] for r in rows], marker="o", label=op)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"{n} ranks: tpu time / gloo time", xlabel="bytes", ylabel="ratio")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
