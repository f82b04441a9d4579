"""Rank-side functions of the lifecycle tests: what a rank still holds after destroy and abort."""

from __future__ import annotations

import glob
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp (include/net/tcp_states.h)


def listening_ports() -> list[int]:
    """TCP ports this process listens on: /proc/net/tcp{,6} rows whose socket inode it holds."""
    inodes = set()
    for fd in glob.glob("/proc/self/fd/*"):
        try:
            link = os.readlink(fd)
        except OSError:  # closed while we looked
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                fields = row.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def tpudist_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tpudist"))


def _init(path: str, world: int, timeout_s: float) -> None:
    dist.init_process_group("tpu", init_method=f"file://{path}/world{world}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=timeout_s))


def _coordinator_port() -> int:
    from jax._src import distributed

    return int(distributed.global_state.coordinator_address.rsplit(":", 1)[1])


def release_and_reinit(path: str, how: str):
    """Collectives on the world, a subgroup and the comm thread, then ``how`` ("destroy" or "abort",
    on every rank), then a new world in the same process. Each world meets in its own FileStore,
    so every listener seen belongs to JAX/XLA."""
    out = {"before": listening_ports()}
    _init(path, 0, 60)
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()  # starts the comm thread
    dist.all_reduce(t, group=dist.new_group([0, 1]))
    out["during"], out["threads_during"] = listening_ports(), tpudist_threads()
    out["coordinator"] = _coordinator_port() if dist.get_rank() == 0 else None
    t0 = time.monotonic()
    dist.destroy_process_group() if how == "destroy" else c10d._abort_process_group()
    out["release_s"] = time.monotonic() - t0
    out["after"], out["threads_after"] = listening_ports(), tpudist_threads()
    t0 = time.monotonic()
    _init(path, 1, 60)
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    out["reinit_s"], out["reinit_sum"] = time.monotonic() - t0, t.tolist()
    dist.destroy_process_group()
    out["final"] = listening_ports()
    return out


def abort_while_blocked(path: str, timeout_s: float, abort_after_s: float, use_async: bool,
                        peer_abort_after_s: float):
    """Rank 1 skips a collective that rank 0 enters; a watchdog thread on rank 0 aborts after
    ``abort_after_s``. Rank 1 aborts too (after ``peer_abort_after_s``), then both start a new world."""
    _init(path, 0, timeout_s)
    dist.all_reduce(torch.ones(2))
    out = {}
    if dist.get_rank() == 1:
        time.sleep(peer_abort_after_s)
        c10d._abort_process_group()
    else:
        def watchdog():
            time.sleep(abort_after_s)
            t0 = time.monotonic()
            c10d._abort_process_group()
            out["abort_at"], out["abort_took"] = t0 - start, time.monotonic() - t0
            out["threads_at_abort"] = tpudist_threads()

        start = time.monotonic()
        thread = threading.Thread(target=watchdog, name="watchdog")
        thread.start()
        try:
            if use_async:
                dist.all_reduce(torch.ones(2), async_op=True).wait()
            else:
                dist.all_reduce(torch.ones(2))
            out["error"] = "completed?!"
        except Exception as e:  # noqa: BLE001 - the error is the result
            out["error"] = f"{type(e).__name__}: {e}"
        out["returned_at"] = time.monotonic() - start
        thread.join()
        from tpudist.process_group.work import STREAM

        out["busy_after_return"] = STREAM.busy()  # is XLA still running the aborted collective?
        while STREAM.busy() and time.monotonic() - start < 3 * timeout_s:
            time.sleep(0.1)
        out["idle_at"] = time.monotonic() - start
    t0 = time.monotonic()
    _init(path, 1, timeout_s)  # on rank 0: tears down the runtime the abort had to leave
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    out["reinit_s"], out["reinit_sum"] = time.monotonic() - t0, t.tolist()
    out["threads_after"] = tpudist_threads()
    dist.destroy_process_group()
    return out


def uncancellable_collective_names_the_absent(sleep_s: float):
    """A TPU world's timeout on CPU: the runtime marks collectives uncancellable (as on a TPU), and a group's
    timeout (2 s) below XLA's collective timeout (the world's, much longer) makes the caller time out while
    the program still waits inside XLA, as it would on a chip. Rank 1 never reaches the all_reduce."""
    from tpudist.process_group.work import STREAM, CollectiveTimeout

    group = dist.new_group(timeout=timedelta(seconds=2))
    STREAM.set_uncancellable(30.0)
    try:
        if dist.get_rank() != 0:
            time.sleep(sleep_s)
            return "stayed away"
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3), group=group)
            return "no error"
        except CollectiveTimeout as e:
            return f"after {time.monotonic() - start:.1f}s: {e}"
    finally:
        STREAM.set_uncancellable(None)
