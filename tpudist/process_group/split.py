"""``tpudist.split_group``: ``torch.distributed.split_group`` for CPU backends.

torch 2.13's ``dist.split_group`` refuses to run without an accelerator (or torchcomms), for gloo
as for "tpu": "No device associated with the default pg, not safe to split any process groups".
This one takes the same arguments and returns the same thing: this rank's new group, or None when
no split holds it. As with torch's, every rank of the parent calls it, in the same order, and no
rank outside the parent does; only the members of a split take part in creating it.

Why not ``new_group(ranks, use_local_synchronization=True)``: torch names such a group after its
ranks and the number of groups the calling process already has, so members that created different
groups before (ranks of different splits, say) compute different names and wait for each other
under different store prefixes forever. Here the name comes from what the members share: the
parent's name, how many splits of it came before, and the split's ranks.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

_splits: dict[str, itertools.count] = {}  # parent group name -> splits made of it so far


def split_group(parent_pg: Any = None, split_ranks: list[list[int]] | None = None,
                timeout: timedelta | None = None, pg_options: Any = None,
                group_desc: str | None = None) -> Any:
    """Splits ``parent_pg`` (default: the world) into the groups ``split_ranks`` lists, in the
    parent's group ranks. Returns the new group that holds this rank, or None if none does.

    Splits must not overlap; a rank of the parent may be in none. The new groups use the parent's
    backend and, unless given, the default timeout.

    Example (4 ranks; every rank calls it):
        >>> import tpudist
        >>> half = tpudist.split_group(split_ranks=[[0, 1], [2, 3]])  # doctest: +SKIP
        >>> dist.all_reduce(t, group=half)  # sums over ranks 0-1, or over 2-3   # doctest: +SKIP
    """
    parent = parent_pg if parent_pg is not None else dist.group.WORLD
    size = dist.get_world_size(parent)
    me = dist.get_rank(parent)
    if me < 0:
        raise ValueError("split_group: this rank is not a member of parent_pg; only the parent's "
                         "ranks call split_group")
    mine = _my_split(split_ranks, size, me)
    number = next(_splits.setdefault(parent.group_name, itertools.count()))  # same on every member
    if mine is None:
        return None
    ranks = [dist.get_global_rank(parent, r) for r in mine]
    backend = dist.get_backend(parent)
    if timeout is None:  # torch's default for every backend but NCCL, which this cannot be (no CUDA)
        timeout = default_pg_timeout
    name = f"{parent.group_name}/split{number}/{'_'.join(map(str, ranks))}"
    world = c10d._world  # noqa: SLF001 - torch's registry of groups: their stores and rank maps
    store = world.pg_map[dist.group.WORLD][1]
    # What new_group does after naming the group (torch 2.13), minus its world-wide barrier.
    pg, _ = c10d._new_process_group_helper(  # noqa: SLF001
        len(ranks), ranks.index(dist.get_rank()), ranks, backend, store, name,
        backend_options=pg_options, timeout=timeout, group_desc=group_desc)
    world.pg_group_ranks[pg] = {g: r for r, g in enumerate(ranks)}
    return pg


def _my_split(split_ranks: list[list[int]] | None, size: int, me: int) -> list[int] | None:
    """The split holding group rank ``me`` (sorted), after checking every split as torch does."""
    if not split_ranks:
        raise ValueError(f"split_group: split_ranks={split_ranks!r} must list at least one split, "
                         "e.g. [[0, 1], [2, 3]]")
    seen: dict[int, int] = {}
    for i, split in enumerate(split_ranks):
        split = list(split)
        if not split:
            raise ValueError(f"split_group: split_ranks[{i}] is empty; every split needs a rank")
        if len(set(split)) != len(split):
            raise ValueError(f"split_group: split_ranks[{i}]={split} lists a rank twice")
        for r in split:
            if not 0 <= r < size:
                raise ValueError(f"split_group: split_ranks[{i}]={split} holds rank {r}, but the "
                                 f"parent group's ranks are 0..{size - 1} (group ranks, not global)")
            if r in seen:
                raise ValueError(f"split_group: rank {r} is in split_ranks[{seen[r]}] and "
                                 f"split_ranks[{i}]; splits must not overlap")
            seen[r] = i
    return sorted(split_ranks[seen[me]]) if me in seen else None
