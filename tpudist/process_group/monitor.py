"""``monitored_barrier`` through the c10d store: names the ranks that did not arrive.

torch's ``dist.monitored_barrier`` refuses every backend but gloo (torch 2.13), so tpudist offers
``tpudist.monitored_barrier(group)`` (and ``group.monitored_barrier``) with gloo's semantics.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from typing import Any

_POLL_S = 0.01
_counters: dict[int, itertools.count] = {}


def monitored_barrier(group: Any, timeout: timedelta, wait_all_ranks: bool = False) -> None:
    """Blocks until every rank of ``group`` arrived; rank 0 raises naming the ranks that did not."""
    channel = group.channel
    store, rank, size = channel.store, channel.rank, channel.size
    seq = next(_counters.setdefault(id(group), itertools.count()))
    prefix = f"tpudist/monitored_barrier/{seq}"
    store.set(f"{prefix}/arrived/{rank}", b"1")
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        missing = list(range(1, size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{prefix}/arrived/{r}"])]
            if missing and not wait_all_ranks and time.monotonic() >= deadline:
                break
            if missing:
                time.sleep(_POLL_S)
        if missing:
            shown = missing if wait_all_ranks else missing[:1]
            store.set(f"{prefix}/failed", str(shown).encode())
            raise RuntimeError(f"monitored_barrier: ranks {shown} of group {channel.name or '?'} "
                               f"did not arrive within {timeout.total_seconds():.1f}s")
        store.set(f"{prefix}/released", b"1")
        return
    while time.monotonic() < deadline:
        if store.check([f"{prefix}/released"]):
            return
        if store.check([f"{prefix}/failed"]):
            failed = store.get(f"{prefix}/failed").decode()
            raise RuntimeError(f"monitored_barrier: rank 0 reports ranks {failed} missing")
        time.sleep(_POLL_S)
    raise RuntimeError(f"monitored_barrier: rank 0 did not release rank {rank} within "
                       f"{timeout.total_seconds():.1f}s")
