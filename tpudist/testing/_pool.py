"""A pool of rank processes that stays up across test cases.

Each rank is a process in its own session, so a hang or a crash is ended by PID (the whole process
group of the rank, children included) and never outlives the pool. A rank is forked from a preload
server (one per pytest process and import-time environment, see :class:`_PreloadServer`) that has
imported torch, JAX and tpudist's backend once: those imports cost a fresh interpreter 6-10 s of
CPU per rank. ``TPUDIST_POOL_START=fresh`` starts every rank as ``python -m
tpudist.testing._worker`` instead, as does a server that fails to start. Booting the process group
is paid once per pool.
"""

from __future__ import annotations

import atexit
import collections
import os
import pickle
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, Callable, NamedTuple

_DEFAULT_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 120.0


class RankError(RuntimeError):
    """A function raised on one or more ranks; the message holds each rank's traceback."""

    def __init__(self, failures: dict[int, str], results: dict[int, Any] | None = None):
        self.failures = failures
        self.results = results or {}  # what the ranks that did not fail returned
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"ranks {sorted(failures)} raised:\n{text}")


# What tpudist reads once, when it is imported: an in-process pool cannot set these for its functions.
_READ_AT_IMPORT = ("TPUDIST_CPP_FASTPATH", "TPUDIST_CPP_FASTPATH_DIR", "TPUDIST_CPP_HOOKS", "TPUDIST_CPP_HOOKS_DIR")


class PoolUnsupported(RuntimeError):
    """This pool cannot start where ranks run in the calling process (``TPUDIST_POOL_START=inprocess``)."""


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


class RankPeak(NamedTuple):
    """The peak resident memory of one rank process, read as its pool closed it."""

    bytes: int
    pid: int
    world_size: int
    during: str  # the test that was running (PYTEST_CURRENT_TEST), if any


_RANK_PEAKS: list[RankPeak] = []


def rank_peaks() -> list[RankPeak]:
    """Peak resident memory (Linux VmHWM) of every rank this process's pools have closed, in closing order."""
    return list(_RANK_PEAKS)


