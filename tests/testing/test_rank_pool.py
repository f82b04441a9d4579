"""RankPool's ranks forked from a preload server behave as fresh interpreters would: a hung rank (and
what it started) is killed by PID, a crashed rank is reported with its exit code, one pool's
environment does not reach another's ranks (nor the server), import-time JAX flags get a server of
their own, and each pool's ranks see the topology it asked for. The same checks pass with
``TPUDIST_POOL_START=fresh`` (every rank a new interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tpudist.testing import RankError, RankPool, RankTimeout
from tpudist.testing import _pool


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not reaped yet
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


# -- rank functions (imported by module name in the ranks) ----------------------------------------
def describe() -> dict:
    import threading

    import jax
    import torch

    return {"pid": os.getpid(), "session": os.getsid(0), "cwd": os.getcwd(),
            "leak": os.environ.get("TPUDIST_PROBE_LEAK"), "x64": bool(jax.config.jax_enable_x64),
            "seed": torch.initial_seed(), "threads": threading.active_count(), "argv": sys.argv[1:]}


def sleep_with_a_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ["TPUDIST_PROBE_CHILD_FILE"] + os.environ["RANK"], "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)


def crash_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        os._exit(3)
    return os.getpid()


def topology_and_devices() -> tuple[str, int, int]:
    import jax
    import torch
    import torch.distributed as dist
    from tpudist.process_group import topology

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return str(topology()), jax.device_count(), int(t.item())


@pytest.fixture(params=["fork", "fresh"])
def start(request, monkeypatch):
    monkeypatch.setenv("TPUDIST_POOL_START", request.param)
    return request.param


def test_ranks_start_as_fresh_interpreters_would(start, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with RankPool(2, backend=None, env={"TPUDIST_PROBE_LEAK": "x"}) as pool:
        assert pool.started_by == start
        first = pool.run(describe)
    with RankPool(2, backend=None) as pool:
        second = pool.run(describe)
    for info in first + second:
        assert info["session"] == info["pid"] and info["cwd"] == str(tmp_path), info
        assert info["threads"] == 1 and info["argv"] == [] and not info["x64"], info
    assert [i["leak"] for i in first] == ["x", "x"] and [i["leak"] for i in second] == [None, None]
    seeds = {i["seed"] for i in first + second}
    assert len(seeds) == 4, f"torch's default generator must be seeded per rank, as a new process is: {seeds}"


def test_an_import_time_jax_flag_gets_a_server_of_its_own():
    with RankPool(1, backend=None, env={"JAX_ENABLE_X64": "1"}) as pool:
        assert pool.started_by == "fork"
        assert pool.run(describe)[0]["x64"]
    with RankPool(1, backend=None) as pool:
        assert not pool.run(describe)[0]["x64"]
    with RankPool(1, backend=None, env={"JAX_ENABLE_X64": "1"}) as pool:
        assert pool.run(describe)[0]["x64"]
    read = _pool._read_at_import
    assert "JAX_ENABLE_X64" in read and "TPUDIST_PROBE_LEAK" not in read and "XLA_FLAGS" not in read


def test_a_hung_rank_and_its_child_are_killed_at_the_timeout(start, tmp_path):
    pool = RankPool(2, backend=None, env={"TPUDIST_PROBE_CHILD_FILE": str(tmp_path / "child")})
    pool.start()
    pids = [p.pid for p in pool._procs]
    began = time.monotonic()
    with pytest.raises(RankTimeout, match="did not finish 'run' within 3"):
        pool.run(sleep_with_a_child, timeout=3)
    assert time.monotonic() - began < 30
    children = [int((tmp_path / f"child{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids + children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids + children)), (pids, children)
    assert not pool.alive
    pool.close()


def test_a_crashed_rank_is_reported_with_its_exit_code(start):
    with RankPool(2, backend=None) as pool:
        with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)") as error:
            pool.run(crash_on_rank_one)
        survivor = error.value.results[0]
        assert not pool.alive and not _alive(survivor)
        assert len(pool.run(describe)) == 2  # the next run starts new ranks


def test_ranks_see_the_topology_their_pool_asked_for():
    with RankPool(4, topology="v5p:2x2x1") as pool:
        assert pool.run(topology_and_devices) == [("v5p:2x2x1", 4, 10)] * 4
    with RankPool(2, topology="v5p:2x1x1") as pool:
        assert pool.run(topology_and_devices) == [("v5p:2x1x1", 2, 3)] * 2


# -- in-process pools (TPUDIST_POOL_START=inprocess: a TPU VM's chip takes one process) -----------------
def environment_and_eager_mode() -> dict:
    import torch

    tpu = getattr(torch, "tpu", None)
    return {"pid": os.getpid(), "leak": os.environ.get("TPUDIST_PROBE_LEAK"),
            "mode": tpu.get_eager_mode() if tpu is not None and hasattr(tpu, "get_eager_mode") else None}


def raise_value_error() -> None:
    raise ValueError("raised in the rank function")


def test_an_in_process_pool_runs_here_under_its_environment(monkeypatch):
    import tpudist.device  # noqa: F401 - the eager mode the pool's environment names is set for each call
    import torch

    monkeypatch.setenv("TPUDIST_POOL_START", "inprocess")
    before = torch.tpu.get_eager_mode()
    other = "fused" if before != "fused" else "strict"
    with RankPool(1, backend=None, env={"TPUDIST_PROBE_LEAK": "yes", "TPUDIST_EAGER_MODE": other}) as pool:
        assert pool.run(environment_and_eager_mode) == [{"pid": os.getpid(), "leak": "yes", "mode": other}]
        assert pool.started_by == "inprocess" and pool.alive
        assert "TPUDIST_PROBE_LEAK" not in os.environ and torch.tpu.get_eager_mode() == before
        with pytest.raises(RankError, match="raised in the rank function") as err:
            pool.run(raise_value_error)
        assert list(err.value.failures) == [0]
    assert os.getpid() == environment_and_eager_mode()["pid"]  # closing the pool ended nothing of ours


@pytest.mark.parametrize("options", [{"world_size": 2, "backend": None}, {"world_size": 1, "backend": "gloo"}])
def test_an_in_process_pool_refuses_what_needs_rank_processes(options, monkeypatch):
    monkeypatch.setenv("TPUDIST_POOL_START", "inprocess")
    with pytest.raises(_pool.PoolUnsupported, match=r"needs rank processes.*world_size=1 with backend=None"):
        RankPool(**options).start()


def test_an_in_process_pool_refuses_what_tpudist_reads_at_import(monkeypatch):
    monkeypatch.setenv("TPUDIST_POOL_START", "inprocess")
    monkeypatch.delenv("TPUDIST_CPP_FASTPATH", raising=False)
    with pytest.raises(_pool.PoolUnsupported, match=r"process of its own.*reads TPUDIST_CPP_FASTPATH once"):
        RankPool(1, backend=None, env={"TPUDIST_CPP_FASTPATH": "0"}).start()
    monkeypatch.setenv("TPUDIST_CPP_FASTPATH", "0")  # the value this process was started with: nothing to apply
    with RankPool(1, backend=None, env={"TPUDIST_CPP_FASTPATH": "0"}) as pool:
        assert pool.started_by == "inprocess"
