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
import torch.distributed as dist

from tpudist.process_group import device_arrays as da
from tpudist.process_group import device_collectives as dc
from tpudist.process_group import programs
from tpudist.process_group import tensors as tz
from tpudist.process_group.checks import check_output, overlaps
from tpudist.process_group.keys import ProgramKey
from tpudist.process_group.runtime import GLOO_LOOP
from tpudist.process_group.work import STREAM, CollectiveMismatch, Work


class DeferredWork(Work):
    """A send or recv: it runs when waited on, or before the process's next collective.

    ``source``: for a recv, the group rank it receives from (an any-source recv learns it when
    paired); ``_source_rank()`` is what ``dist.recv`` returns and ``Work._source_rank()`` reads.
    """

    source: int | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self._finished and not P2P.run_inline(self):
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
    signature: bytes = b""  # its fingerprint, which the pair's leader compares with the peer's op
    peer_signature: bytes | None = None  # the peer's, when the two differ: nothing runs, both raise
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
        if peer == group.rank:
            raise ValueError(f"{kind}: rank {peer} cannot {kind} to itself; use a copy")
        if kind == "recv":
            check_output("recv", "tensor", t)
        me = group.global_ranks[group.rank]
        other = None if peer is None else group.global_ranks[peer]
        src, dst = (me, other) if kind == "send" else (other, me)
        shown = "any" if src is None else src
        # the same words as the comm thread's own timeout (_timeout): whichever fires first
        work = DeferredWork(f"{group.describe('send/recv')}: {kind} {shown}->{dst} (tag {tag}) of "
                            f"{tuple(t.shape)} {t.dtype}", group.timeout)
        if kind == "recv":
            work.source = peer
        self._check_disjoint(kind, t, shown, dst)
        call = _device_call(kind, t) if _on_device(t) else None
        if kind == "send":  # before the transfer can block: an any-source receiver pairs on this
            _announce(group, group.rank, peer, tag)
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

    def run_inline(self, work: DeferredWork) -> bool:
        """Runs ``work``'s op in the caller's thread if the comm stream is idle; whether it did.

        A blocking ``send``/``recv`` is then one thread's work (a hand-off to the comm thread and
        back cost a small transfer ~0.1-0.3 ms on 2 busy cores). Only that op is taken out of the
        pending list: the others stay for the next flush, though serving this pair may run them
        already (their works finish when flushed). Not with a recv from any source pending (its
        place in the order is kept by the flush) nor on a group whose timeout is shorter than XLA's
        (its waiter must be able to give up: see Channel.enqueue)."""
        mine = [p for p in self._pending if p.work is work]
        if (len(mine) != 1 or not mine[0].group.inline
                or any(p.order[0] is None for p in self._pending)):
            return False
        (op,) = mine
        if STREAM.run_now(work, _run_until_done, op) is None:
            return False
        self._pending.remove(op)
        return True

    def idle(self) -> bool:
        """Whether no send or recv is pending (so a collective may run without flushing first)."""
        return not self._pending

    def cancel(self, error: BaseException) -> None:
        """Fails every pending send and recv with ``error`` (abort: none of them will run)."""
        pending, self._pending = self._pending, []
        for p in pending:
            if p.order[0] is not None:
                _pair_order(p).drop(p)
            p.work.finish(None, error)

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
    if group.size > 2:  # in a group of two, a recv from any source can only be from the other rank
        group.store.add(_counter(src, dst, tag), 1)


def _sent(group: Any, src: int, dst: int, tag: int) -> int:
    return group.store.add(_counter(src, dst, tag), 0)


def _received(group: Any) -> dict[tuple[int, int], int]:
    """Per (sender group rank, tag): how many recvs of this rank's group have been paired with it."""
    return group.p2p_received


# Pairing polls the store: first quickly (a sender that is already there), then at most every 20 ms.
_POLL_FIRST_S, _POLL_MAX_S = 0.0005, 0.02


