"""One rank of a RankPool: connects back to the pool and runs what it is sent.

Started either as a fresh interpreter (``python -m tpudist.testing._worker``) or forked by a preload
server (``python -m tpudist.testing._worker --preload FD``, see :func:`serve_preloaded`), which has
imported what every rank imports once, so a rank starts in well under a second instead of paying
6-10 s of CPU for torch, JAX and tpudist's backend.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Client

# What every rank imports before its first function runs: torch, and what init_process_group("tpu")
# imports (JAX, tpudist's backend). Importing starts no JAX backend and no Python thread (numpy's
# OpenBLAS starts one OS thread, which registers fork handlers), so forking afterwards is safe.
# Not tpudist.device: importing it installs the device into torch, which a rank asks for itself.
PRELOAD = ("torch", "torch.distributed", "jax", "jax.distributed", "tpudist.process_group.group",
           "tpudist.mesh", "tpudist.runtime.program_cache", "tpudist.runtime.jax_cache")

MAX_MESSAGE = 1 << 20  # a fork request is the rank's environment: a few kB
STATUS = struct.Struct("i")  # what the server writes to a rank's status socket: its wait status


def _setup(sys_path: list[str], backend: str | None) -> None:
    for entry in sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    if backend is not None:
        import torch.distributed as dist

        dist.init_process_group(backend, timeout=timedelta(seconds=60))


def main() -> None:
    rank = int(os.environ["RANK"])
    conn = Client(("127.0.0.1", int(os.environ["TPUDIST_POOL_PORT"])),
                  authkey=bytes.fromhex(os.environ["TPUDIST_POOL_KEY"]))
    conn.send(rank)
    while True:
        payload = conn.recv_bytes()
        try:
            message = pickle.loads(payload)
            if message[0] == "exit":
                break
            if message[0] == "setup":
                result = _setup(*message[1:])
            else:
                fn, args, kwargs = message[1:]
                result = fn(*args, **kwargs)
            reply = pickle.dumps(("ok", result))  # plain pickle: tensors go by value, not shared memory
        except BaseException:  # noqa: BLE001 - the traceback goes back to the pool
            reply = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(reply)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        conn.close()


# -- the preload server ---------------------------------------------------------------------------
def _import_recording_environ_reads(modules: tuple[str, ...]) -> set[str]:
    """Imports ``modules``; returns the names of the environment variables they read by name.

    A forked rank cannot change what these imports made of a variable (JAX reads its JAX_* flags at
    import, torch.distributed TORCH_DISTRIBUTED_DEBUG): the pool forks a rank from this server only
    if such variables have the same values in the rank's environment as here.
    """
    names: set[str] = set()
    environ_class = type(os.environ)
    original = environ_class.__getitem__

    def recording_getitem(self, key):  # os.getenv, .get and `in` all go through __getitem__
        names.add(key)
        return original(self, key)

    environ_class.__getitem__ = recording_getitem
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        environ_class.__getitem__ = original
    return names


def serve_preloaded(fd: int) -> None:
    """Imports :data:`PRELOAD`, then forks a rank for each request on the socket ``fd``.

    Protocol (SOCK_SEQPACKET, one message each): the server first sends ``("ready", names read at
    import)`` or ``("error", traceback)``. A request is the pickled ``(environment, working
    directory)`` of the rank with three descriptors: the rank's status socket, its stdout and its
    stderr; the server answers ``("forked", pid)``. When the rank ends, the server writes its wait
    status (:data:`STATUS`) to the status socket and closes it. The server exits when the pool's end
    of ``fd`` closes.
    """
    sock = socket.socket(fileno=fd)
    try:
        read = _import_recording_environ_reads(PRELOAD)
        if threading.active_count() != 1:
            raise RuntimeError(f"importing {PRELOAD} started Python threads {threading.enumerate()}: "
                               "forking ranks from here would lose them")
        gc.collect()
        gc.freeze()  # the imports' objects: a rank's gc.collect() need not walk them (~0.5-1.8 s)
    except BaseException:  # noqa: BLE001 - the pool falls back to fresh interpreters and says why
        sock.send(pickle.dumps(("error", traceback.format_exc())))
        return
    sock.send(pickle.dumps(("ready", sorted(read))))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through wake_w
    status: dict[int, int] = {}  # pid -> that rank's status socket
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _report_ended_ranks(status)
        if sock in readable:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            if not message:
                return
            status_fd, out_fd, err_fd = fds
            pid = os.fork()
            if pid == 0:
                sock.close()
                for other in (wake_r, wake_w, *status.values(), status_fd):
                    os.close(other)
                _run_forked_rank(*pickle.loads(message), out_fd, err_fd)  # never returns
            os.close(out_fd)
            os.close(err_fd)
            status[pid] = status_fd
            sock.send(pickle.dumps(("forked", pid)))
            _report_ended_ranks(status)


def _report_ended_ranks(status: dict[int, int]) -> None:
    while status:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, STATUS.pack(wait_status))
            except OSError:  # the pool has gone
                pass
            os.close(fd)


def _run_forked_rank(environ: dict[str, str], cwd: str, out_fd: int, err_fd: int) -> None:
    """In the forked child: becomes what a fresh ``python -m tpudist.testing._worker`` started in
    ``cwd`` with ``environ`` would be, then serves the pool."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # the pool ends the rank and whatever it starts by process group
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.environ.clear()
        os.environ.update(environ)
        if sys.path[0] == os.getcwd():  # `python -m` puts the directory it starts in first
            sys.path[0] = cwd
        os.chdir(cwd)
        sys.argv[1:] = []
        # A fresh interpreter seeds these from the OS (Python's `random` reseeds itself at fork).
        import torch

        torch.default_generator.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # noqa: SLF001 - what interpreter shutdown runs
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--preload"]:
        serve_preloaded(int(sys.argv[2]))
    else:
        main()
