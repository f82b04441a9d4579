"""Debug mode DETAIL: before any XLA runs, the ranks compare each collective through the c10d store.

``TPUDIST_DEBUG=DETAIL`` (or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; ``TPUDIST_DEBUG`` wins when
both are set) makes every rank publish what it is about to run (a :class:`Call`: c10d op, block shape
and dtype, reduce op, root or permutation, group name, call number) before each program of every
"tpu" group, world or subgroup, point to point and barrier included, and read its peers' calls.
Ranks that disagree all raise :class:`CollectiveMismatch` naming what each one called; peers that
do not publish within the group timeout make the others raise :class:`CollectiveTimeout` naming
them. Nothing has reached XLA at that point, so the groups stay usable after a mismatch.

The default mode already compares a 24-byte fingerprint in every program's first exchange
(envelope.py). DETAIL adds what that cannot: the c10d op name (``gather`` and ``all_gather`` run
the same program), the full shape, readable names in the message, and a timeout that knows who is
missing without XLA's help. It costs a few store round trips per collective
(``benchmarks/debug_overhead.py`` measures how many us).

Store keys: calls meet in the world group's store under ``tpudist/detail/<device set>/<slot>/<rank>``.
The slot counts the programs run over one device set by every group, because groups with the same
members share one XLA communicator: the calls that XLA would pair are the ones compared. A rank deletes
its key of slot N-1 once every peer has published slot N (they have all read it by then), so at most
two keys per rank and device set exist; the world's last keys go at ``destroy_process_group()``.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tpudist.process_group.switch import Switch
from tpudist.process_group.work import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
)

OFF, INFO, DETAIL = "OFF", "INFO", "DETAIL"
_LEVELS = (OFF, INFO, DETAIL)
LEVEL_ENVS = ("TPUDIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG")  # first one set wins
_PREFIX = "tpudist/detail"
# What ProgramKey.static holds, per program op (lowerings.py and p2p.py).
_STATIC_NAMES = {"broadcast": "src", "scatter": "src", "permute": "pairs", "all_reduce": "factor",
                 "reduce_scatter": "factor"}


def debug_level(environ: Mapping[str, str] | None = None) -> str:
    """The debug level named by ``TPUDIST_DEBUG``, else ``TORCH_DISTRIBUTED_DEBUG``, else OFF."""
    environ = os.environ if environ is None else environ
    for name in LEVEL_ENVS:
        value = environ.get(name, "")
        if value:
            if value.upper() not in _LEVELS:
                raise ValueError(f"{name}={value!r} is not a debug level: use one of {', '.join(_LEVELS)} "
                                 "(DETAIL checks every collective across ranks)")
            return value.upper()
    return OFF


@dataclass(frozen=True, slots=True)
class Call:
    """What one rank is about to run: one XLA program of one c10d call.

    ``shape`` and ``dtype`` are those of the block the rank hands to XLA: for reductions, the tensor
    (bool as uint8); for data-moving ops, its raw bytes in int32 or uint8 words.
    """

    op: str  # the c10d op ("all_reduce", "all_gather_into_tensor", "send", ...)
    program: str  # the program it runs (ProgramKey.op)
    shape: tuple[int, ...]
    dtype: str
    reduce: str | None
    static: tuple  # root, premul factor or permutation (see _STATIC_NAMES)
    root: int | None  # reduce and gather: the group rank that keeps the result
    group: str
    seq: int  # the group's program count over these devices, from 1

    @classmethod
    def of(cls, op: str, key: Any, group: str, seq: int) -> Call:
        return cls(op, key.op, tuple(key.shape), key.dtype, key.reduce, tuple(key.static), key.root,
                   group, seq)

    def encode(self) -> bytes:
        return json.dumps([self.op, self.program, self.shape, self.dtype, self.reduce, self.static,
                           self.root, self.group, self.seq]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Call:
        op, program, shape, dtype, reduce, static, root, group, seq = json.loads(raw)
        return cls(op, program, _tuples(shape), dtype, reduce, _tuples(static), root, group, seq)

    def agrees_with(self, other: Call) -> bool:
        """Same call, except that a send meets a recv (the permutation says who sends)."""
        def identity(c: Call) -> tuple:
            return ("send/recv" if c.op in ("send", "recv") else c.op, c.program, c.shape, c.dtype,
                    c.reduce, c.static, c.root, c.group, c.seq)
        return identity(self) == identity(other)

    def __str__(self) -> str:
        via = f" via {self.program}" if self.program != self.op else ""
        parts = [f"shape={self.shape}", f"dtype={self.dtype}"]
        if self.reduce:
            parts.append(f"reduce_op={self.reduce.upper()}")
        if self.static:
            name = _STATIC_NAMES.get(self.program, "static")
            parts.append(f"{name}={self.static[0] if name != 'pairs' else list(self.static)}")
        if self.root is not None:
            parts.append(f"dst={self.root}")
        return f"{self.op}{via}({', '.join(parts)}) as #{self.seq} on group {self.group or '(unnamed)'}"


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class _Ledger:
    """One world's DETAIL state: its store (through the world group) and a slot count per device set."""

    def __init__(self, world: Any, rank: int):
        self._world = weakref.ref(world)  # no cycle: the group owns its Detail, which owns this
        self.rank = rank  # global rank
        self.slots: dict[tuple[int, ...], int] = {}

    @property
    def store(self) -> Any:
        world = self._world()
        store = None if world is None else world.store
        if store is None:
            raise CollectiveError("TPUDIST_DEBUG=DETAIL: the world group was destroyed, so its store "
                                  "is gone; create groups again after init_process_group")
        return store

    def key(self, device_set: tuple[int, ...], slot: int, rank: int) -> str:
        return f"{_PREFIX}/{'-'.join(map(str, device_set))}/{slot}/{rank}"


