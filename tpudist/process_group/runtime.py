"""The process-wide JAX runtime behind every "tpu" process group.

One runtime per process: the first "tpu" world group boots ``jax.distributed`` (coordinator address
agreed through the c10d store), later groups only build meshes over its devices. Destroying the
world group shuts it down, so a new world (of any size) can start in the same process.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from tpudist.process_group.checks import STUCK_GRACE_S
from tpudist.runtime import chip

_COORDINATOR_KEY = "tpudist/jax_coordinator"
# JAX's coordination service: its heartbeat decides how long survivors of a crashed peer live on,
# and its shutdown barrier how long a rank waits at destroy for peers still inside a collective.
# Neither may derive from a group's (possibly 1 s) collective timeout: a peer legitimately sits in a
# collective until XLA's collective timeout, and a heartbeat that short aborts healthy ranks
# (SIGABRT at shutdown, issue 12). The heartbeat is fixed; the shutdown barrier outlasts XLA's
# collective timeout plus the grace in which timed-out ranks name absentees.
_HEARTBEAT_S = 60
_MIN_SHUTDOWN_S = 60
_MIN_INIT_S = 30  # every rank must reach jax.distributed.initialize within this (or the group timeout)


class RuntimeStateError(RuntimeError):
    """The JAX runtime is in a state that does not allow the request."""


@dataclass(frozen=True, slots=True)
class Runtime:
    """The booted JAX multi-process runtime of this process."""

    platform: str
    process_id: int
    num_processes: int
    devices: tuple[Any, ...]  # jax devices, index = global torch rank
    topology: Any  # tpudist.mesh.Topology: the slice being run (or emulated); rank r is chip r
    # XLA's collective timeout in this process (set from the first world's timeout, read once by
    # XLA): a group with a shorter timeout enforces its own from the caller's side.
    collective_timeout_s: float = float("inf")

    def device(self, global_rank: int) -> Any:
        return self.devices[global_rank]

    @property
    def local_device(self) -> Any:
        return self.devices[self.process_id]


_lock = threading.Lock()
_runtime: Runtime | None = None
_owner_id: int | None = None  # id() of the world group that booted the runtime
_abandoned = False  # the world was aborted while a collective was inside XLA: see abandon()
_on_teardown: list[Callable[[], None]] = []  # see on_teardown()


def current() -> Runtime:
    if _runtime is None:
        raise RuntimeStateError("no tpu process group is initialised: call "
                                'torch.distributed.init_process_group("tpu") first')
    return _runtime


def is_booted() -> bool:
    """Whether a runtime runs that new groups can join (an abandoned one cannot: see abandon())."""
    return _runtime is not None and not _abandoned


def _platform() -> str:
    """"cpu" emulates chips with processes; "tpu" drives real chips (TPUDIST_PLATFORM overrides)."""
    from tpudist.mesh import tpu_env

    return tpu_env.platform()


platform = _platform  # the public name, for the packages above (the trainer's --device auto)


def topology_for(world_size: int) -> Any:
    """The slice named by ``TPUDIST_TOPOLOGY``, or the smallest v5p slice holding the world.

    Without ``TPUDIST_TOPOLOGY``, a world of a size no slice has (3 ranks: 2x2x1; 5: 2x2x2) runs
    on the first chips of the smallest slice that holds it, rank r on chip r."""
    from tpudist.mesh import Topology
    from tpudist.mesh.tpu_env import TOPOLOGY_ENV

    text = os.environ.get(TOPOLOGY_ENV)
    if not text:
        return Topology.smallest_for(world_size)
    topology = Topology.parse(text)
    if topology.num_chips != world_size:
        raise ValueError(
            f"{TOPOLOGY_ENV}={text} has {topology.num_chips} chips but the world has "
            f"world_size={world_size} ranks: tpudist runs one rank per chip. Launch "
            f"{topology.num_chips} ranks, or unset {TOPOLOGY_ENV} to use the smallest slice that fits.")
    return topology


_TIMEOUT_FLAG = "xla_cpu_collective_timeout_seconds"
_XLA_DEFAULT_COLLECTIVE_TIMEOUT_S = 30 * 60  # XLA's own default when the flag is not set


def _collective_timeout_flag(timeout: timedelta) -> int:
    """Sets XLA's collective timeout to the world's timeout; returns the one in force.

    XLA:CPU ignores the c10d timeout unless this flag is set before the backend starts (FACTS.md),
    and it reads the flag once per process: a later world keeps the first one's value."""
    seconds = max(1, int(timeout.total_seconds()))
    flags = os.environ.get("XLA_FLAGS", "")
    if _TIMEOUT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{_TIMEOUT_FLAG}={seconds}".strip()
        return seconds
    match = re.search(rf"--{_TIMEOUT_FLAG}=(\d+)", flags)
    return int(match.group(1)) if match else _XLA_DEFAULT_COLLECTIVE_TIMEOUT_S