def _peak_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # gone already, or no /proc (not Linux)
        pass
    return None


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
        self._procs: list[subprocess.Popen | _ForkedRank] = []
        self._conns: list[Connection] = []
        self.started_by: str | None = None  # "fork" (from a preload server) or "fresh", once started

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
        if _start_mode() == "inprocess":
            self._start_here()
            return
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        master_port = free_port()
        try:
            envs = [self._rank_env(rank, master_port, listener.address[1], authkey)
                    for rank in range(self.world_size)]
            server = _preload_server(envs[0])
            self.started_by = "fresh" if server is None else "fork"
            starts[self.started_by] += 1
            for env in envs:
                self._procs.append(_start_fresh(env) if server is None else server.fork(env))
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

    def _start_here(self) -> None:
        """Where one process holds the accelerator (a TPU VM's chip: a second process cannot open it, and its
        sandbox may allow no TCP socket), a pool of one rank without a process group runs its functions in
        the calling process; every other pool is refused."""
        once = sorted(k for k in _READ_AT_IMPORT if k in self.env and self.env[k] != os.environ.get(k))
        if once:
            raise PoolUnsupported(
                f"RankPool(env={{{', '.join(f'{k!r}: {self.env[k]!r}' for k in once)}}}) needs a process of its own: "
                f"tpudist reads {', '.join(once)} once, when it is imported, so TPUDIST_POOL_START=inprocess cannot "
                "apply it to the calling process; run this test where processes can start (unset TPUDIST_POOL_START)")
        if self.world_size != 1 or self.backend is not None:
            raise PoolUnsupported(
                f"RankPool(world_size={self.world_size}, backend={self.backend!r}) needs rank processes, but "
                "TPUDIST_POOL_START=inprocess runs functions in the calling process: only world_size=1 with "
                "backend=None can run there; run this test where processes can start (unset TPUDIST_POOL_START)")
        self._procs = [_HereRank()]
        self.started_by = "inprocess"
        starts["inprocess"] += 1

    def _run_here(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        """``fn`` in this process under the pool's environment (variables set for the call, the device's
        eager mode from ``TPUDIST_EAGER_MODE``); the result goes through pickle as a rank's would."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        mode = _set_eager_mode(self.env.get("TPUDIST_EAGER_MODE"))
        try:
            return [pickle.loads(pickle.dumps(fn(*args, **kwargs)))]
        except BaseException:  # noqa: BLE001 - reported as a rank's failure, as a rank process would
            raise RankError({0: traceback.format_exc()}) from None
        finally:
            _set_eager_mode(mode)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

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
        if self.started_by == "inprocess":  # nothing to end: the "rank" is this process
            self._procs, self._conns = [], []
            return
        during = os.environ.get("PYTEST_CURRENT_TEST", "")
        for proc in self._procs:
            peak = _peak_bytes(proc.pid)
            if peak is not None:
                _RANK_PEAKS.append(RankPeak(peak, proc.pid, self.world_size, during))
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
        if self.started_by == "inprocess":
            return self._run_here(fn, args, kwargs)
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
                    results[rank] = ("err", f"rank {rank} died (exit code {_exit_code(self._procs[rank])})")
        failures = {r: v for r, (status, v) in results.items() if status == "err"}
        if failures:
            # A failed collective can leave communicators poisoned: the next run starts afresh.
            self.close(graceful=False)
            raise RankError(failures, {r: v for r, (status, v) in results.items() if status == "ok"})
        return [results[r][1] for r in range(self.world_size)]


class _HereRank:
    """The "process" of an in-process pool: always alive (``alive`` polls it); ``close`` never kills it, it is
    this process."""

    def poll(self) -> None:
        return None


def _start_mode() -> str:
    return os.environ.get("TPUDIST_POOL_START", "fork")


def _set_eager_mode(mode: str | None) -> str | None:
    """Sets the tpu device's eager mode (when the device is installed and ``mode`` given); returns the old one."""
    tpu = getattr(sys.modules.get("torch"), "tpu", None)
    if mode is None or tpu is None or not hasattr(tpu, "set_eager_mode"):
        return None
    previous = tpu.get_eager_mode()
    tpu.set_eager_mode(mode)
    return previous


def _exit_code(proc: subprocess.Popen | _ForkedRank) -> int | None:
    """The exit code of a rank whose connection closed: it is ending, give it a moment."""
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def _start_fresh(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tpudist.testing._worker"], env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL)


def _kill_session(proc: subprocess.Popen | _ForkedRank) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # a forked rank that has not called setsid() yet
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not time out
        pass


# -- preloaded starts ------------------------------------------------------------------------------
# Variables a rank may have other values of than its preload server: set in the forked rank before
# its first function runs. The rank's own variables, and tpudist's and XLA's flags unless the
# server's imports read them (XLA reads XLA_FLAGS when JAX creates its backend, in the rank; checked:
# XLA_FLAGS set after `import jax` still sets the CPU device count). Any other difference, e.g. a
# JAX_* or TORCH_DISTRIBUTED_DEBUG (read by `import torch.distributed`) or OMP_NUM_THREADS (read
# when libgomp loads) value, gets a server of its own.
_RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                             "MASTER_PORT", "TPUDIST_POOL_PORT", "TPUDIST_POOL_KEY", "PYTEST_CURRENT_TEST"})
_MAX_IDLE_SERVERS = 2  # each holds torch and JAX (~0.5 GB); one with live ranks is never ended
_servers: dict[frozenset, _PreloadServer | None] = {}  # by environment; None: failed to start
_read_at_import: frozenset[str] | None = None  # what the servers' imports read, once one has started
_servers_lock = threading.Lock()
starts: collections.Counter = collections.Counter()  # "fork" / "fresh": how pools started their ranks


def _late(name: str) -> bool:
    if name in _RANK_VARIABLES:
        return True
    candidate = name.startswith("TPUDIST_") or name == "XLA_FLAGS"
    return candidate and (_read_at_import is None or name not in _read_at_import)


def _preload_server(env: dict[str, str]) -> _PreloadServer | None:
    """The server whose imports saw what ``env`` would have shown them (started if need be), or
    None: start ranks fresh (``TPUDIST_POOL_START=fresh``, or that server failed to start)."""
    global _read_at_import
    if _start_mode() == "fresh":
        return None
    with _servers_lock:
        while True:
            key = frozenset((k, v) for k, v in env.items() if not _late(k))
            server = _servers.pop(key, None) if key in _servers else _start_server(dict(key))
            if server is not None and server.exit_code is not None:  # killed from outside
                server = _start_server(dict(key))
            _servers[key] = server  # most recently used last
            if server is None or _read_at_import is not None:
                break
            _read_at_import = server.read_at_import  # then the key may be finer: look again
        _end_idle_servers()
        return server