def _recv_any(op: Pending):
    """Finds a rank that sent this rank a message with ``tag`` not yet received, then receives it."""
    from tpudist.process_group.work import CollectiveTimeout

    group, tag = op.group, op.order[2]
    me, received = group.rank, _received(group)
    peers = [r for r in range(group.size) if r != me]
    deadline = time.monotonic() + group.timeout.total_seconds()
    pause = _POLL_FIRST_S
    while True:
        for peer in peers:  # the lowest group rank with a pending send wins
            # in a group of two the sender is known (no counter: see _announce)
            if len(peers) == 1 or _sent(group, peer, me, tag) > received.get((peer, tag), 0):
                op.work.source = peer
                op.order = (group.global_ranks[peer], group.global_ranks[me], tag)
                _pair_order(op).add(op)
                return _run_until_done(op)
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{group.describe('recv from any source')}: no rank of the group sent rank {me} a "
                f"message with tag={tag} within the group timeout of "
                f"{group.timeout.total_seconds():.0f}s")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _transfer(op: Pending, src: int, dst: int, seq: int):
    kind, t, tag = op.kind, op.tensor, op.order[2]
    pair = (min(src, dst), max(src, dst))
    try:
        if op.peer_signature is not None and _either_on_device(op):
            raise _mismatch(op, pair)  # the leader found the two sides' ops differ: nothing runs
        if op.call is None:
            return _host_transfer(op, pair, src, dst)
        return _device_transfer(op, pair, src, dst, seq)
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
    out = group.run_program(kind, key, block)
    if kind == "recv":
        tz.write_raw(t, out.view(np.uint8))
    return [t]


# -- the order of a pair's transfers -------------------------------------------------------------------


class PairOrder:
    """Which transfer between two ranks of a group runs next: decided by the pair's lower rank,
    which also checks that the two sides' ops match.

    A transfer is a program both sides dispatch, so both must run the pair's transfers in one
    order. Sorting each side's pending ops is not enough: the sides flush different sets (a
    pipeline schedule posts a send, then waits for a recv; its peer waits for that recv first and
    posts its recv of the send only afterwards), and ranks running different transfers get a
    mismatch or a hang. So the follower (the higher rank) pushes every op it posts, with its
    fingerprint, onto the pair's "posted" queue in the group's store; the leader runs, among its
    own ops, the first (in flush order) that the follower has posted too, and pushes its choice onto
    the pair's "decided" queue, which the follower pops. Ops on one channel (sender, receiver, tag)
    match in posting order (c10d's rule), so an op is named by its channel and its index on it.

    The leader compares the two fingerprints before anything runs: ops that differ (element count
    and dtype of a tpu tensor, bytes of a cpu tensor, or the device type) fail on both sides with
    ``CollectiveMismatch`` and no data moves, so the transfer program itself needs no fingerprint
    exchange (one XLA collective per transfer instead of two, and no device-to-host read).
    """

    def __init__(self, group: Any, pair: tuple[int, int]):
        self.group, self.pair = group, pair
        self.leader = group.global_ranks[group.rank] == pair[0]
        self.ops: list[Pending] = []  # posted, not yet run, in posting order
        self.posted: dict[tuple, int] = {}  # this side's ops per channel
        self.peer_posted: dict[str, bytes] = {}  # the leader: the follower's ops not yet run, by name
        self.slot = 0  # transfers run on this pair: both sides count alike
        self.inbox: list[bytes] = []  # the follower: decisions a blocking wait received
        self.posted_q = StoreQueue(group, _queue(pair, "posted"))  # the follower's ops, for the leader
        self.decided_q = StoreQueue(group, _queue(pair, "decided"))  # the leader's choices, for the follower
        self.waits_on = self.posted_q if self.leader else self.decided_q  # what block() pops
        self.lock = threading.Lock()

    def add(self, op: Pending) -> None:
        """Registers a posted op (its channel known): the caller's thread, before it can run."""
        with self.lock:
            op.index = self.posted[op.order] = self.posted.get(op.order, 0) + 1
            self.ops.append(op)
        op.signature = _signature(op, self.pair)
        if op.kind == "recv":  # an any-source recv does not pair with a send another recv takes
            peer, tag = self.group.global_ranks.index(op.order[0]), op.order[2]
            received = _received(self.group)
            received[(peer, tag)] = received.get((peer, tag), 0) + 1
        if not self.leader:
            self.posted_q.push(op.name.encode() + b"|" + op.signature)
        _wake(self)

    def drop(self, op: Pending) -> None:
        with self.lock:
            if op in self.ops:
                self.ops.remove(op)

    def try_next(self) -> Pending | None:
        """The op to run next on this pair, as the leader decided; None if nothing is decided yet
        (never blocks: a rank waiting on one pair must still serve its other pairs)."""
        if self.leader:
            op = self._first_ready()
            if op is None:
                return None
            peer = self.peer_posted.pop(op.name)
            if peer != op.signature:
                op.peer_signature = peer
            self.decided_q.push(op.name.encode() + b"|" + (op.signature if peer != op.signature else b""))
        else:
            message = self._next_decided()
            if message is None:
                return None
            name, _, leader = message.partition(b"|")
            with self.lock:
                chosen = [op for op in self.ops if op.name == name.decode()]
            assert len(chosen) == 1, (name, [op.name for op in self.ops])
            op = chosen[0]
            if leader:
                op.peer_signature = leader
        self.slot += 1
        return op

    def _next_decided(self) -> bytes | None:
        """The follower: the leader's next decision on this pair, or None (wake-ups are skipped)."""
        while self.inbox:
            message = self.inbox.pop(0)
            if message:
                return message
        while True:
            message = self.decided_q.pop()
            if message is None or message:
                return message

    def block(self, seconds: float) -> None:
        """Waits (at most ``seconds``) for the peer's next message on this pair: the leader's
        decision (this rank follows) or a posted op (this rank leads); another thread of this
        process posting an op on another pair wakes it too (:func:`_wake`). Used instead of
        polling when this pair holds all of this rank's pending ops: the store hands the message
        over the moment it is pushed (polling with backoff added ~0.5-1 ms per transfer)."""
        if seconds <= 0:
            return
        message = self.waits_on.pop_waiting(seconds)
        if message is None:
            return
        if self.leader:
            self._take_posted(message)
        else:
            self.inbox.append(message)

    def has_news(self) -> bool:
        """Whether this side already holds what try_next needs (no store read would tell more)."""
        if self.leader:
            with self.lock:
                return any(op.name in self.peer_posted for op in self.ops)
        return any(self.inbox)

    def _first_ready(self) -> Pending | None:
        with self.lock:
            ops = sorted(self.ops, key=lambda p: (p.order, p.index))
        if not ops:
            return None
        if not any(op.name in self.peer_posted for op in ops):
            self._read_posted()
        for op in ops:
            if op.name in self.peer_posted:
                return op
        return None

    def _read_posted(self) -> None:
        while (message := self.posted_q.pop()) is not None:
            self._take_posted(message)

    def _take_posted(self, message: bytes) -> None:
        if message:  # not a wake-up
            name, _, signature = message.partition(b"|")
            self.peer_posted[name.decode()] = signature

    def run(self, op: Pending) -> None:
        try:
            op.result = _transfer(op, *op.order[:2], -self.slot)
        except Exception as e:  # noqa: BLE001 - kept for the op's own waiter
            op.error = e
        op.done = True
        self.drop(op)


