"""Point to point: a send or recv is a 2-device ``ppermute`` that both sides dispatch.

A recv from any source (``recv``/``irecv`` without ``src``) is paired first, through the group's
c10d store: every send adds one to a counter ``(sender, receiver, tag)`` when it is posted, and
the receiver, whose recvs from each sender are counted too, waits for a sender whose counter has
passed what it already received, then runs the ordinary 2-device transfer with it.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from tpudist.process_group import tensors as tz
from tpudist.process_group.checks import check_output, overlaps
from tpudist.process_group.programs import ProgramKey
from tpudist.process_group.work import STREAM, Work


class DeferredWork(Work):
    """A send or recv: it runs when waited on, or before the process's next collective.

    ``source``: for a recv, the group rank it receives from (an any-source recv learns it when
    paired); ``_source_rank()`` is what ``dist.recv`` returns and ``Work._source_rank()`` reads.
    """

    source: int | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        P2P.flush()
        return super().wait(timeout)

    def get_future(self) -> torch.futures.Future:
        P2P.flush()
        return super().get_future()

    def _source_rank(self) -> int:
        self.wait()
        if self.source is None:
            raise RuntimeError(f"{self._description}: _source_rank() is only defined for a recv")
        return self.source


class PointToPoint:
    """Pending sends and recvs of this process, issued in one global order.

    XLA has no eager send: a transfer is a 2-device ``ppermute`` that both sides must dispatch. The
    sides agree on the order without talking by sorting by (sender, receiver, tag), then issue
    order; ``batch_isend_irecv`` with sends both ways between two ranks therefore cannot deadlock.
    """

    def __init__(self) -> None:
        self._pending: list[tuple] = []
        self._seq = 0

    def post(self, group: Any, kind: str, t: torch.Tensor, peer: int | None, tag: int) -> Work:
        """Queues a send or recv of ``t`` with group rank ``peer`` (None: a recv from any source)."""
        if peer == group.rank():
            raise ValueError(f"{kind}: rank {peer} cannot {kind} to itself; use a copy")
        if kind == "recv":
            check_output("recv", "tensor", t)
        me = group.global_ranks[group.rank()]
        other = None if peer is None else group.global_ranks[peer]
        src, dst = (me, other) if kind == "send" else (other, me)
        shown = "any" if src is None else src
        work = DeferredWork(f"{kind} {shown}->{dst} (tag {tag}) of {tuple(t.shape)} {t.dtype}",
                             group._timeout)  # noqa: SLF001
        if kind == "recv":
            work.source = peer
        self._check_disjoint(kind, t, shown, dst)
        if kind == "send":  # before the transfer can block: an any-source receiver pairs on this
            _announce(group, group.rank(), peer, tag)
        self._seq += 1
        self._pending.append(((src, dst, tag), self._seq, group, kind, t, work))
        return work

    def _check_disjoint(self, kind: str, t: torch.Tensor, src: int, dst: int) -> None:
        """A recv may not share memory with another pending send or recv: the batch runs in an order
        tpudist chooses, so the send would carry the old or the received bytes. Refusing one op
        refuses the whole batch (its other ops would otherwise run unpaired)."""
        for (p_src, p_dst, _), _, _, p_kind, p_t, _ in self._pending:
            if "recv" in (kind, p_kind) and overlaps(t, p_t):
                error = ValueError(
                    f"{kind} {src}->{dst} of {tuple(t.shape)} {t.dtype}: its tensor shares memory with "
                    f"the pending {p_kind} {p_src}->{p_dst} of {tuple(p_t.shape)} {p_t.dtype}. The sends "
                    "and recvs of a batch run in an order tpudist chooses, so a recv into memory that "
                    "another op of the batch sends or receives gives a result that depends on it. "
                    "Receive into a separate tensor; the pending sends and recvs were dropped.")
                self.cancel(error)
                raise error

    def idle(self) -> bool:
        """Whether no send or recv is pending (so a collective may run without flushing first)."""
        return not self._pending

    def cancel(self, error: BaseException) -> None:
        """Fails every pending send and recv with ``error`` (abort: none of them will run)."""
        pending, self._pending = self._pending, []
        for *_, work in pending:
            work._finish(None, error)

    def flush(self) -> None:
        """Issues the pending sends and recvs: sorted by (sender, receiver, tag), then issue order,
        so both sides of every pair issue their transfers in one order. A recv from any source
        cannot be sorted (its sender is known only once paired): it stays where it was issued, and
        the ops before and after it are sorted on their own."""
        pending, self._pending = self._pending, []
        segment: list[tuple] = []
        for op in pending + [None]:
            if op is not None and op[0][0] is not None:
                segment.append(op)
                continue
            for (src, dst, tag), _, group, kind, t, work in sorted(segment, key=lambda p: (p[0], p[1])):
                STREAM.submit(work, functools.partial(_transfer, group, kind, t, src, dst, tag, work),
                              async_op=True)
            segment = []
            if op is not None:
                (_, dst, tag), _, group, kind, t, work = op
                STREAM.submit(work, functools.partial(_recv_any, group, t, tag, work), async_op=True)


def _counter(src: int, dst: int, tag: int) -> str:
    return f"tpudist/p2p/{src}->{dst}/{tag}"  # group ranks: the group's store is its own


def _announce(group: Any, src: int, dst: int, tag: int) -> None:
    group._store.add(_counter(src, dst, tag), 1)  # noqa: SLF001


def _received(group: Any) -> dict[tuple[int, int], int]:
    """Per (sender group rank, tag): how many recvs of this rank's group have been paired with it."""
    counts = getattr(group, "_p2p_received", None)
    if counts is None:
        counts = group._p2p_received = {}  # noqa: SLF001
    return counts


