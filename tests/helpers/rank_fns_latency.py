"""Rank functions of tests/process_group/test_collective_latency.py (importable by rank processes)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import collective_cases as cc
from tpudist.process_group import envelope
from tpudist.process_group.group import ProcessGroupTPU

_IDLE, _OTHER = os.SCHED_IDLE, os.SCHED_OTHER
LARGE = envelope.PAYLOAD_BYTES // 4 + 1  # float32 elements: one more than the envelope carries


def loop_policies():
    """The gloo loop thread's policy as the kernel reports it after a small all_reduce, one with a
    data program of at most IDLE_DATA_BYTES, and a larger one; and the threads of this process in
    SCHED_IDLE after a small one."""
    from tpudist.process_group.programs import IDLE_DATA_BYTES
    from tpudist.process_group.runtime import GLOO_LOOP

    tid = GLOO_LOOP.tid
    small, medium, large = torch.ones(1), torch.ones(LARGE), torch.ones(IDLE_DATA_BYTES // 4 + 1)
    dist.all_reduce(small)
    after_small = os.sched_getscheduler(tid) if tid is not None else None
    dist.all_reduce(medium)
    after_medium = os.sched_getscheduler(tid) if tid is not None else None
    dist.all_reduce(large)
    after_large = os.sched_getscheduler(tid) if tid is not None else None
    dist.all_reduce(torch.ones(1))
    again = os.sched_getscheduler(tid) if tid is not None else None
    idle_threads = _idle_threads()
    with GLOO_LOOP.forced(False):
        dist.all_reduce(torch.ones(1))
        forced = os.sched_getscheduler(tid) if tid is not None else None
    return {"tid": tid, "in_process": tid is not None and os.path.exists(f"/proc/self/task/{tid}"),
            "after_small": after_small, "after_medium": after_medium, "after_large": after_large,
            "again": again, "forced": forced,
            "results": [small.item(), medium[-1].item(), large[0].item(), large[-1].item()],
            "idle_threads": idle_threads}


def _idle_threads() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(name)) == _IDLE:
                out.append(int(name))
        except OSError:  # the thread ended
            pass
    return out


def mismatched_small(kind: str):
    """Ranks issue different collectives of which at least one travels in the envelope; returns
    (error type and text, all_reduce results afterwards)."""
    r = dist.get_rank()
    try:
        if kind == "small_vs_small":  # both in the envelope: all_reduce against all_gather
            if r == 0:
                dist.all_reduce(torch.ones(4))
            else:
                dist.all_gather_single(torch.zeros(8), torch.ones(4))
        elif kind == "small_vs_large":  # one in the envelope, one with a data program behind it
            dist.all_reduce(torch.ones(1 if r == 0 else LARGE))
        elif kind == "at_the_edge":  # exactly the payload against one element more
            dist.all_reduce(torch.ones(LARGE - 1 if r == 0 else LARGE))
        elif kind == "flat_vs_flat":  # both on the flat all_reduce path, different reduce ops
            dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
        elif kind == "flat_vs_general":  # bool takes the general path
            dist.all_reduce(torch.ones(4) if r == 0 else torch.ones(4, dtype=torch.bool))
        elif kind == "flat_broadcast_vs_flat_all_to_all":  # both flat, each with a data program
            if r == 0:
                dist.broadcast(torch.ones(LARGE * 2), 0)
            else:
                dist.all_to_all_single(torch.zeros(LARGE * 2), torch.ones(LARGE * 2))
        elif kind == "barrier_vs_small":
            dist.barrier() if r == 0 else dist.broadcast(torch.ones(2), 0)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = f"{type(e).__name__}: {e}"
    small, large = torch.ones(2), torch.ones(LARGE)
    dist.all_reduce(small)
    dist.all_reduce(large)
    return outcome, small.tolist(), [large[0].item(), large[-1].item()]


def _flat_outcome(counter: list[int], call, result: torch.Tensor):
    """Runs ``call`` (a collective, waited for if async): ``result`` as a list of floats, or the
    error's type and text; and how many calls the ``counter`` counted meanwhile."""
    before = counter[0]
    try:
        work = call()
        if work is not None:
            work.wait()
        return result.float().tolist(), counter[0] - before
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}", counter[0] - before


