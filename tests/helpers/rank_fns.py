"""Rank-side functions of the backend tests (module level, so rank processes can import them)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


_pair_groups: list = []


def mismatched(kind: str):
    r = dist.get_rank()
    fill = {}
    if not _pair_groups:
        _pair_groups.extend(dist.new_group([0, 1]) for _ in range(2))
    try:
        if kind == "shape":
            dist.all_reduce(torch.ones(3 + r))
        elif kind == "dtype":
            dist.all_reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32))
        elif kind == "reduce_op":
            dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
        elif kind == "op":
            t = torch.ones(4)
            dist.all_reduce(t) if r == 0 else dist.broadcast(t, 0)
        elif kind == "swapped_groups":
            a, b = _pair_groups if r == 0 else reversed(_pair_groups)
            fill = {"a": _pair_groups[0].group_name, "b": _pair_groups[1].group_name}
            dist.all_reduce(torch.ones(2), group=a)
            dist.all_reduce(torch.ones(2), group=b)
        elif kind == "reduce_root":
            dist.reduce(torch.ones(4), dst=r)
        elif kind == "gather_root":
            dist.gather(torch.ones(2), None, dst=1 - r)  # each rank believes the other one is dst
        elif kind == "all_to_all_splits":
            out = torch.zeros(3)
            dist.all_to_all_single(out, torch.ones(3), [1, 2], [2, 1] if r == 0 else [1, 2])
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = f"{type(e).__name__}: {e}"
    t = torch.ones(2)  # the group must still work afterwards
    dist.all_reduce(t)
    for group in _pair_groups:  # and so must the groups that were crossed
        dist.all_reduce(t, group=group)
    return outcome, [x / 4 for x in t.tolist()], fill


def bad_input(kind: str):
    try:
        if kind == "meta_device":
            dist.all_reduce(torch.ones(2, device="meta"))
        elif kind == "avg_int":
            dist.all_reduce(torch.ones(2, dtype=torch.int32), dist.ReduceOp.AVG)
        elif kind == "band_float":
            dist.all_reduce(torch.ones(2), dist.ReduceOp.BAND)
        elif kind == "gather_list_dtype":
            # straight to the backend: torch's own wrapper checks dtypes before it gets there
            dist.group.WORLD.allgather([[torch.zeros(2), torch.zeros(2, dtype=torch.int64)]],
                                       [torch.ones(2)])
        elif kind == "gather_list_len":
            dist.all_gather([torch.zeros(2)], torch.ones(2))
        elif kind == "reduce_scatter_size":
            dist.reduce_scatter_single(torch.zeros(3), torch.ones(4))
        elif kind == "broadcast_src":
            dist.broadcast(torch.ones(2), src=0, group=dist.group.WORLD, group_src=7)
        elif kind == "all_gather_coalesced_layout":  # one list per input instead of one per rank
            dist.all_gather_coalesced([[torch.zeros(2), torch.zeros(2)]], [torch.ones(2)])
        elif kind == "sparse_max":
            dist.all_reduce(torch.eye(2).to_sparse(), dist.ReduceOp.MAX)
        elif kind == "a2a_split_sum":
            dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [1, 1], [3, 3])
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def reinit_twice(rendezvous_dir: str):
    """destroy_process_group() then a fresh init_process_group("tpu") in the same process.

    Each world meets in its own FileStore: re-using one TCP port races with the old TCPStore
    server, which torch keeps until after the backend has shut down (a torch matter, not ours).
    """
    sums = []
    for world in range(2):
        dist.init_process_group("tpu", init_method=f"file://{rendezvous_dir}/world{world}",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=60))
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        sums.append(t.item())
        dist.destroy_process_group()
    return sums


def async_and_cache():
    from tpudist.process_group import cache_stats

    t = torch.arange(1000, dtype=torch.float32)
    dist.all_reduce(t)  # compile
    before = cache_stats().misses
    works = [dist.all_reduce(torch.full((1000,), float(i)), async_op=True) for i in range(4)]
    mid = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    results = [w.result()[0][0].item() for w in works]
    fut = dist.all_reduce(torch.ones(17), async_op=True).get_future()
    fut_value = fut.wait()[0].tolist()[:3]
    return {"new_programs": cache_stats().misses - before, "results": results, "fut": fut_value,
            "completed": [w.is_completed() for w in works], "queued_before_wait": mid}


def rank_topology():
    from tpudist.process_group import topology

    return str(topology()), topology().coords(dist.get_rank())


def monitored(skip_rank: int):
    from tpudist import monitored_barrier

    if dist.get_rank() == skip_rank:
        time.sleep(3)
        return "skipped"
    t0 = time.monotonic()
    try:
        monitored_barrier(dist.group.WORLD, timedelta(seconds=1), wait_all_ranks=True)
        return "passed"
    except RuntimeError as e:
        return f"{e} after {time.monotonic() - t0:.1f}s"


def wide_values():
    """64-bit values JAX would truncate without x64 (FACTS.md: 2**40 came back as 1)."""
    r = dist.get_rank()
    out = {}
    t = torch.tensor([2**40 + r, -(2**62)], dtype=torch.int64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    out["int64_max"] = t.tolist()
    t = torch.tensor([1.0 + 2.0**-40 * (r + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    out["float64_sum"] = t.item()
    t = torch.tensor([complex(1e-300, 2.0**-40)], dtype=torch.complex128)
    dist.broadcast(t, 0)
    out["complex128_bcast"] = t.item()
    return out


def unverified_collectives():
    """With the check off, matching collectives still work and no fingerprint collective runs."""
    from tpudist.process_group import programs

    with programs.verify_collectives(False):
        t = torch.full((5,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        lst = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(lst, torch.full((2,), float(dist.get_rank())))
    return t.tolist(), [x.tolist() for x in lst]


def one_rank_absent(absent: int, nap_s: float):
    """Rank ``absent`` sleeps instead of joining an all_reduce; the others must time out."""
    if dist.get_rank() == absent:
        time.sleep(nap_s)
        return "absent"
    return _timed_all_reduce()


def init_world(timeout_s: float):
    dist.init_process_group("tpu", timeout=timedelta(seconds=timeout_s))


def one_rank_killed(victim: int):
    """Rank ``victim`` is SIGKILLed mid-job; the survivors' next collective must raise."""
    import signal

    dist.all_reduce(torch.ones(2))  # everyone is connected
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # let the victim die first
    return _timed_all_reduce()