class StoreQueue:
    """A FIFO of messages in the group's store with one reader (this process) and any writers.

    TCPStore has queues (``queue_push``/``queue_pop``: one round trip each, and a blocking pop that
    returns the moment a message is pushed). Stores without them (FileStore, HashStore) get
    numbered keys instead: a push takes a number from a counter and sets that key; the reader
    takes its keys in order. There ``pop_waiting`` returns at once, and the caller polls.
    """

    def __init__(self, group: Any, name: str):
        self.group, self.name = group, name
        self.read = 0  # numbered keys: how many this reader has taken

    @property
    def store(self) -> Any:
        return self.group.store

    def push(self, message: bytes) -> None:
        if _has_queues(self.group):
            self.store.queue_push(self.name, message)
        else:
            number = self.store.add(f"{self.name}/count", 1)
            self.store.set(f"{self.name}/{number}", message)

    def pop(self) -> bytes | None:
        """The next message, or None if there is none yet (never blocks)."""
        if _has_queues(self.group):
            if not self.store.queue_len(self.name):
                return None
            return self.store.queue_pop(self.name, False)
        key = f"{self.name}/{self.read + 1}"
        if not self.store.check([key]):  # not pushed, or its number taken and not yet set
            return None
        message = self.store.get(key)
        self.store.delete_key(key)
        self.read += 1
        return message

    def pop_waiting(self, seconds: float) -> bytes | None:
        """The next message, waiting at most ``seconds`` for it where the store can wait."""
        if not _has_queues(self.group):
            return self.pop()
        store = _blocking_store(self.group)
        store.set_timeout(timedelta(seconds=seconds))
        try:
            return store.queue_pop(self.name, True)
        except dist.DistStoreError:  # the time is up: the caller's deadline decides
            return None


def _has_queues(group: Any) -> bool:
    has = group.p2p_has_queues
    if has is None:
        try:
            group.store.queue_len("tpudist/p2p/probe")
            has = True
        except NotImplementedError:  # FileStore, HashStore: "queue support is not implemented"
            has = False
        group.p2p_has_queues = has
    return has


def _blocking_store(group: Any) -> Any:
    """A second connection to the group's store for :meth:`PairOrder.block` (its timeout is set
    per wait; the group's own connection keeps the group's)."""
    store = group.p2p_blocking_store
    if store is None:
        store = group.p2p_blocking_store = group.store.clone()
    return store