def flat_all_reduce_edges():
    """The flat path of small all_reduces (small.py) at its edges, each result beside what the
    general path or a plain fold gives, and whether the flat path ran."""
    flat_calls = cc._count_calls(ProcessGroupTPU, "_run_small")
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}

    def run(name, t, op=dist.ReduceOp.SUM, **kwargs):
        out[name] = _flat_outcome(flat_calls, lambda: dist.all_reduce(t, op, **kwargs), t)

    run("scalar", torch.tensor(float(r + 1)))
    run("empty", torch.ones(0))
    run("payload", torch.full((LARGE - 1,), float(r + 1)))  # exactly the payload: flat
    run("over", torch.full((LARGE,), float(r + 1)))  # one element more: a data program
    run("parameter", torch.nn.Parameter(torch.full((3,), float(r + 1))))
    run("grad_fn", torch.full((3,), float(r + 1), requires_grad=True) * 1)
    run("int_avg", torch.ones(2, dtype=torch.int32), dist.ReduceOp.AVG)  # refused: as general
    run("bool", torch.tensor([r == 0, False]))  # general: written back as bool
    run("premul", torch.ones(2), dist._make_nccl_premul_sum(3.0))
    run("async", torch.ones(2), async_op=True)
    # 16-bit floats sum in float32 on both paths: the same bits as the general path's.
    for dtype in (torch.bfloat16, torch.float16):
        vals = torch.tensor([1.0, 2.0**-9, 3.0 + r, -1.0], dtype=torch.float64) * (r + 1)
        flat_t = vals.to(dtype)
        general = vals.to(dtype).reshape(2, 2).t().contiguous().t()  # not contiguous: general
        run(f"{dtype}_flat", flat_t)
        run(f"{dtype}_general", general)
        out[f"{dtype}_same_bits"] = torch.equal(flat_t.view(torch.int16),
                                                general.reshape(-1).view(torch.int16))
    # A flat call behind a queued async one waits its turn (the general path queues it).
    # Rank 1 comes late, so rank 0's async call is surely still running when its next comes.
    big = torch.ones(LARGE)
    if r == 1:
        time.sleep(0.5)
    work = dist.all_reduce(big, async_op=True)
    run("behind_async", torch.full((2,), float(r + 1)))
    work.wait()
    out["big"] = [big[0].item(), big[-1].item()]
    # A renamed group's calls carry its new name (the fingerprints hold the group's code).
    sub = dist.new_group(list(range(n)))
    run("subgroup", torch.full((2,), float(r + 1)), group=sub)
    out["rank"] = r
    out["data"] = _flat_data_all_reduce_edges(r)
    return out


def _flat_data_all_reduce_edges(r: int) -> dict:
    """Synchronous all_reduces larger than the envelope: the flat path runs their data program
    (``_run_flat``) where the general path would, with the same results and errors."""
    flat_calls = cc._count_calls(ProcessGroupTPU, "_run_flat")
    out = {}

    def run(name, t, op=dist.ReduceOp.SUM, **kwargs):
        out[name] = _flat_outcome(flat_calls, lambda: dist.all_reduce(t, op, **kwargs), t)

    run("sum", torch.full((LARGE,), float(r + 1)))
    run("int max", torch.full((LARGE,), 5 - r, dtype=torch.int32), dist.ReduceOp.MAX)
    run("premul", torch.full((LARGE,), float(r + 1)), dist._make_nccl_premul_sum(3.0))
    run("bool", torch.full((LARGE,), r == 0))  # general: written back as bool
    run("async", torch.full((LARGE,), float(r + 1)), async_op=True)
    run("int avg", torch.ones(LARGE, dtype=torch.int32), dist.ReduceOp.AVG)
    numel = 2 * LARGE  # 2-byte elements: twice as many to leave the envelope
    vals = (torch.linspace(-3, 3, numel, dtype=torch.float64) * (r + 1) + 2.0**-9).to(torch.bfloat16)
    flat_t = vals.clone()
    general = torch.empty(numel * 2, dtype=torch.bfloat16)[::2].copy_(vals)  # strided: general path
    run("bf16 flat", flat_t)
    run("bf16 general", general)
    out["bf16 same bits"] = torch.equal(flat_t.view(torch.int16), general.contiguous().view(torch.int16))
    return out


