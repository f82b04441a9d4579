"""What TPUDIST_DEBUG=DETAIL costs per collective: all_reduce time with and without its store check.

    python benchmarks/debug_overhead.py                       # 2 ranks, 4 B and 1 MiB
    python benchmarks/debug_overhead.py --ranks 4 --rounds 20

The ranks start in DETAIL mode and switch its check off and on every round (``detail_checks``, on
every rank at the same point), so both modes run interleaved in the same processes and machine noise
hits both alike. "default" is the default mode: the in-program fingerprint check stays on in both.
Prints the median per-call time of each mode and their ratio (> 1: DETAIL slower). Measured, not
asserted.
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


def rank_main(sizes: list[int], rounds: int, iters: int) -> dict[int, tuple[float, float]]:
    """Runs on every rank: {bytes: (median seconds per call in default mode, in DETAIL)}."""
    from tpudist.process_group import debug

    if dist.group.WORLD.channel.detail is None:
        raise RuntimeError("start the ranks with TPUDIST_DEBUG=DETAIL")
    results = {}
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))  # in-place sums of ones would overflow to inf
        dist.all_reduce(t)  # compile
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * rounds):
            detail = i % 2 == 1
            with debug.detail_checks(detail):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(t)
                times[detail].append((time.perf_counter() - t0) / iters)
        results[nbytes] = (statistics.median(times[False]), statistics.median(times[True]))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 2**20], help="bytes per all_reduce")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per mode, interleaved")
    parser.add_argument("--iters", type=int, default=20, help="all_reduces per round")
    args = parser.parse_args(argv)

    import debug_overhead as this  # rank processes import functions by module name, not __main__

    from tpudist.testing import RankPool

    with RankPool(args.ranks, env={"TPUDIST_DEBUG": "DETAIL"}, timeout=3600) as pool:
        results = pool.run(this.rank_main, args.sizes, args.rounds, args.iters)
    print(f"\n{args.ranks} ranks, all_reduce, median of {args.rounds} rounds x {args.iters} calls per mode "
          "(times: rank 0)")
    print("| bytes | default us | DETAIL us | DETAIL/default | DETAIL - default us | max ratio over ranks |")
    print("|---|---|---|---|---|---|")
    for nbytes in args.sizes:
        base, detail = results[0][nbytes]
        worst = max(r[nbytes][1] / r[nbytes][0] for r in results)
        print(f"| {nbytes} | {base * 1e6:.0f} | {detail * 1e6:.0f} | {detail / base:.2f} | "
              f"{(detail - base) * 1e6:.0f} | {worst:.2f} |")


if __name__ == "__main__":
    main()
