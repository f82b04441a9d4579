"""Works and the per-process communication stream.

Collectives must run in the same order on every rank, so all of a process's collectives go through
one FIFO stream. A synchronous call with nothing queued runs inline (no thread hand-off on the
latency path); an ``async_op=True`` call is queued and runs on the stream's thread while the caller
goes on, so communication overlaps computation for real.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or did not complete; the message names the op, group and ranks."""


class CollectiveMismatch(CollectiveError, ValueError):
    """Ranks of a group issued different collectives (op, shape, dtype or reduce op)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout."""


class Work(dist._Work):  # noqa: SLF001 - the documented way to return works from Python groups
    """The handle of one collective: ``wait()`` returns when its outputs hold the result.

    Most collectives run inline and are finished before their caller sees the work, so the event
    a waiter blocks on and the torch future are made only when asked for (a sync all_reduce paid
    ~10 us of its ~50 us of Python for them).
    """

    __slots__ = ("_description", "_timeout", "_finished", "_result", "_exception", "_event",
                 "_future", "_finishing")

    def __init__(self, description: str, timeout: timedelta):
        super().__init__()
        self._description = description
        self._timeout = timeout
        self._finished = False
        self._result: Any = None
        self._exception: BaseException | None = None
        self._event: threading.Event | None = None
        self._future: torch.futures.Future | None = None
        self._finishing = threading.Lock()

    # -- completion (called by the stream, or by abort before the stream gets there) --------------
    def finish(self, result: Any, exception: BaseException | None) -> None:
        with self._finishing:  # the first outcome stands: abort() may have failed this work already
            if self._finished:
                return
            self._result, self._exception = result, exception
            self._finished = True
            event, future = self._event, self._future
        if future is not None:
            _complete(future, result, exception)
        if event is not None:
            event.set()  # last: whoever wait()s may read the future at once

    # -- the c10d Work interface ------------------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self._finished:
            with self._finishing:
                if not self._finished and self._event is None:
                    self._event = threading.Event()
                event = self._event
            limit = timeout if timeout.total_seconds() > 0 else self._timeout
            if event is not None and not event.wait(limit.total_seconds()):
                raise CollectiveTimeout(f"{self._description} did not complete within the timeout of "
                                        f"{limit.total_seconds():g}s (Timed out waiting: a peer that "
                                        "never reached it, or is still in an earlier collective)"
                                        f"{STREAM.stuck_detail()}")
        if self._exception is not None:
            raise self._exception
        return True

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._exception is None

    def exception(self):
        return self._exception

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        with self._finishing:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._finished:
                    _complete(self._future, self._result, self._exception)
            return self._future


def _complete(future: torch.futures.Future, result: Any, exception: BaseException | None) -> None:
    if exception is None:
        future.set_result(result)
    else:
        future.set_exception(exception)


