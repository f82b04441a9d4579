"""destroy_process_group() and abort() release what a "tpu" rank holds; what XLA cannot cancel."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import rank_fns_lifecycle as fns

from tpudist.process_group import runtime
from tpudist.process_group.work import STREAM, CollectiveError, CommStream, Work
from tpudist.testing import run_ranks


# -- pure: the comm stream under abort ----------------------------------------------------------
def test_abort_fails_queued_work_and_releases_the_waiter_of_the_running_one():
    stream, release = CommStream(), threading.Event()
    running = stream.submit(Work("stuck", timedelta(seconds=30)), release.wait, async_op=True)
    queued = stream.submit(Work("queued", timedelta(seconds=30)), lambda: "ran", async_op=True)
    time.sleep(0.2)  # the thread has taken `running`
    assert stream.abort(CollectiveError("aborted")) is True  # one is still running
    for work in (running, queued):
        with pytest.raises(CollectiveError, match="aborted"):
            work.wait(timedelta(seconds=1))
    assert stream.busy()  # the stuck task goes on: nothing can cancel it
    release.set()
    stream.drain()
    assert not stream.busy() and not queued.is_success()  # the queued task never ran
    deadline = time.monotonic() + 5
    while stream._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream._thread is None


def test_stop_ends_the_thread_and_a_later_async_call_starts_another():
    stream = CommStream()
    assert stream.submit(Work("a", timedelta(seconds=5)), lambda: 1, async_op=True).result() == 1
    thread = stream._thread
    stream.stop()
    assert not thread.is_alive()
    assert stream.submit(Work("b", timedelta(seconds=5)), lambda: 2, async_op=True).result() == 2


def test_init_refuses_while_an_aborted_collective_is_still_inside_xla(monkeypatch):
    monkeypatch.setattr(runtime, "_abandoned", True)
    monkeypatch.setattr(STREAM, "busy", lambda: True)
    with pytest.raises(runtime.RuntimeStateError, match=re.escape(
            "the previous tpu world was aborted while one of its collectives was inside XLA, which "
            "cannot cancel it; that collective ends within the old world's timeout.")):
        runtime.boot(None, 0, 2, timedelta(seconds=10), owner=object())


# -- real ranks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["destroy", "abort"])
def test_destroy_and_abort_close_every_listener_and_thread_and_a_new_world_starts(tmp_path, how):
    results = run_ranks(2, fns.release_and_reinit, str(tmp_path), how, backend=None, timeout=240)
    for rank, out in enumerate(results):
        assert out["before"] == [] and out["threads_during"] == ["tpudist-comm"]
        assert len(out["during"]) == (2 if rank == 0 else 1)  # XLA's gloo listener (+ coordinator)
        if rank == 0:
            assert out["coordinator"] in out["during"]
        assert out["release_s"] < 20  # a barrier of both ranks; ~0.2 s when idle
        assert out["after"] == [] and out["threads_after"] == []
        assert out["reinit_s"] < 60 and out["reinit_sum"] == [3.0, 3.0]
        assert out["final"] == []


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_abort_while_a_collective_waits_for_a_peer_that_never_comes(tmp_path, use_async):
    """XLA cannot cancel a running collective: abort() returns at once and releases whoever waits on
    an async work, but a synchronous caller (the XLA call runs on its thread) gets control back only
    at XLA's collective timeout. The next init_process_group tears the runtime down and starts anew."""
    timeout_s, abort_after_s = 10.0, 2.0
    results = run_ranks(2, fns.abort_while_blocked, str(tmp_path), timeout_s, abort_after_s, use_async,
                        6.0, backend=None, env={"XLA_FLAGS": ""}, timeout=240)
    out = results[0]
    assert out["abort_took"] < 1.5
    assert out["error"].startswith("CollectiveAborted: a collective on group ")
    assert "was aborted before it completed (abort() or _abort_process_group())" in out["error"]
    if use_async:
        assert out["returned_at"] - out["abort_at"] < 1.5
        assert out["busy_after_return"]  # the XLA call goes on ...
    else:
        assert out["returned_at"] >= timeout_s - 1.0  # not cancelled: returns at XLA's timeout
    assert timeout_s - 1.0 <= out["idle_at"] <= timeout_s + 6.0  # ... until XLA's timeout
    for out in results:
        assert out["reinit_sum"] == [3.0, 3.0] and out["reinit_s"] < 60
        assert out["threads_after"] in ([], ["tpudist-comm"])
