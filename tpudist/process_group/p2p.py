"""Point to point: a send or recv is a 2-device ``ppermute`` that both sides dispatch.

A recv from any source (``recv``/``irecv`` without ``src``) is paired first, through the group's
c10d store: every send adds one to a counter ``(sender, receiver, tag)`` when it is posted, and
the receiver, whose recvs from each sender are counted too, waits for a sender whose counter has
passed what it already received, then runs the ordinary 2-device transfer with it.

Both sides of a pair of ranks must run their transfers in one order, and their flushes need not
hold the same ops (a pipeline schedule waits for different recvs on each side), so the order is
decided at run time by the pair's lower rank (:class:`PairOrder`), through the group's store.

A "tpu" device tensor travels as a device call (:mod:`~tpudist.process_group.device_arrays`): its
storage's ``jax.Array`` goes into the 2-device program and the receiver's storage takes the
program's output, with no host copy. Its key carries the element count and dtype (CPU tensors
travel as raw bytes), so a recv whose tensor differs from the send's in either raises
``CollectiveMismatch`` on both ranks, from the envelope's fingerprint exchange, before any data moves.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from tpudist.process_group import device_arrays as da
from tpudist.process_group import device_collectives as dc
from tpudist.process_group import tensors as tz
from tpudist.process_group.checks import check_output, overlaps
from tpudist.process_group.programs import ProgramKey
from tpudist.process_group.work import STREAM, CollectiveMismatch, Work


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


@dataclass(slots=True, eq=False)
class Pending:
    """A posted send or recv. ``call``: the device call of a tpu tensor (None for a CPU tensor),
    prepared when posted so that a send carries what its tensor held at the call."""

    order: tuple  # (sender, receiver, tag) in global ranks; sender None: a recv from any source
    seq: int
    group: Any
    kind: str
    tensor: torch.Tensor
    work: DeferredWork
    call: da.DeviceCall | None
    index: int = 0  # 1 + how many ops this side posted before it on its channel (sender, receiver, tag)
    done: bool = False
    result: Any = None
    error: BaseException | None = None

    @property
    def name(self) -> str:
        return f"{self.order[0]},{self.order[1]},{self.order[2]},{self.index}"


class PointToPoint:
    """Pending sends and recvs of this process, issued when waited on or before the next collective.

    XLA has no eager send: a transfer is a 2-device ``ppermute`` that both sides must dispatch. The
    order of each pair's transfers is agreed at run time (:class:`PairOrder`); ``batch_isend_irecv``
    with sends both ways between two ranks therefore cannot deadlock.
    """

    def __init__(self) -> None:
        self._pending: list[Pending] = []
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
        # the same words as the comm thread's own timeout (_timeout): whichever fires first
        work = DeferredWork(f"{group._describe('send/recv')}: {kind} {shown}->{dst} (tag {tag}) of "  # noqa: SLF001
                            f"{tuple(t.shape)} {t.dtype}", group._timeout)  # noqa: SLF001
        if kind == "recv":
            work.source = peer
        self._check_disjoint(kind, t, shown, dst)
        call = _device_call(kind, t) if _on_device(t) else None
        if kind == "send":  # before the transfer can block: an any-source receiver pairs on this
            _announce(group, group.rank(), peer, tag)
        self._seq += 1
        op = Pending((src, dst, tag), self._seq, group, kind, t, work, call)
        if src is not None:
            _pair_order(op).add(op)
        self._pending.append(op)
        return work

    def _check_disjoint(self, kind: str, t: torch.Tensor, src: int, dst: int) -> None:
        """A recv may not share memory with another pending send or recv: the batch runs in an order
        tpudist chooses, so the send would carry the old or the received bytes. Refusing one op
        refuses the whole batch (its other ops would otherwise run unpaired)."""
        for p in self._pending:
            (p_src, p_dst, _), p_kind, p_t = p.order, p.kind, p.tensor
            if "recv" in (kind, p_kind) and _shares_memory(t, p_t):
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
        for p in pending:
            if p.order[0] is not None:
                _pair_order(p).drop(p)
            p.work._finish(None, error)  # noqa: SLF001

    def flush(self) -> None:
        """Issues the pending sends and recvs: sorted by (sender, receiver, tag), then issue order,
        so that the pairs of a batch (a ring) are served in one global order; within a pair,
        :class:`PairOrder` decides which transfer runs next. A recv from any source
        cannot be sorted (its sender is known only once paired): it stays where it was issued, and
        the ops before and after it are sorted on their own."""
        pending, self._pending = self._pending, []
        segment: list[Pending] = []
        for op in pending + [None]:
            if op is not None and op.order[0] is not None:
                segment.append(op)
                continue
            for p in sorted(segment, key=lambda p: (p.order, p.seq)):
                STREAM.submit(p.work, functools.partial(_run_until_done, p), async_op=True)
            segment = []
            if op is not None:
                STREAM.submit(op.work, functools.partial(_recv_any, op), async_op=True)


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


def _recv_any(op: Pending):
    """Finds a rank that sent this rank a message with ``tag`` not yet received, then receives it."""
    from tpudist.process_group.work import CollectiveTimeout

    group, tag = op.group, op.order[2]
    me, received = group.rank(), _received(group)
    peers = [r for r in range(group.size()) if r != me]
    deadline = time.monotonic() + group._timeout.total_seconds()  # noqa: SLF001
    pause = _POLL_FIRST_S
    while True:
        for peer in peers:  # the lowest group rank with a pending send wins
            if group._store.add(_counter(peer, me, tag), 0) > received.get((peer, tag), 0):  # noqa: SLF001
                op.work.source = peer
                op.order = (group.global_ranks[peer], group.global_ranks[me], tag)
                _pair_order(op).add(op)
                return _run_until_done(op)
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{group._describe('recv from any source')}: no rank of the group sent rank {me} a "  # noqa: SLF001
                f"message with tag={tag} within the group timeout of "
                f"{group._timeout.total_seconds():.0f}s")  # noqa: SLF001
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _transfer(op: Pending, src: int, dst: int):
    group, kind, t, tag = op.group, op.kind, op.tensor, op.order[2]
    pair = (min(src, dst), max(src, dst))
    try:
        return (_host_transfer if op.call is None else _device_transfer)(op, pair, src, dst)
    except CollectiveMismatch as e:
        raise CollectiveMismatch(
            f"{kind} {src}->{dst} (tag {tag}) of {tuple(t.shape)} {t.dtype} on {t.device.type}: the sender's "
            "and the receiver's tensors differ (a tpu tensor's recv must match its send's element count "
            "and dtype, a cpu tensor's its size in bytes; both sides on one device type). "
            f"{e}") from e


def _host_transfer(op: Pending, pair: tuple[int, int], src: int, dst: int):
    group, kind, t = op.group, op.kind, op.tensor
    unit = tz.byte_unit(tz.nbytes(t))
    block = tz.raw(t, unit) if kind == "send" else np.zeros(tz.nbytes(t) // unit.itemsize, unit)
    key = ProgramKey("permute", tuple(block.shape), block.dtype.name, pair,
                     static=((pair.index(src), pair.index(dst)),))
    out = group._run_program(kind, key, block)  # noqa: SLF001
    if kind == "recv":
        tz.write_raw(t, out.view(np.uint8))
    return [t]


# -- the order of a pair's transfers -------------------------------------------------------------------


class PairOrder:
    """Which transfer between two ranks of a group runs next: decided by the pair's lower rank.

    A transfer is a program both sides dispatch, so both must run the pair's transfers in one
    order. Sorting each side's pending ops is not enough: the sides flush different sets (a
    pipeline schedule posts a send, then waits for a recv; its peer waits for that recv first and
    posts its recv of the send only afterwards), and ranks running different transfers get a
    mismatch or a hang. So the follower (the higher rank) announces every op it posts, per channel
    (sender, receiver, tag), in the group's store; the leader runs, among its own ops, the first
    (in flush order) that the follower has posted too, and writes its choice into the store's
    next slot, which the follower reads and deletes. Ops on one channel match in posting order
    (c10d's rule), so an op is named by its channel and its index on it.
    """

    def __init__(self, group: Any, pair: tuple[int, int]):
        self.group, self.pair = group, pair
        self.leader = group.global_ranks[group.rank()] == pair[0]
        self.ops: list[Pending] = []  # posted, not yet run, in posting order
        self.posted: dict[tuple, int] = {}  # this side's ops per channel
        self.seen: dict[tuple, int] = {}  # the leader: the follower's ops per channel, as last read
        self.slot = 0
        self.lock = threading.Lock()

    def add(self, op: Pending) -> None:
        """Registers a posted op (its channel known): the caller's thread, before it can run."""
        with self.lock:
            op.index = self.posted[op.order] = self.posted.get(op.order, 0) + 1
            self.ops.append(op)
        if op.kind == "recv":  # an any-source recv does not pair with a send another recv takes
            peer, tag = self.group.global_ranks.index(op.order[0]), op.order[2]
            received = _received(self.group)
            received[(peer, tag)] = received.get((peer, tag), 0) + 1
        if not self.leader:
            self.group._store.add(_posted_key(op.order), 1)  # noqa: SLF001

    def drop(self, op: Pending) -> None:
        with self.lock:
            if op in self.ops:
                self.ops.remove(op)

    def try_next(self) -> Pending | None:
        """The op to run next on this pair, as the leader decided; None if nothing is decided yet
        (never blocks: a rank waiting on one pair must still serve its other pairs)."""
        store, key = self.group._store, _slot_key(self.pair, self.slot)  # noqa: SLF001
        if self.leader:
            op = self._first_ready()
            if op is not None:
                store.set(key, op.name)
        elif store.check([key]):
            name = store.get(key).decode()
            store.delete_key(key)
            with self.lock:
                chosen = [op for op in self.ops if op.name == name]
            assert len(chosen) == 1, (name, [op.name for op in self.ops])
            op = chosen[0]
        else:
            return None
        if op is not None:
            self.slot += 1
        return op

    def _first_ready(self) -> Pending | None:
        with self.lock:
            ops = sorted(self.ops, key=lambda p: (p.order, p.index))
        for op in ops:
            if self.seen.get(op.order, 0) < op.index:
                self.seen[op.order] = self.group._store.add(_posted_key(op.order), 0)  # noqa: SLF001
            if self.seen[op.order] >= op.index:
                return op
        return None

    def run(self, op: Pending) -> None:
        try:
            op.result = _transfer(op, *op.order[:2])
        except Exception as e:  # noqa: BLE001 - kept for the op's own waiter
            op.error = e
        op.done = True
        self.drop(op)


# Waiting for a pair's next transfer: a short first pause (a ping-pong's peer posts within ~0.1 ms),
# then at most 2 ms (a pipeline's transfers are milliseconds apart).
_ORDER_POLL_FIRST_S, _ORDER_POLL_MAX_S = 0.00005, 0.002
_ORDERS: dict[tuple[int, tuple[int, int]], PairOrder] = {}
_ORDERS_LOCK = threading.Lock()


def _pair_order(op: Pending) -> PairOrder:
    pair = (min(op.order[:2]), max(op.order[:2]))
    with _ORDERS_LOCK:
        order = _ORDERS.get((id(op.group), pair))
        if order is None or order.group is not op.group:
            order = _ORDERS[(id(op.group), pair)] = PairOrder(op.group, pair)
        return order


def _run_until_done(op: Pending) -> Any:
    """Runs decided transfers of every pair this rank is in until ``op`` has run (the comm stream's
    thread only). Serving every pair, not only ``op``'s, is what keeps ranks in several pairs (a
    pipeline of 4) from waiting on each other in a cycle: a rank blocks inside a transfer only as
    a leader that decided it, waiting for a higher rank, so the waits only ever go up in rank."""
    timeout = op.group._timeout  # noqa: SLF001
    deadline, pause = time.monotonic() + timeout.total_seconds(), _ORDER_POLL_FIRST_S
    while not op.done:
        with _ORDERS_LOCK:
            orders = [o for o in _ORDERS.values() if o.ops]
        ran = False
        for order in orders:
            nxt = order.try_next()
            if nxt is not None:
                order.run(nxt)
                ran = True
        if ran:
            pause = _ORDER_POLL_FIRST_S
            continue
        if time.monotonic() > deadline:
            _pair_order(op).drop(op)  # failed: it must not pair with a later op of the peer
            raise _timeout(op.group, f"{op.kind} {op.order[0]}->{op.order[1]} (tag {op.order[2]}) found "
                                     "no matching op on its peer", timeout)
        time.sleep(pause)
        pause = min(pause * 2, _ORDER_POLL_MAX_S)
    if op.error is not None:
        raise op.error
    return op.result


def _posted_key(channel: tuple) -> str:
    return f"tpudist/p2p/posted/{channel[0]}->{channel[1]}/{channel[2]}"  # global ranks


def _slot_key(pair: tuple[int, int], slot: int) -> str:
    return f"tpudist/p2p/order/{pair[0]}-{pair[1]}/{slot}"


def _timeout(group: Any, what: str, timeout: timedelta) -> Exception:
    from tpudist.process_group.work import CollectiveTimeout

    return CollectiveTimeout(f"{group._describe('send/recv')}: {what} within the group timeout of "  # noqa: SLF001
                             f"{timeout.total_seconds():.0f}s (a rank that is hung elsewhere, took another "
                             "branch, or died)")


def _on_device(t: torch.Tensor) -> bool:
    return not t.is_cpu and t.device.type == "tpu"


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """:func:`overlaps` for CPU tensors; tpu tensors (whose ``data_ptr()`` is 0, an offset into
    their storage) share memory only within one storage."""
    a_dev, b_dev = _on_device(a), _on_device(b)
    if a_dev or b_dev:
        from tpudist.device import _storage

        if not (a_dev and b_dev) or _storage.buffer_of(a) is not _storage.buffer_of(b):
            return False
    return overlaps(a, b)


# -- tpu tensors: the storages' jax.Arrays go into the 2-device program --------------------------------


def _device_key(kind: str, t: torch.Tensor, pair: tuple[int, int], src: int, dst: int) -> ProgramKey:
    """The permute of ``t``'s elements in their dtype (the dtype is in the fingerprint, unlike the
    CPU path's raw bytes): sender and receiver of different dtypes or sizes get a mismatch."""
    return ProgramKey("permute", (t.numel(),), dc._numeric(kind, t.dtype), pair,  # noqa: SLF001
                      static=((pair.index(src), pair.index(dst)),))


def _device_call(kind: str, t: torch.Tensor) -> da.DeviceCall:
    """The call's plan with a provisional key (the pair is known when it runs, a recv from any
    source's only once paired) and the storages' values now. A send reads ``t``; a recv reads
    nothing (its block is zeros) and writes the result into ``t``'s view of its storage."""
    key = _device_key(kind, t, (0, 1), 0, 1)
    if kind == "send":
        return da.prepare(key, 0, [t], [t.numel()], "flat", [])
    return da.prepare(key, 0, [], [], "flat", [(t, ("flat", 0, t.numel()))])


def _device_transfer(op: Pending, pair: tuple[int, int], src: int, dst: int):
    key = _device_key(op.kind, op.tensor, pair, src, dst)
    me = src if op.kind == "send" else dst
    call = da.DeviceCall(dataclasses.replace(op.call.plan, key=key, me=pair.index(me)), op.call.arrays,
                         op.call.buffers)
    new_values = op.group._run_program(op.kind, key, call)  # noqa: SLF001
    if op.kind == "recv":
        da.write_back(call, new_values)
    return [op.tensor]


P2P = PointToPoint()