# Pairing polls the store: first quickly (a sender that is already there), then at most every 20 ms.
_POLL_FIRST_S, _POLL_MAX_S = 0.0005, 0.02


def _recv_any(group: Any, t: torch.Tensor, tag: int, work: "DeferredWork"):
    """Finds a rank that sent this rank a message with ``tag`` not yet received, then receives it."""
    from tpudist.process_group.work import CollectiveTimeout

    me, received = group.rank(), _received(group)
    peers = [r for r in range(group.size()) if r != me]
    deadline = time.monotonic() + group._timeout.total_seconds()  # noqa: SLF001
    pause = _POLL_FIRST_S
    while True:
        for peer in peers:  # the lowest group rank with a pending send wins
            if group._store.add(_counter(peer, me, tag), 0) > received.get((peer, tag), 0):  # noqa: SLF001
                work.source = peer
                return _transfer(group, "recv", t, group.global_ranks[peer], group.global_ranks[me],
                                 tag, work)
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{group._describe('recv from any source')}: no rank of the group sent rank {me} a "  # noqa: SLF001
                f"message with tag={tag} within the group timeout of "
                f"{group._timeout.total_seconds():.0f}s")  # noqa: SLF001
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _transfer(group: Any, kind: str, t: torch.Tensor, src: int, dst: int, tag: int = 0,
              work: Any = None):
    if kind == "recv":  # counted before it runs: the sender's counter already includes it
        peer = group.global_ranks.index(src)
        received = _received(group)
        received[(peer, tag)] = received.get((peer, tag), 0) + 1
    pair = (min(src, dst), max(src, dst))
    unit = tz.byte_unit(tz.nbytes(t))
    block = tz.raw(t, unit) if kind == "send" else np.zeros(tz.nbytes(t) // unit.itemsize, unit)
    key = ProgramKey("permute", tuple(block.shape), block.dtype.name, pair,
                     static=((pair.index(src), pair.index(dst)),))
    out = group._run_program(kind, key, block)  # noqa: SLF001
    if kind == "recv":
        tz.write_raw(t, out.view(np.uint8))
    return [t]


P2P = PointToPoint()