def _timed_all_reduce() -> str:
    """An all_reduce that is expected to fail: how it failed, and after how long."""
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
        return "completed?!"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__} after {time.monotonic() - t0:.0f}s: {e}"


def split_groups() -> dict:
    """tpudist.split_group on the world, on a subgroup and on a gloo group, checked against gloo
    groups of the same ranks; then a split after ranks made different groups (torch's hashed
    names for local groups diverge there); bad splits give their errors."""
    from tpudist import split_group

    rank = dist.get_rank()
    refs = {r: dist.new_group(list(r), backend="gloo") for r in ((0, 1), (2, 3), (1, 3), (2,))}
    gloo_world = dist.new_group(backend="gloo")
    out: dict = {}

    def check(group, ranks):
        mine = next((r for r in ranks if rank in r), None)
        if mine is None:
            return repr(group)
        t, ref = torch.arange(5.0) * (rank + 1), torch.arange(5.0) * (rank + 1)
        dist.all_reduce(t, group=group)
        dist.all_reduce(ref, group=refs[tuple(mine)])
        return (dist.get_backend(group), dist.get_process_group_ranks(group), torch.equal(t, ref),
                t.tolist())

    out["halves"] = check(split_group(split_ranks=[[0, 1], [2, 3]]), [(0, 1), (2, 3)])
    sub = dist.new_group([1, 2, 3])  # collective over the world: every rank creates it
    if rank in (1, 2, 3):
        out["inner"] = check(split_group(sub, [[0, 2], [1]]), [(1, 3), (2,)])
    out["gloo"] = check(split_group(gloo_world, [[0, 1], [2, 3]]), [(0, 1), (2, 3)])
    # Ranks 1 and 3 now hold one group more than rank 0 and 2: the same split again still agrees.
    out["again"] = check(split_group(split_ranks=[[0, 1], [2, 3]]), [(0, 1), (2, 3)])
    out["none"] = split_group(split_ranks=[[0, 1]]) is None  # ranks 2 and 3 are in no split
    errors = []
    for bad in ([], [[0, 1], [1, 2]], [[0, 4]], [[0, 0]], [[]]):
        try:
            split_group(split_ranks=bad)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out
