"""Commands (torchrun jobs, CLIs) run in their own session, with a hard timeout, cleaned up by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Mapping

from tpudist.testing._pool import RankTimeout, free_port


def torchrun_command(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run`` on 127.0.0.1 at a free port, then ``args``."""
    restarts = ["--max-restarts", str(max_restarts), "--monitor-interval", "0.2"] if max_restarts else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *restarts,
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]


def run_command(command: list[str], *, timeout: float, env: Mapping[str, str | None] | None = None,
                cwd: str | os.PathLike | None = None) -> tuple[int, str]:
    """Runs ``command``; returns (exit code, stdout and stderr together).

    ``env`` overrides this process's environment (None removes a variable); rank processes get
    ``OMP_NUM_THREADS=1`` unless it says otherwise. Whatever the outcome, the command's whole session
    (a torchrun agent and the workers it left) is killed by PID. Raises RankTimeout, with the end
    of the output, if the command did not finish within ``timeout`` seconds.
    """
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        raise RankTimeout(f"{' '.join(command)} did not finish within {timeout}s:\n{out[-3000:]}") from None
    finally:
        _kill_session(proc)
    return proc.returncode, out


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