class CommStream:
    """Runs a process's collectives one at a time, in issue order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._running: set[Work] = set()  # started, not finished (inline or on the thread)
        self._draining = 0  # threads waiting in drain(), the one waiter on _idle a finished work wakes
        self._thread: threading.Thread | None = None
        # Where collectives cannot be cancelled (a TPU program): how long drain() waits for a running
        # one before it gives up, and what a timeout tells the user. None/"": wait (XLA:CPU ends a
        # stuck collective at its collective timeout).
        self.drain_limit_s: float | None = None
        self.stuck_hint = ""
        # The program running now, where collectives cannot be cancelled: (what it is, the global ranks
        # that did not reach it, found through the store after a timeout). Set by the group around a run.
        self.running: tuple[str, Callable[[], list[int]]] | None = None

    def set_uncancellable(self, drain_limit_s: float | None) -> None:
        """The runtime's TPU world: a collective inside XLA runs until its peers arrive, so drain()
        (destroy_process_group) waits at most ``drain_limit_s`` and a timeout says to restart. None
        when the world ends."""
        self.drain_limit_s = drain_limit_s
        self.stuck_hint = "" if drain_limit_s is None else (
            ". On a TPU a program cannot be cancelled: this process's chip stays inside it until the "
            "missing ranks arrive or the process exits, so no later collective can run. Exit the "
            "process and restart the job (torchrun --max-restarts restarts every rank)")

    def stuck_detail(self) -> str:
        """For a timeout where collectives cannot be cancelled: which program is stuck, the ranks that never
        reached it (each timed-out rank reports through the store; the ones that do not are named), and
        what to do. Empty where XLA ends a stuck collective itself (CPU)."""
        if self.drain_limit_s is None:
            return ""
        running = self.running
        if running is None:
            return self.stuck_hint
        what, absent = running
        return f"; {what} is waiting inside XLA for ranks {absent()}, which never reached it{self.stuck_hint}"

    def submit(self, work: Work, task: Callable[[], Any], *, async_op: bool) -> Work:
        """Queues ``task`` as ``work``, or runs it in the caller's thread: a synchronous call with
        nothing queued, and any call made on the stream's own thread. That is a callback of a
        finished work's future (``Work._finish`` completes it there), as DDP's comm hooks chain them:
        PowerSGD's callback all_reduces and waits on the result. Queued, that collective would wait
        for the thread that waits for it; run at once, it runs right after the work whose callback
        issued it, on every rank, whatever the caller's threads queued meanwhile."""
        with self._lock:
            inline = (not async_op and self._pending == 0) or threading.current_thread() is self._thread
            self._pending += 1
            if inline:
                self._running.add(work)
            else:
                self._ensure_thread()
                self._queue.put((work, task))
        if inline:
            self._run(work, task, started=True)
        return work

    def run_now(self, work: Work, fn: Callable[..., Any], *args: Any) -> Work | None:
        """Runs ``fn(*args)`` as ``work`` in the caller's thread if nothing is queued, without a
        closure or a queue entry (the flat path of small collectives, ``ProcessGroupTPU.allreduce``);
        None, and nothing ran, if something is queued."""
        with self._lock:
            if self._pending:
                return None
            self._pending = 1
            self._running.add(work)
        self._run(work, fn, *args, started=True)
        return work

    def drain(self) -> None:
        """Blocks until every queued collective has run; where collectives cannot be cancelled, at most
        ``drain_limit_s`` (then CollectiveTimeout: destroy_process_group must not wait forever)."""
        limit = self.drain_limit_s
        with self._idle:
            self._draining += 1
            try:
                done = self._idle.wait_for(lambda: self._pending == 0, timeout=limit)
            finally:
                self._draining -= 1
            if done:
                return
            pending = self._pending
        raise CollectiveTimeout(
            f"destroy_process_group: {pending} collective(s) still queued or running after {limit:g}s, "
            f"one of them inside XLA waiting for ranks that never arrived{self.stuck_hint}.")

    def busy(self) -> bool:
        """Whether a collective is queued or running (possibly blocked inside XLA)."""
        with self._lock:
            return self._pending > 0

    def abort(self, error: BaseException) -> bool:
        """Fails every queued collective with ``error`` and releases whoever waits on a running one.

        XLA cannot cancel a collective it is running: that call goes on until it completes or hits
        XLA's collective timeout, and its thread with it. Returns whether one is still running.
        """
        cancelled = []
        with self._idle:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    cancelled.append(item[0])
                    self._pending -= 1
            running = list(self._running)
            if self._thread is not None:  # it ends once its running collective (if any) returns
                self._queue.put(_STOP)
            self._idle.notify_all()
        for work in cancelled + running:
            work.finish(None, error)
        return bool(running)

    def stop(self) -> None:
        """Ends the stream's thread once it is idle (destroying the world); a later async collective
        starts a new one."""
        self.drain()
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._queue.put(_STOP)
        if thread is not None:
            thread.join()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="tpudist-comm", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                with self._lock:  # submit() queues under this lock: nothing can slip in behind
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            self._run(*item)
            del item  # an idle thread must not keep the last group (and its store) alive

    def _run(self, work: Work, task: Callable[..., Any], *args: Any, started: bool = False) -> None:
        if not started:
            with self._lock:
                self._running.add(work)
        try:
            result, error = task(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the work
            result, error = None, e
        with self._idle:
            self._pending -= 1
            self._running.discard(work)
            if self._draining:  # usually nobody waits: no wake-up to pay for per collective
                self._idle.notify_all()
        work.finish(result, error)


_STOP = object()  # ends the stream's thread


STREAM = CommStream()
