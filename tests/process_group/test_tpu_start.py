"""The TPU start-up path on CPU, the TPU backend mocked: libtpu's variables are set before it starts,
the chips it reports are checked, and a collective that never completes cannot hang destroy.

Nothing here ran on a TPU: JAX's `distributed.initialize` and `devices` are replaced by fakes that
record the environment at the moment the backend would start.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import jax
import jax.extend.backend
import pytest

from tpudist.runtime import chip
from tpudist.mesh import tpu_env
from tpudist.mesh.tpu_facts import TpuEnvError
from tpudist.process_group import runtime
from tpudist.process_group.work import STREAM, CollectiveTimeout, CommStream, Work

GKE_V5E_16_WORKER_1 = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-16",
                       "TPU_HOST_BOUNDS": "2,2,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_WORKER_ID": "1",
                       "TPU_WORKER_HOSTNAMES": "a,b,c,d", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                       "TPUDIST_PLATFORM": "tpu"}
# v5e:4x4, host-major, x fastest within a 2x2 host; host 1 is x=2..3, y=0..1 (written out by hand).
V5E_4X4_COORDS = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1),
                  (0, 2), (1, 2), (0, 3), (1, 3), (2, 2), (3, 2), (2, 3), (3, 3)]


class FakeChip:
    platform = "tpu"
    device_kind = "TPU v5 lite"

    def __init__(self, index, coords):
        self.id = self.process_index = index
        self.coords = (*coords, 0)


class FakeStore:
    def __init__(self):
        self.values = {runtime._COORDINATOR_KEY: b"127.0.0.1:1"}  # rank 0 of the world wrote it

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def delete_key(self, key):
        self.values.pop(key, None)


@pytest.fixture
def tpu_backend(monkeypatch):
    """The runtime as a fresh process sees it, with JAX's TPU start replaced by a recorder."""
    for name in (*tpu_env.ENV_NAMES, "TPUDIST_TOPOLOGY", tpu_env.BASE_PORT_ENV):
        monkeypatch.setenv(name, "")  # registers the original value (or absence) for restoring
        monkeypatch.delenv(name)
    for name, value in GKE_V5E_16_WORKER_1.items():
        monkeypatch.setenv(name, value)
    seen = {"order": []}
    coords = list(V5E_4X4_COORDS)

    def initialize(**kwargs):
        seen["order"].append("initialize")
        seen["env_at_initialize"] = {n: os.environ.get(n) for n in tpu_env.ENV_NAMES}

    def devices():
        seen["order"].append("devices")  # the TPU backend starts here
        seen["env_at_backend"] = {n: os.environ.get(n) for n in tpu_env.ENV_NAMES}
        return [FakeChip(i, c) for i, c in enumerate(coords)]

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.distributed, "shutdown", lambda: seen["order"].append("shutdown"))
    monkeypatch.setattr(jax, "devices", devices)
    monkeypatch.setattr(jax.extend.backend, "clear_backends", lambda: None)
    monkeypatch.setattr(runtime, "_runtime", None)
    monkeypatch.setattr(runtime, "_owner_id", None)
    yield seen, coords
    chip.set_local_device(None)
    STREAM.set_uncancellable(None)


def test_each_rank_takes_its_chip_before_the_tpu_backend_starts(tpu_backend):
    seen, _ = tpu_backend
    booted = runtime.boot(FakeStore(), 6, 16, timedelta(seconds=30), owner=object())
    assert seen["order"] == ["initialize", "devices"]
    assert seen["env_at_initialize"] == seen["env_at_backend"]
    env = seen["env_at_backend"]
    assert (env["TPU_VISIBLE_CHIPS"], env["CLOUD_TPU_TASK_ID"], env["TPU_PROCESS_PORT"]) == ("2", "6", "8478")
    assert env["TPU_PROCESS_BOUNDS"] == "4,4,1" and env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    assert str(booted.topology) == "v5e:4x4" and booted.local_device.coords == (2, 1, 0)
    # XLA:TPU cannot time a collective out: every group enforces its timeout from the caller's side
    assert booted.collective_timeout_s == float("inf")
    assert STREAM.drain_limit_s == 30 + 2 * runtime.STUCK_GRACE_S