def coordination_timeouts(timeout: timedelta, collective_timeout_s: int) -> dict[str, int]:
    """``jax.distributed.initialize``'s timeouts for a world of group ``timeout`` (see above)."""
    return {
        "initialization_timeout": max(_MIN_INIT_S, int(timeout.total_seconds())),
        "heartbeat_timeout_seconds": _HEARTBEAT_S,
        "shutdown_timeout_seconds": max(_MIN_SHUTDOWN_S, collective_timeout_s + 2 * int(STUCK_GRACE_S) + 10),
    }


def _coordinator_host() -> str:
    # Bind to the rendezvous host, never to all interfaces.
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# glibc returns every freed block above its mmap threshold (at most 32 MiB) to the kernel, so the
# next buffer of that size is first-touched page by page again; on this VM a fresh 16 MiB numpy
# result costs 25-60 ms against 3-7 ms from reused heap (measured, FACTS.md). Each collective
# allocates its result: keep freed blocks up to these sizes in the heap instead.
_MMAP_THRESHOLD_BYTES = 256 * 2**20
_TRIM_THRESHOLD_BYTES = 1024 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc malloc.h


def _keep_freed_memory() -> None:
    """Process-wide malloc tuning for the emulated chips (CPU only); TPUDIST_MALLOC_TUNING=0 skips it."""
    if os.environ.get("TPUDIST_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
        # XLA allocates and frees on its worker threads, whose arenas hold at most 64 MiB, so a
        # 64 MiB buffer was mmapped afresh every time whatever the threshold; one arena (the heap)
        # for threads started from here on: a 64 MiB XLA elementwise op 23 -> 6-8 ms (measured).
        libc.mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        pass


def boot(store: Any, rank: int, world_size: int, timeout: timedelta, owner: object) -> Runtime:
    """Starts JAX's multi-process runtime for this world; a no-op if it already runs."""
    global _runtime, _owner_id
    with _lock:
        if _abandoned:
            _end_abandoned()
        if _runtime is not None:
            if (_runtime.process_id, _runtime.num_processes) != (rank, world_size):
                raise RuntimeStateError(
                    f"the tpu runtime already runs as rank={_runtime.process_id} of "
                    f"world_size={_runtime.num_processes}, not rank={rank} of world_size={world_size}: "
                    "destroy_process_group() before starting another world")
            return _runtime
        platform = _platform()
        if platform == "tpu":
            from tpudist.mesh import tpu_env

            # libtpu reads its variables when the TPU backend starts: each rank takes its own chip.
            # Bad facts or a launch that does not fit the slice fail here, before JAX starts.
            topology = tpu_env.configure_process(rank, world_size)
        else:
            topology = topology_for(world_size)  # bad TPUDIST_TOPOLOGY fails before JAX starts
        import jax

        # JAX's preemption service catches SIGTERM, so a rank would ignore torchrun's SIGTERM and
        # be SIGKILLed 30 s later on every restart. torchrun owns the process lifecycle.
        jax.config.update("jax_enable_preemption_service", False)
        # XLA:TPU has no collective timeout and cannot cancel a program: every group's timeout is
        # enforced from the caller's side (group.py), and destroy gives up on a stuck one (work.py).
        collective_timeout_s: float = float("inf")
        if platform == "cpu":
            _keep_freed_memory()
            collective_timeout_s = _collective_timeout_flag(timeout)
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if rank == 0:
            host = _coordinator_host()
            store.set(_COORDINATOR_KEY, f"{host}:{_free_port(host)}")
        address = store.get(_COORDINATOR_KEY).decode()
        try:
            jax.distributed.initialize(
                coordinator_address=address, num_processes=world_size, process_id=rank,
                coordinator_bind_address=address,
                **coordination_timeouts(timeout, int(min(collective_timeout_s, timeout.total_seconds()))))
        except RuntimeError as e:
            raise RuntimeStateError(
                f"could not start JAX's distributed runtime at {address} (rank={rank}, "
                f"world_size={world_size}): {e}. If JAX was used in this process before "
                'init_process_group("tpu"), create the process group first.') from e
        if rank == 0:
            # Everyone has registered, so everyone has read the address: a later world must not.
            store.delete_key(_COORDINATOR_KEY)
        before = _thread_ids() if platform == "cpu" else set()
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # starts the backend
        if platform == "cpu":
            GLOO_LOOP.attach(before)
        by_process = {}
        for d in devices:
            by_process.setdefault(d.process_index, d)  # one chip (device) per process
        chips = tuple(by_process[r] for r in range(world_size))
        if platform == "tpu":
            topology = _check_tpu_chips(topology, chips, timeout)
        _runtime = Runtime(platform, rank, world_size, chips, topology, float(collective_timeout_s))
        _owner_id = id(owner)
        chip.set_local_device(_runtime.local_device)
        return _runtime


def _check_tpu_chips(topology: Any, chips: tuple[Any, ...], timeout: timedelta) -> Any:
    """After the TPU backend started: the slice (a one-process world's from its chip) and each rank's
    chip where the torus model puts it; else the runtime is torn down and the error raised."""
    from tpudist.mesh import tpu_env
    from tpudist.process_group.work import STREAM

    try:
        if topology is None:
            topology = tpu_env.topology_of_chip(chips[0].device_kind)
            tpu_env.check_topology_env(topology)
        tpu_env.check_chip_coords(topology, chips)
    except ValueError:
        _teardown()
        raise
    STREAM.set_uncancellable(timeout.total_seconds() + 2 * STUCK_GRACE_S)
    return topology


# -- jaxlib's gloo TCP loop thread -----------------------------------------------------------------
# gloo's TCP transport runs one event-loop thread per process (gloo::transport::tcp::Loop::run,
# unnamed), started with the CPU client's collectives. It spins on level-triggered epoll while a
# transfer is pending and, with several ranks on 2 cores, takes the CPU from the thread that holds
# the pair lock and does the actual work: per-call latency was bimodal (~0.1 ms or ~4 ms, FACTS.md).
# In SCHED_IDLE it only runs on an otherwise idle CPU. TPUDIST_GLOO_LOOP_IDLE=0 leaves it alone.
_LOOP_IDLE_ENV = "TPUDIST_GLOO_LOOP_IDLE"
_EPOLL_SYSCALLS = {"x86_64": {"232", "281", "441"}, "aarch64": {"22", "441"}}  # epoll_wait, epoll_pwait(2)
_FIND_LOOP_S = 0.5  # the new thread may not have reached epoll_wait yet when the backend returns


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def _waits_in_epoll(tid: int) -> bool:
    import platform

    try:
        with open(f"/proc/self/task/{tid}/wchan", encoding="ascii") as f:
            if "epoll" in f.read():
                return True
        with open(f"/proc/self/task/{tid}/syscall", encoding="ascii") as f:
            return f.read().split()[0] in _EPOLL_SYSCALLS.get(platform.machine(), ())
    except (OSError, IndexError):  # the thread ended, or /proc hides it
        return False


class GlooLoop:
    """The gloo loop thread of this process and its scheduling policy (Linux only).

    ``attach`` finds it among the threads the CPU backend started (the one new thread blocked in
    ``epoll_wait``); ``idle(True/False)`` puts it in SCHED_IDLE or back in SCHED_OTHER, a syscall
    only when the policy changes. Where it cannot be found or the kernel refuses, a warning says
    so and nothing changes.
    """

    def __init__(self) -> None:
        self.tid: int | None = None
        self.is_idle = False
        self.force: bool | None = None  # set by forced(): one policy for every program

    @contextlib.contextmanager
    def forced(self, on: bool | None):
        """Every program runs with the loop thread idle (True) or not (False) in this scope; None
        restores the per-program choice. For A/B measurements (benchmarks/collectives.py)."""
        before, self.force = self.force, on
        try:
            yield self
        finally:
            self.force = before

    @property
    def enabled(self) -> bool:
        return os.environ.get(_LOOP_IDLE_ENV, "1") != "0"

    def attach(self, before: set[int]) -> None:
        self.tid, self.is_idle = None, False
        if not self.enabled or not hasattr(os, "SCHED_IDLE") or not before:
            return
        import time

        deadline = time.monotonic() + _FIND_LOOP_S
        while True:
            new = sorted(_thread_ids() - before)
            found = [t for t in new if _waits_in_epoll(t)]
            if len(found) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if len(found) != 1:
            warnings.warn(
                f"tpudist: could not identify jaxlib's gloo loop thread ({len(found)} of the "
                f"{len(new)} threads the CPU backend started wait in epoll, expected 1); its "
                f"scheduling is left alone, so small collectives may be slower. Set "
                f"{_LOOP_IDLE_ENV}=0 to silence this.", RuntimeWarning, stacklevel=3)
            return
        self.tid = found[0]
        self.idle(True)

    def idle(self, on: bool) -> None:
        if self.force is not None:
            on = self.force
        if self.tid is None or on == self.is_idle:
            return
        policy = os.SCHED_IDLE if on else os.SCHED_OTHER
        try:
            os.sched_setscheduler(self.tid, policy, os.sched_param(0))
        except OSError as e:
            warnings.warn(f"tpudist: the kernel refused to set jaxlib's gloo loop thread (tid "
                          f"{self.tid}) to {'SCHED_IDLE' if on else 'SCHED_OTHER'}: {e}; its "
                          f"scheduling is left alone. Set {_LOOP_IDLE_ENV}=0 to silence this.",
                          RuntimeWarning, stacklevel=2)
            self.tid = None
            return
        self.is_idle = on

    def policy(self) -> int | None:
        """The thread's current policy as the kernel reports it (None: no thread attached)."""
        return None if self.tid is None else os.sched_getscheduler(self.tid)


GLOO_LOOP = GlooLoop()


def on_teardown(forget: Callable[[], None]) -> None:
    """``forget`` runs when the runtime is torn down, before JAX's backends go: the modules above
    that cache programs or meshes over this world's devices register their ``clear_cache``."""
    _on_teardown.append(forget)


def shutdown(owner: object) -> None:
    """Shuts the runtime down if ``owner`` booted it (destroying the world group).

    ``jax.distributed.shutdown()`` is a barrier of every process of the world (JAX's coordination
    service): a rank that never gets here makes JAX terminate this process after the timeout.
    """
    with _lock:
        if _runtime is None or _owner_id != id(owner):
            return
        _teardown()


def abandon(owner: object) -> None:
    """``abort()`` of the world while a collective is still inside XLA, which cannot cancel it.

    Tearing the runtime down under a running program is unsafe, and its barrier would wait for peers
    that may never come; so the runtime stays until the next ``init_process_group("tpu")`` in this
    process, which tears it down first (with the old world's other ranks doing the same).
    """
    global _abandoned
    with _lock:
        if _runtime is not None and _owner_id == id(owner):
            _abandoned = True
            chip.set_local_device(None)


def _end_abandoned() -> None:
    from tpudist.process_group.work import STREAM

    if STREAM.busy():
        raise RuntimeStateError(
            "the previous tpu world was aborted while one of its collectives was inside XLA, which "
            "cannot cancel it; that collective ends within the old world's timeout. Wait for it (or "
            "for the work it raised), then init again, or restart the process.")
    _teardown()


def _teardown() -> None:
    global _runtime, _owner_id, _abandoned
    import jax
    import jax.extend.backend

    from tpudist.process_group.work import STREAM

    STREAM.set_uncancellable(None)
    for forget in _on_teardown:
        forget()
    try:
        jax.distributed.shutdown()
    finally:
        jax.clear_caches()
        jax.extend.backend.clear_backends()
        _runtime, _owner_id, _abandoned = None, None, False
        chip.set_local_device(None)
        GLOO_LOOP.tid, GLOO_LOOP.is_idle = None, False  # the thread ended with the backend
