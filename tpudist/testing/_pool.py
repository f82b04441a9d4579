"""A pool of rank processes that stays up across test cases.

Each rank is a ``python -m tpudist.testing._worker`` subprocess in its own session, so a hang or a
crash is ended by PID (the whole process group of the rank, children included) and never outlives
the pool. Start-up (importing torch and JAX, booting the process group) is paid once per pool.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, Callable

_DEFAULT_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 120.0


class RankError(RuntimeError):
    """A function raised on one or more ranks; the message holds each rank's traceback."""

    def __init__(self, failures: dict[int, str], results: dict[int, Any] | None = None):
        self.failures = failures
        self.results = results or {}  # what the ranks that did not fail returned
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"ranks {sorted(failures)} raised:\n{text}")


class RankTimeout(RuntimeError):
    """Some ranks did not answer within the timeout; the pool killed every rank.

    ``missing``: the ranks that did not answer; ``failures``: the traceback of each rank that raised
    before the timeout (a rank that fails often leaves its peers waiting in a collective).
    """

    def __init__(self, message: str, missing: list[int] | None = None,
                 failures: dict[int, str] | None = None):
        self.missing = list(missing or [])
        self.failures = dict(failures or {})
        text = "".join(f"\n--- rank {r} raised ---\n{tb}" for r, tb in sorted(self.failures.items()))
        super().__init__(message + text)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``world_size`` rank processes running functions on request.

    Args:
        world_size: number of ranks (emulated chips).
        backend: process group each rank initialises at start ("tpu", "gloo"), or None for none.
        topology: value of ``TPUDIST_TOPOLOGY`` in the ranks (e.g. "v5p:2x2x1").
        env: extra environment variables for the ranks.
        timeout: default seconds a ``run`` may take before every rank is killed.
    """

    def __init__(self, world_size: int, *, backend: str | None = "tpu", topology: str | None = None,
                 env: dict[str, str] | None = None, timeout: float = _DEFAULT_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.backend = backend
        self.topology = topology
        self.env = dict(env or {})
        self.timeout = timeout
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        master_port = free_port()
        try:
            for rank in range(self.world_size):
                env = self._rank_env(rank, master_port, listener.address[1], authkey)
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tpudist.testing._worker"], env=env,
                    start_new_session=True, stdin=subprocess.DEVNULL))
            conns: dict[int, Connection] = {}
            deadline = time.monotonic() + _START_TIMEOUT_S
            listener._listener._socket.settimeout(1.0)  # noqa: SLF001 - accept() must not block forever
            while len(conns) < self.world_size:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                    raise RankTimeout(self._start_failure(conns))
                try:
                    conn = listener.accept()
                except (socket.timeout, OSError):
                    continue
                conns[conn.recv()] = conn
            self._conns = [conns[r] for r in range(self.world_size)]
            self._conns and self._call_all(("setup", sys.path, self.backend), _START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _start_failure(self, conns: dict[int, Connection]) -> str:
        codes = {r: p.poll() for r, p in enumerate(self._procs)}
        return (f"rank processes did not start within {_START_TIMEOUT_S}s: connected={sorted(conns)}, "
                f"exit codes={codes}")

    def _rank_env(self, rank: int, master_port: int, pool_port: int, authkey: bytes) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size), "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
            "OMP_NUM_THREADS": "1",  # several ranks share 2 cores: see FACTS.md
            "TPUDIST_POOL_PORT": str(pool_port), "TPUDIST_POOL_KEY": authkey.hex(),
            "PYTHONUNBUFFERED": "1",
        })
        if self.topology is not None:
            env["TPUDIST_TOPOLOGY"] = self.topology
        env.update(self.env)
        return env

    def close(self, graceful: bool = True) -> None:
        """Asks ranks to exit (if ``graceful``), then kills what is left, by PID, with its children."""
        for conn in self._conns if graceful else ():
            try:
                conn.send_bytes(pickle.dumps(("exit",)))
            except OSError:
                pass
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for proc in self._procs if graceful else ():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            _kill_session(proc)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    # -- running ---------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order.

        ``fn`` must be importable by reference (a module-level function); results come back pickled
        by value (tensors included). Raises RankError if any
        rank raised, RankTimeout (after killing every rank) if any rank did not answer in time.
        """
        if getattr(fn, "__module__", None) == "__main__":
            raise ValueError(f"fn={fn.__qualname__} is defined in __main__, which rank processes cannot "
                             "import; define it in an importable module")
        self.start()
        return self._call_all(("run", fn, args, kwargs), self.timeout if timeout is None else timeout)

    def _call_all(self, message: tuple, timeout: float) -> list[Any]:
        payload = pickle.dumps(message)
        for conn in self._conns:
            conn.send_bytes(payload)
        results: dict[int, tuple[str, Any]] = {}
        pending = {conn: r for r, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                missing = sorted(pending.values())
                self.close(graceful=False)
                failed = {r: v for r, (status, v) in results.items() if status == "err"}
                raise RankTimeout(f"ranks {missing} did not finish {message[0]!r} within {timeout}s "
                                  f"(answered: {sorted(results)}); every rank was killed",
                                  missing, failed)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    results[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    results[rank] = ("err", f"rank {rank} died (exit code {self._procs[rank].poll()})")
        failures = {r: v for r, (status, v) in results.items() if status == "err"}
        if failures:
            # A failed collective can leave communicators poisoned: the next run starts afresh.
            self.close(graceful=False)
            raise RankError(failures, {r: v for r, (status, v) in results.items() if status == "ok"})
        return [results[r][1] for r in range(self.world_size)]


def _kill_session(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not time out
        pass


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, backend: str | None = "tpu",
              topology: str | None = None, env: dict[str, str] | None = None,
              timeout: float = _DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Starts ``world_size`` fresh ranks, runs ``fn`` once on each, and ends them."""
    with RankPool(world_size, backend=backend, topology=topology, env=env, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)
