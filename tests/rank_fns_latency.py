"""Rank functions of tests/test_collective_latency.py (importable by rank processes)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tpudist.process_group import envelope

_IDLE, _OTHER = os.SCHED_IDLE, os.SCHED_OTHER
LARGE = envelope.PAYLOAD_BYTES // 4 + 1  # float32 elements: one more than the envelope carries


def loop_policies():
    """The gloo loop thread's policy as the kernel reports it after a small and after a large
    all_reduce, and the threads of this process in SCHED_IDLE after a small one."""
    from tpudist.process_group.runtime import GLOO_LOOP

    tid = GLOO_LOOP.tid
    small, large = torch.ones(1), torch.ones(LARGE)
    dist.all_reduce(small)
    after_small = os.sched_getscheduler(tid) if tid is not None else None
    dist.all_reduce(large)
    after_large = os.sched_getscheduler(tid) if tid is not None else None
    dist.all_reduce(torch.ones(1))
    again = os.sched_getscheduler(tid) if tid is not None else None
    idle_threads = _idle_threads()
    with GLOO_LOOP.forced(False):
        dist.all_reduce(torch.ones(1))
        forced = os.sched_getscheduler(tid) if tid is not None else None
    return {"tid": tid, "in_process": tid is not None and os.path.exists(f"/proc/self/task/{tid}"),
            "after_small": after_small, "after_large": after_large, "again": again, "forced": forced,
            "results": [small.item(), large[0].item(), large[-1].item()], "idle_threads": idle_threads}


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
        elif kind == "barrier_vs_small":
            dist.barrier() if r == 0 else dist.broadcast(torch.ones(2), 0)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = f"{type(e).__name__}: {e}"
    small, large = torch.ones(2), torch.ones(LARGE)
    dist.all_reduce(small)
    dist.all_reduce(large)
    return outcome, small.tolist(), [large[0].item(), large[-1].item()]