def test_a_bad_launch_fails_before_jax_starts(tpu_backend, monkeypatch):
    seen, _ = tpu_backend
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(TpuEnvError, match="nproc_per_node=8 processes on a host of v5litepod-16"):
        runtime.boot(FakeStore(), 6, 16, timedelta(seconds=30), owner=object())
    assert seen["order"] == [] and "TPU_VISIBLE_CHIPS" not in os.environ


def test_chips_off_the_torus_model_are_an_error_and_the_runtime_goes(tpu_backend):
    seen, coords = tpu_backend
    coords[4], coords[5] = coords[5], coords[4]
    with pytest.raises(TpuEnvError, match=r"rank 4 on coords=\(3, 0, 0\), model \(2, 0, 0\); rank 5"):
        runtime.boot(FakeStore(), 6, 16, timedelta(seconds=30), owner=object())
    assert seen["order"] == ["initialize", "devices", "shutdown"] and not runtime.is_booted()


def test_one_process_world_slice_comes_from_its_chip(tpu_backend, monkeypatch):
    seen, coords = tpu_backend
    del coords[1:]
    monkeypatch.setenv("TPUDIST_TOPOLOGY", "v5e:2x2")
    with pytest.raises(TpuEnvError, match="TPUDIST_TOPOLOGY=v5e:2x2 but this TPU slice is v5e:1x1"):
        runtime.boot(FakeStore(), 0, 1, timedelta(seconds=30), owner=object())
    assert seen["env_at_backend"]["TPU_VISIBLE_CHIPS"] == "0"
    monkeypatch.delenv("TPUDIST_TOPOLOGY")
    assert str(runtime.boot(FakeStore(), 0, 1, timedelta(seconds=30), owner=object()).topology) == "v5e:1x1"


def test_the_device_alone_takes_chip_0_before_the_backend_starts(monkeypatch):
    device_runtime = pytest.importorskip("tpudist.device._runtime")
    for name in tpu_env.ENV_NAMES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("TPUDIST_PLATFORM", "tpu")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = {}

    def local_devices():
        seen.update({n: os.environ.get(n) for n in tpu_env.ENV_NAMES})
        return ["chip"]

    monkeypatch.setattr(jax, "local_devices", local_devices)
    monkeypatch.setattr(device_runtime, "_device", None)
    monkeypatch.setattr(device_runtime, "enable_persistent_cache", lambda: None)
    assert device_runtime.device() == "chip"
    assert seen["TPU_VISIBLE_CHIPS"] == "0" and seen["TPU_PROCESS_BOUNDS"] == "1,1,1"


# -- a collective whose peers never arrive (TPU: it cannot be cancelled) ----------------------------
def test_destroy_gives_up_on_a_collective_that_never_completes():
    release = threading.Event()
    STREAM.set_uncancellable(0.3)  # what the runtime sets for a TPU world
    try:
        work = STREAM.submit(Work("all_reduce on group 'world'", timedelta(seconds=0.2)), release.wait,
                             async_op=True)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="did not complete within the timeout of 0.2s.*restart the job"):
            work.wait()
        with pytest.raises(CollectiveTimeout, match=r"destroy_process_group: 1 collective\(s\) .* after 0.3s.*"
                                                    "a program cannot be cancelled"):
            STREAM.drain()
        assert time.monotonic() - start < 3
    finally:
        STREAM.set_uncancellable(None)
        release.set()
        STREAM.stop()  # the stuck call returned: the stream ends as usual


def test_on_cpu_destroy_waits_for_xla_to_end_the_collective():
    stream, release = CommStream(), threading.Event()
    stream.submit(Work("all_reduce", timedelta(seconds=10)), release.wait, async_op=True)
    threading.Timer(0.3, release.set).start()  # XLA:CPU's collective timeout ends it
    stream.drain()
    assert release.is_set()
    stream.stop()


def test_a_stuck_collective_names_the_ranks_that_never_reached_it():
    """On a TPU the caller's timeout, not XLA, ends the wait: the error still names the absent rank."""
    import re

    import rank_fns_lifecycle as fns

    from tpudist.testing import RankPool

    with RankPool(2, timeout=120) as pool:
        got, away = pool.run(fns.uncancellable_collective_names_the_absent, 12.0)
    assert away == "stayed away"
    assert re.search(r"is waiting inside XLA for ranks \[1\], which never reached it", got), got
    assert re.search(r"; all_reduce #\d+ over global ranks \[0, 1\] is waiting", got) and "restart the job" in got, got
