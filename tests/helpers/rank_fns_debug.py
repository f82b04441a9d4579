"""Rank-side functions of the debug-mode tests (module level, so rank processes can import them)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

_groups: dict[str, Any] = {}
SUB_RANKS = [0, 2]  # a subgroup that leaves rank 1 out


def _groups_of(which: str) -> tuple[Any, Any]:
    """(group, twin): the world or a subgroup, and a group with the same members (made on first use:
    every rank asks for the same ones in the same order)."""
    members = {"world": list(range(dist.get_world_size())), "sub": SUB_RANKS}[which]
    for name in (which, f"{which}_twin"):
        if name not in _groups:
            _groups[name] = dist.group.WORLD if name == "world" else dist.new_group(members)
    return _groups[which], _groups[f"{which}_twin"]


def mismatched(kind: str, which: str):
    """Ranks of ``which`` ("world" or "sub") issue different collectives; returns (outcome, after,
    names): the error text, the result of a correct all_reduce on the group and on the world
    afterwards, and the group names the message should use."""
    group, twin = _groups_of(which)
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        dist.all_reduce(t := torch.ones(2))
        return "not a member", t.tolist(), {}
    me, root = dist.get_rank(group), dist.get_global_rank(group, 0)
    names = {"group": group.group_name, "twin": twin.group_name}
    t = torch.ones(4)
    try:
        if kind == "shape":
            dist.all_reduce(torch.ones(3 + me), group=group)
        elif kind == "dtype":
            dist.all_reduce(torch.ones(4, dtype=torch.float32 if me == 0 else torch.int32), group=group)
        elif kind == "reduce_op":
            dist.all_reduce(t, dist.ReduceOp.SUM if me == 0 else dist.ReduceOp.MAX, group=group)
        elif kind == "op":
            dist.all_reduce(t, group=group) if me == 0 else dist.broadcast(t, root, group=group)
        elif kind == "skipped":  # group rank 0 issues one more collective, on a group with the same members
            if me == 0:
                dist.all_reduce(t, group=twin)
            dist.all_reduce(t, group=group)
        elif kind == "reduce_root":  # each rank names itself as the root
            dist.reduce(t, dst=dist.get_global_rank(group, me), group=group)
        elif kind == "gather_vs_all_gather":  # the same program: only DETAIL tells them apart
            if me == 0:
                dist.gather(t, [torch.zeros(4) for _ in range(group.size())], dst=root, group=group)
            else:
                dist.all_gather([torch.zeros(4) for _ in range(group.size())], t, group=group)
        elif kind == "p2p_shape":  # group ranks 0 and 1 only
            peer = dist.get_global_rank(group, 1 - me) if me < 2 else None
            if me == 0:
                dist.send(torch.ones(2), peer, group=group)
            elif me == 1:
                dist.recv(torch.zeros(3), peer, group=group)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = f"{type(e).__name__}: {e}"
    after = torch.ones(2)
    dist.all_reduce(after, group=group)  # the group still works
    dist.all_reduce(after)  # and so does the world
    return outcome, after.tolist(), names


def every_op():
    """A correct run of each kind of program (p2p, barrier, ragged all_to_all, ...): values only."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    gathered = torch.zeros(2 * n)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(r)))
    out["all_gather"] = gathered.tolist()
    dist.barrier()
    splits = [r + 1] * n  # rank r sends r+1 rows to everyone: uneven
    received = torch.zeros(sum(j + 1 for j in range(n)))
    dist.all_to_all_single(received, torch.full((sum(splits),), float(r)), [j + 1 for j in range(n)],
                           splits)
    out["all_to_all"] = received.tolist()
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = b.tolist()
    ring = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % n),
           dist.P2POp(dist.irecv, ring, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["ring"] = ring.tolist()
    return out


class Recorder:
    """Stands in for a store and counts what is asked of it."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, Counter()

    def __getattr__(self, name: str) -> Any:
        self.calls[name] += 1
        return getattr(self.inner, name)


def store_traffic(num_calls: int):
    """How many store operations ``num_calls`` all_reduces on the world and on a subgroup cost."""
    group, _ = _groups_of("sub")
    world = dist.group.WORLD
    for g in (world, group):  # compile first
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.all_reduce(torch.ones(2), group=g)
    world.channel.store = recorder = Recorder(world.channel.store)  # where every tpudist store access goes
    try:
        for _ in range(num_calls):
            dist.all_reduce(torch.ones(2))
            if group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.all_reduce(torch.ones(2), group=group)
    finally:
        world.channel.store = recorder.inner
    return dict(recorder.calls)


def keys_left(num_calls: int):
    """After ``num_calls`` all_reduces, which of this rank's DETAIL keys of the world still exist."""
    from tpudist.process_group import debug

    ledger = debug._ledger
    world = tuple(range(dist.get_world_size()))
    for _ in range(num_calls):
        dist.all_reduce(torch.ones(2))
    last = ledger.slots[world]
    store = dist.group.WORLD.channel.store
    return last, [s for s in range(1, last + 1) if store.check([ledger.key(world, s, dist.get_rank())])]


def init_world(timeout_s: float):
    from datetime import timedelta

    dist.init_process_group("tpu", timeout=timedelta(seconds=timeout_s))


def one_rank_absent(absent: int, nap_s: float):
    """Rank ``absent`` sleeps instead of joining an all_reduce; the others must time out."""
    if dist.get_rank() == absent:
        time.sleep(nap_s)
        return "absent"
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
        return "completed?!", 0.0
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