def _wake(posted_on: PairOrder) -> None:
    """An op was just posted on ``posted_on``: a thread of this process blocked on another pair
    must come back and serve it (an empty message on the queue it waits on)."""
    with _ORDERS_LOCK:
        blocked = _BLOCKED[0]
    if blocked is not None and blocked is not posted_on:
        blocked.waits_on.push(b"")


def _queue(pair: tuple[int, int], what: str) -> str:
    return f"tpudist/p2p/{what}/{pair[0]}-{pair[1]}"  # global ranks


def _key_of(op: Pending, pair: tuple[int, int]) -> ProgramKey:
    """The program key of ``op``'s transfer: a tpu tensor's elements in their dtype, a cpu
    tensor's raw bytes (see _host_transfer)."""
    src, dst = op.order[:2]
    if op.call is not None:
        return _device_key(op.kind, op.tensor, pair, src, dst)
    unit = tz.byte_unit(tz.nbytes(op.tensor))
    return ProgramKey("permute", (tz.nbytes(op.tensor) // unit.itemsize,), unit.name, pair,
                      static=((pair.index(src), pair.index(dst)),))


def _signature(op: Pending, pair: tuple[int, int]) -> bytes:
    """``op``'s fingerprint as the collectives' (op, element count, dtype, device type; then the
    group's code and the op's index on its channel), as hex bytes for the store's queues."""
    key = _key_of(op, pair)
    fp = da.fingerprint(key) if op.call is not None else programs.fingerprint(key)
    where = np.array([op.group.code, op.index], np.int32)
    return np.concatenate([fp, where]).tobytes().hex().encode()


def _either_on_device(op: Pending) -> bool:
    """Whether a mismatched op fails before any program: when a tpu tensor is on either side (its
    transfer has no check of its own). Two cpu tensors' programs check themselves, with the
    envelope or ``TPUDIST_DEBUG=DETAIL``, and give the errors they always gave."""
    return any(int(np.frombuffer(bytes.fromhex(sig.decode()), np.int32)[0]) & da.DEVICE_FLAG
               for sig in (op.signature, op.peer_signature))


def _mismatch(op: Pending, pair: tuple[int, int]) -> CollectiveMismatch:
    """The error both sides raise when their ops differ, in the collectives' words."""
    mine = np.frombuffer(bytes.fromhex(op.signature.decode()), np.int32)
    peer = np.frombuffer(bytes.fromhex(op.peer_signature.decode()), np.int32)
    fps = [mine, peer] if op.group.global_ranks[op.group.rank] == pair[0] else [peer, mine]
    return op.group.calls_differ(op.kind, pair, fps)


# Waiting for a pair's next transfer: a short first pause (a ping-pong's peer posts within ~0.1 ms),
# then at most 2 ms (a pipeline's transfers are milliseconds apart).
_ORDER_POLL_FIRST_S, _ORDER_POLL_MAX_S = 0.00005, 0.002
_BLOCK_MAX_S = 3600.0  # a blocking wait ends at the group's deadline (or a message) within this
_ORDERS: dict[tuple[int, tuple[int, int]], PairOrder] = {}
_ORDERS_LOCK = threading.Lock()
_BLOCKED: list[PairOrder | None] = [None]  # the pair a thread of this process blocks on (_ORDERS_LOCK)
_SERVING = threading.Lock()  # one thread at a time decides and runs transfers (inline or comm thread)


def _pair_order(op: Pending) -> PairOrder:
    pair = (min(op.order[:2]), max(op.order[:2]))
    with _ORDERS_LOCK:
        order = _ORDERS.get((id(op.group), pair))
        if order is None or order.group is not op.group:
            order = _ORDERS[(id(op.group), pair)] = PairOrder(op.group, pair)
        return order


def _run_until_done(op: Pending) -> Any:
    """Runs decided transfers of every pair this rank is in until ``op`` has run (on the comm
    stream's thread, or inline in the caller's: one thread at a time). Serving every pair, not only
    ``op``'s, is what keeps ranks in several pairs (a pipeline of 4) from waiting on each other in a
    cycle: a rank blocks inside a transfer only as a leader that decided it, waiting for a higher
    rank, so the waits only ever go up in rank. When one pair holds all of this process's pending
    ops, the rank waits on the store for that pair's next message instead of polling."""
    timeout = op.group.timeout
    deadline, pause = time.monotonic() + timeout.total_seconds(), _ORDER_POLL_FIRST_S
    while not op.done:
        with _ORDERS_LOCK:  # one pair holds every pending op of this process: wait on it
            alone = [o for o in _ORDERS.values() if o.ops]
            blocked = alone[0] if len(alone) == 1 and _BLOCKED[0] is None and _has_queues(alone[0].group) \
                and not alone[0].has_news() else None
            if blocked is not None:
                _BLOCKED[0] = blocked
        if blocked is not None:  # returns at once if its message is there (one round trip, no poll)
            try:
                blocked.block(min(deadline - time.monotonic(), _BLOCK_MAX_S))
            finally:
                with _ORDERS_LOCK:
                    _BLOCKED[0] = None
        with _SERVING:
            with _ORDERS_LOCK:
                orders = [o for o in _ORDERS.values() if o.ops]
            ran = False
            for order in orders:
                nxt = order.try_next()
                if nxt is not None:
                    order.run(nxt)
                    ran = True
        if ran or op.done:
            pause = _ORDER_POLL_FIRST_S
            continue
        if time.monotonic() > deadline:
            _pair_order(op).drop(op)  # failed: it must not pair with a later op of the peer
            raise _timeout(op.group, f"{op.kind} {op.order[0]}->{op.order[1]} (tag {op.order[2]}) found "
                                     "no matching op on its peer", timeout)
        if blocked is not None:
            continue
        time.sleep(pause)
        pause = min(pause * 2, _ORDER_POLL_MAX_S)
    if op.error is not None:
        raise op.error
    return op.result


def _timeout(group: Any, what: str, timeout: timedelta) -> Exception:
    from tpudist.process_group.work import CollectiveTimeout

    return CollectiveTimeout(f"{group.describe('send/recv')}: {what} within the group timeout of "
                             f"{timeout.total_seconds():.0f}s (a rank that is hung elsewhere, took another "
                             "branch, or died)")


def _on_device(t: torch.Tensor) -> bool:
    return not t.is_cpu and t.device.type == "tpu"


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """:func:`overlaps` for CPU tensors; tpu tensors (whose ``data_ptr()`` is 0, an offset into
    their storage) share memory only within one storage."""
    a_dev, b_dev = _on_device(a), _on_device(b)
    if a_dev or b_dev:
        from tpudist.device import interop

        if not (a_dev and b_dev) or interop.buffer_of(a) is not interop.buffer_of(b):
            return False
    return overlaps(a, b)


# -- tpu tensors: the storages' jax.Arrays go into the 2-device program --------------------------------


def _device_key(kind: str, t: torch.Tensor, pair: tuple[int, int], src: int, dst: int) -> ProgramKey:
    """The permute of ``t``'s elements in their dtype (the dtype is in the fingerprint, unlike the
    CPU path's raw bytes): sender and receiver of different dtypes or sizes get a mismatch."""
    return ProgramKey("permute", (t.numel(),), dc.numeric_dtype(kind, t.dtype), pair,
                      static=((pair.index(src), pair.index(dst)),))


def _device_call(kind: str, t: torch.Tensor) -> da.DeviceCall:
    """The call's plan with a provisional key (the pair is known when it runs, a recv from any
    source's only once paired) and the storages' values now. A send reads ``t``; a recv reads
    nothing (its block is zeros) and writes the result into ``t``'s view of its storage."""
    key = _device_key(kind, t, (0, 1), 0, 1)
    if kind == "send":
        return da.prepare(key, 0, [t], [t.numel()], "flat", [])
    return da.prepare(key, 0, [], [], "flat", [(t, ("flat", 0, t.numel()))])


def _device_transfer(op: Pending, pair: tuple[int, int], src: int, dst: int, seq: int):
    """The transfer of a tpu tensor: its storage's array in, the receiver's new storage value out,
    as one program with no fingerprint exchange (PairOrder compared the two sides already).
    ``seq``: the pair's transfer number (negative: apart from the group's collective numbers),
    under which the ranks report a failure (``Channel.failure``)."""
    key = _device_key(op.kind, op.tensor, pair, src, dst)
    me = src if op.kind == "send" else dst
    call = da.DeviceCall(dataclasses.replace(op.call.plan, key=key, me=pair.index(me)), op.call.arrays,
                         op.call.buffers)
    GLOO_LOOP.idle(programs.loop_idle(key, False))  # the CPU path's policy for its data programs
    try:
        new_values = da.run_agreed(call)
    except Exception as e:  # XLA raises ValueError/JaxRuntimeError: make it a c10d-style error
        raise op.group.failure(op.kind, key.group, seq, e) from e
    if op.kind == "recv":
        da.write_back(call, new_values)
    return [op.tensor]


P2P = PointToPoint()
