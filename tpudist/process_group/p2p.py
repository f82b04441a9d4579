"""Point to point: a send or recv is a 2-device ``ppermute`` that both sides dispatch."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from tpudist.process_group import tensors as tz
from tpudist.process_group.checks import check_output, overlaps
from tpudist.process_group.programs import ProgramKey
from tpudist.process_group.work import STREAM, Work


class DeferredWork(Work):
    """A send or recv: it runs when waited on, or before the process's next collective."""

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        P2P.flush()
        return super().wait(timeout)

    def get_future(self) -> torch.futures.Future:
        P2P.flush()
        return super().get_future()


class PointToPoint:
    """Pending sends and recvs of this process, issued in one global order.

    XLA has no eager send: a transfer is a 2-device ``ppermute`` that both sides must dispatch. The
    sides agree on the order without talking by sorting by (sender, receiver, tag), then issue
    order; ``batch_isend_irecv`` with sends both ways between two ranks therefore cannot deadlock.
    """

    def __init__(self) -> None:
        self._pending: list[tuple] = []
        self._seq = 0

    def post(self, group: Any, kind: str, t: torch.Tensor, peer: int, tag: int) -> Work:
        if peer == group.rank():
            raise ValueError(f"{kind}: rank {peer} cannot {kind} to itself; use a copy")
        if kind == "recv":
            check_output("recv", "tensor", t)
        me, other = group.global_ranks[group.rank()], group.global_ranks[peer]
        src, dst = (me, other) if kind == "send" else (other, me)
        work = DeferredWork(f"{kind} {src}->{dst} (tag {tag}) of {tuple(t.shape)} {t.dtype}",
                             group._timeout)  # noqa: SLF001
        self._check_disjoint(kind, t, src, dst)
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

    def cancel(self, error: BaseException) -> None:
        """Fails every pending send and recv with ``error`` (abort: none of them will run)."""
        pending, self._pending = self._pending, []
        for *_, work in pending:
            work._finish(None, error)

    def flush(self) -> None:
        pending, self._pending = sorted(self._pending, key=lambda p: (p[0], p[1])), []
        for (src, dst, _), _, group, kind, t, work in pending:
            STREAM.submit(work, functools.partial(_transfer, group, kind, t, src, dst), async_op=True)


def _transfer(group: Any, kind: str, t: torch.Tensor, src: int, dst: int):
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