def flat_gather_scatter_edges():
    """The flat paths of synchronous all_gather_into_tensor and reduce_scatter_tensor (FSDP2's
    collectives): each result, and how many calls took the flat path."""
    flat_calls = cc._count_calls(ProcessGroupTPU, "_run_flat")
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}

    def run(name, fn, result):
        out[name] = _flat_outcome(flat_calls, fn, result)

    for numel in (3, LARGE):  # in the envelope, and a data program
        inp, gathered = torch.full((numel,), float(r + 1)), torch.zeros(numel * n)
        run(f"ag {numel}", lambda: dist.all_gather_into_tensor(gathered, inp), gathered)
    # FSDP2's in-place form: the input is this rank's chunk of the output
    gathered = torch.zeros(3 * n, dtype=torch.bfloat16)
    gathered[3 * r:3 * r + 3] = r + 1
    run("ag in place bf16", lambda: dist.all_gather_into_tensor(gathered, gathered[3 * r:3 * r + 3]),
        gathered)
    inp, gathered = torch.full((3,), float(r + 1)), torch.zeros(3 * n)
    run("ag async", lambda: dist.all_gather_into_tensor(gathered, inp, async_op=True), gathered)
    strided = torch.zeros(6 * n)[::2]
    run("ag strided output", lambda: dist.all_gather_into_tensor(strided, inp), strided)
    for numel in (2, LARGE):
        inp, part = torch.arange(numel * n, dtype=torch.float32) + r, torch.zeros(numel)
        run(f"rs {numel}", lambda: dist.reduce_scatter_tensor(part, inp), part)
    inp, part = torch.arange(2 * n, dtype=torch.bfloat16) * (r + 1), torch.zeros(2, dtype=torch.bfloat16)
    run("rs max bf16", lambda: dist.reduce_scatter_tensor(part, inp, dist.ReduceOp.MAX), part)
    ints, ipart = torch.ones(2 * n, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    run("rs int avg", lambda: dist.reduce_scatter_tensor(ipart, ints, dist.ReduceOp.AVG), ipart)
    bools, bpart = torch.tensor([r == 0, False] * n), torch.zeros(2, dtype=torch.bool)
    run("rs bool", lambda: dist.reduce_scatter_tensor(bpart, bools), bpart)
    return out


def flat_broadcast_all_to_all_edges():
    """The flat paths of synchronous broadcast and even all_to_all_single: each result (or error),
    and how many calls took the flat path."""
    flat_calls = cc._count_calls(ProcessGroupTPU, "_run_flat")
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"rank": r}

    def run(name, fn, result):
        out[name] = _flat_outcome(flat_calls, fn, result)

    for numel, root in ((3, 0), (3, 1), (LARGE, 1)):  # in the envelope, and a data program
        t = torch.full((numel,), float(10 * r + 1))
        run(f"bc {numel} from {root}", lambda: dist.broadcast(t, root), t)
    for dtype in (torch.bfloat16, torch.bool, torch.complex64):
        t = (torch.arange(5) + 7 * r).to(dtype)
        run(f"bc {dtype}", lambda: dist.broadcast(t, 1), t.view(torch.float32) if t.is_complex() else t)
    t = torch.full((3,), float(r))
    run("bc async", lambda: dist.broadcast(t, 1, async_op=True), t)
    strided = torch.full((6,), float(r))[::2]
    run("bc strided", lambda: dist.broadcast(strided, 1), strided)
    param = torch.nn.Parameter(torch.full((2,), float(r)))
    run("bc parameter", lambda: dist.broadcast(param, 1), param.detach())
    bad = torch.zeros(2)
    run("bc bad root", lambda: dist.broadcast(bad, group_src=n, group=dist.group.WORLD), bad)

    for chunk in (2, LARGE):
        inp, res = torch.arange(n * chunk, dtype=torch.float32) + 100 * r, torch.zeros(n * chunk)
        run(f"a2a {chunk}", lambda: dist.all_to_all_single(res, inp), res)
    both = torch.arange(n * 2, dtype=torch.float32) + 100 * r
    run("a2a in place", lambda: dist.all_to_all_single(both, both), both)
    inp, res = (torch.arange(n * 2) + 100 * r).to(torch.bfloat16).reshape(n, 2), torch.zeros(n, 2, dtype=torch.bfloat16)
    run("a2a 2-d bf16", lambda: dist.all_to_all_single(res, inp), res)
    inp, res = torch.arange(n * 2, dtype=torch.float32) + 100 * r, torch.zeros(n * 2)
    run("a2a splits", lambda: dist.all_to_all_single(res, inp, [2] * n, [2] * n), res)
    run("a2a async", lambda: dist.all_to_all_single(res, inp, async_op=True), res)
    run("a2a uneven", lambda: dist.all_to_all_single(torch.zeros(n + 1), torch.zeros(n + 1)), res)
    run("a2a dtypes", lambda: dist.all_to_all_single(torch.zeros(n, dtype=torch.int32), torch.zeros(n)), res)
    return out