_ledger: _Ledger | None = None
_ACTIVE = Switch(True)  # turned off for a scope by detail_checks(); every rank at the same point
detail_checks = _ACTIVE.scoped  # (enabled): the DETAIL checks of groups created in DETAIL mode


def for_group(group: Any) -> Detail | None:
    """The DETAIL checker of a new group, or None when the mode is off.

    The world group reads the level (once, here); its subgroups follow the world, so every group of
    a world is checked alike however the environment changes later.
    """
    global _ledger
    if group.is_world:
        _ledger = _Ledger(group, group.global_ranks[group.rank]) if debug_level() == DETAIL else None
    return None if _ledger is None else Detail(_ledger)


class Detail:
    """The DETAIL checks of one group."""

    def __init__(self, ledger: _Ledger):
        self._ledger = ledger
        self._seqs: dict[tuple[int, ...], int] = {}  # this group's program count per device set

    def check(self, group: Any, op: str, key: Any) -> None:
        """Before ``key``'s program runs: every rank of ``key.group`` must be about to run the same call.

        Raises CollectiveMismatch (on every rank) or CollectiveTimeout; nothing ran on XLA then.
        """
        if not _ACTIVE:
            return
        ledger, device_set = self._ledger, tuple(key.group)
        slot = ledger.slots[device_set] = ledger.slots.get(device_set, 0) + 1
        seq = self._seqs[device_set] = self._seqs.get(device_set, 0) + 1
        call = Call.of(op, key, group.name, seq)
        peers = [r for r in device_set if r != ledger.rank]
        if not peers:
            return
        store, timeout = ledger.store, group.timeout
        try:
            store.set(ledger.key(device_set, slot, ledger.rank), call.encode())
            keys = [ledger.key(device_set, slot, r) for r in peers]
            _wait(store, keys, peers, timeout, call, device_set, ledger, slot, group)
            calls = {ledger.rank: call, **{r: Call.decode(v) for r, v in zip(peers, store.multi_get(keys))}}
            if slot > 1:  # every peer published this slot, so every peer has read my previous one
                store.delete_key(ledger.key(device_set, slot - 1, ledger.rank))
        except dist.DistError as e:
            raise CollectiveError(f"{group.describe(op)}: the TPUDIST_DEBUG=DETAIL check of {call} "
                                  f"could not use the c10d store (its host, rank 0, may be gone): {e}") from e
        if not all(c.agrees_with(call) for c in calls.values()):
            self._seqs[device_set] -= 1  # the call did not happen; the slot is spent on every rank
            raise CollectiveMismatch(_mismatch_message(group, op, device_set, slot, calls))

    def close(self, group: Any) -> None:
        """At group shutdown: the world deletes this rank's last keys (after the runtime's shutdown
        barrier, so every peer has read them) and ends the ledger."""
        global _ledger
        if not group.is_world or self._ledger is not _ledger:
            return
        ledger, _ledger = self._ledger, None
        try:
            store = ledger.store
            for device_set, slot in ledger.slots.items():
                if len(device_set) > 1:
                    store.delete_key(ledger.key(device_set, slot, ledger.rank))
        except (CollectiveError, dist.DistError):
            pass  # the store went with its host (rank 0): so did the keys


def _wait(store: Any, keys: list[str], peers: list[int], timeout: timedelta, call: Call,
          device_set: tuple[int, ...], ledger: _Ledger, slot: int, group: Any) -> None:
    t0 = time.monotonic()
    try:
        store.wait(keys, timeout)
        return
    except dist.DistError:  # DistStoreError on timeout; anything else shows in check() below
        missing = [r for r, k in zip(peers, keys) if not store.check([k])]
    if not missing:
        return
    last = []
    for r in missing:
        previous = ledger.key(device_set, slot - 1, r)
        seen = Call.decode(store.get(previous)) if slot > 1 and store.check([previous]) else None
        last.append(f"rank {r}: {seen if seen else 'no collective over these devices yet'}")
    raise CollectiveTimeout(
        f"{group.describe(call.op)}: TPUDIST_DEBUG=DETAIL: global ranks {missing} did not reach "
        f"{call} within {time.monotonic() - t0:.1f}s (group timeout {timeout.total_seconds():.1f}s); "
        f"their last call over global ranks {list(device_set)} was: {'; '.join(last)}. A rank that is "
        "hung elsewhere, skipped this collective under a rank-dependent branch, or died; no data was "
        "exchanged.")


def _mismatch_message(group: Any, op: str, device_set: tuple[int, ...], slot: int,
                      calls: dict[int, Call]) -> str:
    listed = "; ".join(f"rank {r} called {calls[r]}" for r in device_set)
    diverged = len({(c.group, c.seq) for c in calls.values()}) > 1
    hint = ("a rank skipped or added a collective, or issued two groups' collectives in another order "
            "(groups with the same members share one XLA communicator)" if diverged else
            "look for a rank-dependent branch, shape or dtype before this call")
    return (f"{group.describe(op)}: TPUDIST_DEBUG=DETAIL: global ranks {list(device_set)} are about to "
            f"run different collectives (program #{slot} over these devices): {listed}. Every rank of "
            "a group must issue the same collectives, with the same shapes, dtypes, reduce ops and "
            f"roots, in the same order; {hint}. No data was exchanged; the group remains usable.")