def _start_server(env: dict[str, str]) -> _PreloadServer | None:
    try:
        return _PreloadServer(env)
    except (OSError, RuntimeError) as e:
        warnings.warn(f"tpudist.testing: the rank preload server did not start ({e}); ranks of pools "
                      "with this environment start as fresh interpreters", stacklevel=4)
        return None


def _end_idle_servers() -> None:
    idle = [key for key, server in _servers.items() if server is not None and not server.busy]
    for key in idle[:max(0, len(idle) - _MAX_IDLE_SERVERS)]:
        _servers.pop(key).close()


@atexit.register
def _end_servers() -> None:
    for server in _servers.values():
        if server is not None:
            server.close()
    _servers.clear()


class _PreloadServer:
    """``python -m tpudist.testing._worker --preload``, started with ``env``: it imports what every
    rank imports, then forks ranks on request (see ``tpudist.testing._worker.serve_preloaded``)."""

    def __init__(self, env: dict[str, str]):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tpudist.testing._worker", "--preload", str(theirs.fileno())],
                env=env, pass_fds=[theirs.fileno()], start_new_session=True, stdin=subprocess.DEVNULL)
        self._ranks: list[_ForkedRank] = []
        self._owner = os.getpid()
        self._lock = threading.Lock()  # one request and its answer at a time
        try:
            kind, value = self._receive(_START_TIMEOUT_S)
            if kind != "ready":
                raise RuntimeError(f"its imports failed:\n{value}")
        except BaseException:
            self.close()
            raise
        self.read_at_import = frozenset(value)

    @property
    def exit_code(self) -> int | None:
        return self._proc.poll()

    @property
    def busy(self) -> bool:
        self._ranks = [rank for rank in self._ranks if rank.poll() is None]
        return bool(self._ranks)

    def fork(self, env: dict[str, str]) -> _ForkedRank:
        """A new rank with ``env``, in the current directory, writing to this process's stdout and
        stderr (so pytest captures it with the test that started it)."""
        if os.getpid() != self._owner:
            raise RuntimeError("a preload server serves the process that started it only")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs, self._lock:
            socket.send_fds(self._sock, [pickle.dumps((env, os.getcwd()))], [theirs.fileno(), 1, 2])
            kind, pid = self._receive(_START_TIMEOUT_S)
        rank = _ForkedRank(pid, ours)
        self._ranks.append(rank)
        return rank

    def _receive(self, timeout: float) -> tuple[str, Any]:
        from tpudist.testing._worker import MAX_MESSAGE  # not at import: `-m` runs it as __main__

        self._sock.settimeout(timeout)
        try:
            message = self._sock.recv(MAX_MESSAGE)
        except socket.timeout:
            raise RuntimeError(f"the preload server (pid {self._proc.pid}) did not answer within "
                               f"{timeout}s") from None
        if not message:
            raise RuntimeError(f"the preload server (pid {self._proc.pid}) exited with code "
                               f"{self._proc.wait()}")
        return pickle.loads(message)

    def close(self) -> None:
        self._sock.close()
        _kill_session(self._proc)


class _ForkedRank:
    """A rank forked by a preload server, with the part of ``subprocess.Popen`` that RankPool uses.

    The server reports the rank's wait status on ``status`` when it ends. If the server itself has
    gone, the rank (no longer anyone's child here) is alive as long as its PID is.
    """

    def __init__(self, pid: int, status: socket.socket):
        self.pid = pid
        self.returncode: int | None = None
        self._status: socket.socket | None = status

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._status is None:
                self._probe_orphan()
            elif select.select([self._status], [], [], 0)[0]:
                self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            if self._status is not None:
                select.select([self._status], [], [], left)
            else:
                time.sleep(0.05 if left is None else min(0.05, left))
        return self.returncode

    def _read_status(self) -> None:
        from tpudist.testing._worker import STATUS

        data = self._status.recv(STATUS.size)
        self._status.close()
        self._status = None
        if len(data) == STATUS.size:
            self.returncode = os.waitstatus_to_exitcode(STATUS.unpack(data)[0])
        else:
            self._probe_orphan()

    def _probe_orphan(self) -> None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self.returncode = -signal.SIGKILL  # unknown; it is gone


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, backend: str | None = "tpu",
              topology: str | None = None, env: dict[str, str] | None = None,
              timeout: float = _DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Starts ``world_size`` fresh ranks, runs ``fn`` once on each, and ends them."""
    with RankPool(world_size, backend=backend, topology=topology, env=env, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)