def recurring_collectives():
    """Collectives with data programs, each called FUSE_AFTER + 3 times with new data every call
    (the flat and the general path, several ops and dtypes): every result against the expected
    values, and how many calls ran the one-program form (programs.Recurring)."""
    from tpudist.process_group import programs

    fused_calls = cc._count_calls(programs.Compiled, "_run_fused")
    r, n = dist.get_rank(), dist.get_world_size()
    calls = programs.FUSE_AFTER + 3
    size = LARGE + 7  # shapes no other test of the shared pool runs: each key's count starts here
    out = {}

    def run(name, call):
        before, wrong = fused_calls[0], []
        for i in range(calls):
            got, want = call(i)
            if not torch.equal(got, want):
                wrong.append(i)
        out[name] = (wrong, fused_calls[0] - before)

    def all_reduce(i, dtype=torch.float32, op=dist.ReduceOp.SUM, async_op=False):
        base = torch.arange(2 * size) % 7  # twice: 16-bit types leave the envelope too
        t = (base + r + i).to(dtype)
        want = sum(base + k + i for k in range(n)).to(dtype)
        if op == dist.ReduceOp.MAX:
            want = (base + n - 1 + i).to(dtype)
        work = dist.all_reduce(t, op, async_op=async_op)
        if work is not None:
            work.wait()
        return t, want

    def all_gather(i):
        inp, got = torch.full((size,), float(r + 10 * i)), torch.zeros(size * n)
        dist.all_gather_into_tensor(got, inp)
        return got, torch.cat([torch.full((size,), float(k + 10 * i)) for k in range(n)])

    def reduce_scatter(i):
        inp, got = torch.arange(size * n, dtype=torch.float64) + r + i, torch.zeros(size, dtype=torch.float64)
        dist.reduce_scatter_tensor(got, inp)
        full = sum(torch.arange(size * n, dtype=torch.float64) + k + i for k in range(n))
        return got, full[r * size:(r + 1) * size]

    def broadcast(i):
        t = torch.full((size,), float(r + 10 * i))
        dist.broadcast(t, n - 1)
        return t, torch.full((size,), float(n - 1 + 10 * i))

    def all_to_all(i):
        inp, got = torch.arange(n * size, dtype=torch.int64) + 1000 * r + i, torch.zeros(n * size, dtype=torch.int64)
        dist.all_to_all_single(got, inp)
        want = torch.cat([(torch.arange(n * size, dtype=torch.int64) + 1000 * k + i)[r * size:(r + 1) * size]
                          for k in range(n)])
        return got, want

    run("all_reduce", all_reduce)
    run("all_reduce int max", lambda i: all_reduce(i, torch.int32, dist.ReduceOp.MAX))
    run("all_reduce bf16 async", lambda i: all_reduce(i, torch.bfloat16, async_op=True))  # general path
    run("all_gather", all_gather)
    run("reduce_scatter float64", reduce_scatter)
    run("broadcast", broadcast)
    run("all_to_all int64", all_to_all)
    return out


def mismatched_recurring(kind: str):
    """Ranks issue different collectives where at least one has reached its one-program form;
    returns (error type and text, the recurring all_reduce's result afterwards)."""
    from tpudist.process_group import programs

    r = dist.get_rank()
    recurring = torch.ones(LARGE)
    other = torch.ones(LARGE + 5)
    for _ in range(programs.FUSE_AFTER):
        dist.all_reduce(recurring.fill_(1.0))
        if kind == "fused_vs_fused":
            dist.all_reduce(other.fill_(1.0))
    try:
        if kind == "fused_vs_separate":  # rank 1's key has not recurred
            dist.all_reduce(recurring if r == 0 else torch.ones(LARGE + 1))
        elif kind == "fused_vs_small":
            dist.all_reduce(recurring if r == 0 else torch.ones(1))
        elif kind == "fused_vs_fused":  # both keys have recurred
            dist.all_reduce(recurring if r == 0 else other)
        elif kind == "fused_vs_barrier":
            dist.all_reduce(recurring) if r == 0 else dist.barrier()
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = f"{type(e).__name__}: {e}"
    recurring.fill_(float(r + 1))
    dist.all_reduce(recurring)
    return outcome, [recurring[0].item(), recurring[-1].item()]
