"""A group's channel: what its collectives run through, the face a group shows its helpers.

:class:`~tpudist.process_group.group.ProcessGroupTPU` answers torch (its methods are c10d's); its
:class:`Channel` holds the rest: the store, the timeout, the group's members, name and code, and the
per-call plumbing every collective shares (the program key, the reduce op's name, ``run_program``
with its fingerprint check and c10d-style errors, ``submit`` to the comm stream, ``post`` of a
send or recv). The helpers (``movement``, ``device_collectives``, ``p2p``, ``small``, ``sparse``,
``debug``, ``monitor``, ``lifecycle``) take the channel, never the group's private members.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpudist.process_group import debug, device_arrays, programs, runtime
from tpudist.process_group import tensors as tz
from tpudist.process_group.checks import STUCK_GRACE_S, looks_like_peer_loss, looks_like_timeout
from tpudist.process_group.device_arrays import DeviceCall
from tpudist.process_group.keys import ProgramKey
from tpudist.process_group.p2p import P2P
from tpudist.process_group.work import STREAM, CollectiveError, CollectiveMismatch, CollectiveTimeout, Work

REDUCE_NAMES = {
    dist.ReduceOp.SUM: programs.SUM, dist.ReduceOp.AVG: programs.AVG,
    dist.ReduceOp.PRODUCT: programs.PRODUCT, dist.ReduceOp.MIN: programs.MIN,
    dist.ReduceOp.MAX: programs.MAX, dist.ReduceOp.BAND: programs.BAND,
    dist.ReduceOp.BOR: programs.BOR, dist.ReduceOp.BXOR: programs.BXOR,
    dist.ReduceOp.PREMUL_SUM: programs.PREMUL_SUM,
}
_BITWISE = (programs.BAND, programs.BOR, programs.BXOR)
# bool reduces as uint8 0/1: sum is "or" and product is "and", as gloo does.
_BOOL_REDUCE = {programs.SUM: programs.MAX, programs.PRODUCT: programs.MIN, programs.BAND: programs.MIN,
                programs.BOR: programs.MAX}


class Channel:
    """One group's store, timeout, members and per-call plumbing (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, global_ranks: tuple[int, ...],
                 is_world: bool):
        self.store = store  # None once the group shut down or aborted
        self.rank, self.size = rank, size  # this process's group rank, the number of members
        self.timeout = timeout
        self.global_ranks = global_ranks  # global rank of each group rank
        self.is_world = is_world  # this group booted the runtime (and shuts it down)
        self.name = ""
        self.code = programs.group_code("")  # the name's code, in every fingerprint
        self.coalescing: list[Work] | None = None  # between _start_coalescing and _end_coalescing
        self.programs_run: dict[tuple[int, ...], int] = {}  # per device set: the call sequence
        self.detail: debug.Detail | None = None  # TPUDIST_DEBUG=DETAIL: store-based checks
        self.inline = False  # whether a synchronous collective may run in the caller's thread
        # p2p.py's per-group state: recvs paired per (sender, tag), whether the store has queues,
        # a second store connection for blocking waits.
        self.p2p_received: dict[tuple[int, int], int] = {}
        self.p2p_has_queues: bool | None = None
        self.p2p_blocking_store: Any = None

    def set_name(self, name: str) -> None:
        self.name = name
        self.code = programs.group_code(name)  # in every fingerprint: computed once

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.inline = self.runs_inline()

    def runs_inline(self) -> bool:
        """Whether a synchronous collective may run in the caller's thread (else see enqueue), with
        no per-call checks besides the program's own (TPUDIST_DEBUG=DETAIL adds store checks)."""
        return self.detail is None and self.timeout.total_seconds() >= runtime.current().collective_timeout_s

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.rank]

    def describe(self, op: str) -> str:
        return f"{op} on group {self.name or '?'} (global ranks {list(self.global_ranks)})"

    def key(self, op: str, block: np.ndarray, reduce: str | None = None, static: tuple = (),
            root: int | None = None) -> ProgramKey:
        return ProgramKey(op, block.shape, _dtype_name(block.dtype), self.global_ranks, reduce, static, root)

    def reduce_name(self, op: str, reduce_op: Any, dtype: torch.dtype) -> tuple[str, tuple]:
        kind = getattr(reduce_op, "op", reduce_op)
        name = REDUCE_NAMES.get(kind)
        if name is None:
            raise ValueError(f"{op}: reduce_op={reduce_op} is not a c10d ReduceOp")
        static: tuple = ()
        if name == programs.PREMUL_SUM:
            factor = reduce_op.factor
            if isinstance(factor, torch.Tensor):
                factor = factor.item()
            static = (float(factor),)
        if not tz.numeric_supported(dtype):
            raise TypeError(f"{op}: dtype={dtype} cannot be reduced by tpudist; use one of "
                            "float16/bfloat16/float32/float64, int8-int64, uint8, bool, complex")
        floating = dtype in tz.FLOATING or dtype in tz.COMPLEX
        if name in _BITWISE and floating:
            raise TypeError(f"{op}: reduce_op={name.upper()} needs an integer or bool tensor, got "
                            f"dtype={dtype}")
        if name in (programs.AVG, programs.PREMUL_SUM) and not floating:
            raise TypeError(f"{op}: reduce_op={name.upper()} needs a floating or complex tensor, got "
                            f"dtype={dtype}; use SUM and divide")
        if dtype in tz.COMPLEX and name in (programs.MIN, programs.MAX, programs.PRODUCT):
            raise TypeError(f"{op}: reduce_op={name.upper()} is not defined for complex dtype={dtype}")
        if dtype == torch.bool:
            name = _BOOL_REDUCE.get(name, name)
        return name, static

    def check_rank(self, op: str, what: str, rank: int) -> int:
        if not 0 <= rank < self.size:
            raise ValueError(f"{op}: {what}={rank} is not a rank of this group of size {self.size}; "
                             f"group ranks are 0..{self.size - 1}")
        return rank

    # -- running programs -------------------------------------------------------------------------
    def submit(self, op: str, key: ProgramKey, block: np.ndarray,
               finish: Callable[[np.ndarray], Any], async_op: bool,
               dest: np.ndarray | None = None) -> Work:
        """Queues the program for ``key`` on ``block``; ``finish`` writes its result back. ``dest``:
        the caller's output, contiguous and in the result's shape, which the result may be
        assembled in directly (see :meth:`Compiled.run`)."""
        work = Work(self.describe(op), self.timeout)

        def task():
            return finish(self.run_program(op, key, block, dest))

        return self.enqueue(work, task, async_op)

    def run_program(self, op: str, key: ProgramKey, block: np.ndarray,
                    dest: np.ndarray | None = None) -> np.ndarray:
        if self.detail is not None:
            self.detail.check(self, op, key)  # raises before any XLA runs
        # A device call (tpu tensors) runs its own program over the same fingerprints (device_arrays.py).
        compiled = programs.program(key) if not isinstance(block, DeviceCall) else device_arrays.program(block)
        seq = self.programs_run[key.group] = self.programs_run.get(key.group, 0) + 1
        fingerprint = compiled.call_fingerprint(self.code, seq)
        if STREAM.drain_limit_s is not None:  # a TPU program: a timeout names who it waits for
            STREAM.running = (f"{op} #{seq} over global ranks {list(key.group)}",
                              lambda: self.absent_ranks(key.group, seq))
        try:
            result, fingerprints = compiled.run(block, fingerprint, dest)
        except Exception as e:  # XLA raises ValueError/JaxRuntimeError: make it a c10d-style error
            raise self.failure(op, key.group, seq, e) from e
        finally:
            STREAM.running = None
        if result is None:  # run() compared every rank's fingerprint: they differ, nothing moved
            raise self.mismatch(op, key.group, fingerprints)
        return result

    def enqueue(self, work: Work, task: Callable[[], Any], async_op: bool) -> Work:
        P2P.flush()  # pending sends/recvs were issued first: keep the order on every rank
        if self.coalescing is not None:
            self.coalescing.append(work)
            async_op = True
        if self.timeout.total_seconds() < runtime.current().collective_timeout_s:
            # XLA's collective timeout is per process (the first world's); a group with a shorter
            # one runs on the comm thread and whoever waits gets CollectiveTimeout at the group's
            # timeout. XLA cannot cancel the call: it ends at XLA's timeout (lifecycle.py).
            async_op = True
        return STREAM.submit(work, task, async_op=async_op)

    def post(self, kind: str, t: torch.Tensor, peer: int | None, tag: int) -> Work:
        """Queues a send or recv of ``t`` (a cpu or a tpu tensor) with group rank ``peer`` (None:
        a recv from any source), to be paired and run by p2p.py."""
        return P2P.post(self, kind, t, peer, tag)

    # -- failures ---------------------------------------------------------------------------------
    def failure(self, op: str, device_set: tuple[int, ...], seq: int, e: Exception) -> CollectiveError:
        """The c10d-style error for XLA's ``e`` (ValueError/JaxRuntimeError) at collective ``seq``."""
        for looks_like, error, what in _FAILURES:
            if looks_like(e):
                missing = self.absent_ranks(device_set, seq)
                return error(
                    f"{self.describe(op)}: collective #{seq} over global ranks {list(device_set)} "
                    f"{what.format(missing=missing, timeout=self.timeout.total_seconds())}. Rank "
                    f"{self.rank} saw: {e}")
        return CollectiveError(f"{self.describe(op)} failed on rank {self.rank}: {e}")

    def mismatch(self, op: str, device_set: tuple[int, ...], fingerprints: np.ndarray) -> CollectiveMismatch:
        """Ranks sent different fingerprints: nothing ran. Takes this call back out of the count."""
        self.programs_run[device_set] -= 1  # keep the ranks' counts aligned
        return self.calls_differ(op, range(len(fingerprints)), fingerprints)

    def calls_differ(self, op: str, ranks: Any, fingerprints: Any) -> CollectiveMismatch:
        """The error each rank raises when the calls of ``ranks`` (their ``fingerprints``, in that
        order) differ, each call in words; p2p.py's pairs raise it too."""
        names = {programs.group_code(c.name): c.name for c in _live_channels()}
        mixed = len({int(fp[0]) & device_arrays.DEVICE_FLAG for fp in fingerprints}) > 1
        calls = "; ".join(f"rank {r} called {device_arrays.describe_fingerprint(fp, names, mixed)}"
                          for r, fp in zip(ranks, fingerprints))
        return CollectiveMismatch(
            f"{self.describe(op)}: ranks issued different collectives ({calls}). Every rank of "
            "a group must issue the same collectives, with the same shapes, dtypes and reduce "
            "ops, in the same order; no data was exchanged.")

    def absent_ranks(self, device_set: tuple[int, ...], seq: int) -> list[int]:
        """After a timeout or a lost peer: the global ranks of ``device_set`` that did not also fail at
        collective ``seq``. Every failed rank reports through the store, then waits a grace period."""
        store, me = self.store, self.global_rank
        prefix = f"tpudist/stuck/{'-'.join(map(str, device_set))}/{seq}"
        try:
            store.set(f"{prefix}/{me}", b"1")
            deadline = time.monotonic() + STUCK_GRACE_S
            missing = [r for r in device_set if r != me]
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
                time.sleep(0.05)
            return missing
        except Exception:  # noqa: BLE001 - the store itself may be gone: then nobody is known
            return [r for r in device_set if r != me]


# How XLA's failures read, what tpudist raises for them, and how the message puts it.
_FAILURES = (
    (looks_like_timeout, CollectiveTimeout, "did not complete within the timeout of {timeout:g}s: ranks "
                                            "{missing} never reached it (a rank that is hung elsewhere, "
                                            "took another branch, or died)"),
    (looks_like_peer_loss, CollectiveError, "lost its peers; ranks {missing} did not report (they died or hang)"),
)


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # numpy computes the name on every access (~5 us on the latency path)


def _live_channels() -> list[Channel]:
    """The channels of the "tpu" groups torch knows (destroyed groups are gone from its map)."""
    groups = c10d._world.pg_map  # noqa: SLF001 - torch keeps its groups only here
    return [c for g in groups if isinstance(c := getattr(g, "channel", None), Channel)]
