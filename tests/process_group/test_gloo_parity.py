"""Issue 12: what gloo does, "tpu" does: all_gather_coalesced in torch's layout, recv from any
source (also under the autograd and torch profilers), sparse COO all_reduce, and a barrier that
times out on one rank. Each case runs on a "tpu" group and a gloo group of the same ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import gloo_parity_cases as cases
import pytest
import torch

from tpudist.testing import RankPool

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(os.path.dirname(HERE), "helpers")  # the modules tests share (tests/helpers/)
SPECS = [None, (0, 2), (2, 0, 1)]  # the world, a pair, and a group not in rank order


@pytest.fixture(scope="module")
def pool3():
    with RankPool(3, timeout=300) as pool:
        yield pool


def _tpu_and_gloo(results):
    for per_rank in results:
        if per_rank is not None:
            yield per_rank


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_all_gather_coalesced_fills_one_list_per_rank_like_gloo(pool3, use_async):
    for spec in SPECS:
        for tpu, gloo in _tpu_and_gloo(pool3.run(cases.all_gather_coalesced, spec, use_async)):
            assert tpu.keys() == gloo.keys()
            for dtype in tpu:
                for rank_tpu, rank_gloo in zip(tpu[dtype], gloo[dtype], strict=True):
                    for a, b in zip(rank_tpu, rank_gloo, strict=True):
                        assert a.dtype == b.dtype and torch.equal(a, b), (spec, dtype, a, b)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_sparse_all_reduce_sum_is_gloos_coalesced_sum(pool3, use_async):
    for spec in SPECS:
        for tpu, gloo in _tpu_and_gloo(pool3.run(cases.sparse_all_reduce, spec, use_async)):
            for name in tpu:
                (i_t, v_t, s_t, c_t), (i_g, v_g, s_g, c_g) = tpu[name], gloo[name]
                assert (s_t, c_t) == (s_g, c_g) and c_t, name
                assert torch.equal(i_t, i_g), (spec, name, i_t, i_g)
                assert v_t.dtype == v_g.dtype and torch.equal(v_t, v_g), (spec, name, v_t, v_g)


def test_sparse_all_reduce_of_different_sizes_raises_on_every_rank(pool3):
    for rank, (tpu, gloo, after) in enumerate(pool3.run(cases.sparse_mismatch)):
        assert "RuntimeError" in gloo  # gloo: "Sparse dimensions do not match" (or size)
        assert tpu.startswith("ValueError: all_reduce (sparse) on group") and (
            "sparse tensors must have the same size, sparse_dim and dtype on every rank (only nnz "
            "may differ); got rank 0: size=[4, 4], sparse_dim=2, dtype=torch.float32; rank 1: "
            "size=[4, 5], sparse_dim=2, dtype=torch.float32; rank 2: size=[4, 5]") in tpu, tpu
        assert after == [3.0, 3.0]


@pytest.mark.parametrize("profiler,tag", [(None, 0), ("autograd", 0), ("torch", 5)])
def test_recv_from_any_source_pairs_every_send_like_gloo(pool3, profiler, tag):
    for spec in SPECS:
        for tpu, gloo in _tpu_and_gloo(pool3.run(cases.recv_any_source, spec, profiler, tag)):
            assert tpu == gloo, (spec, profiler)  # who sent what (sorted: arrival order is free)
            for sender, values in tpu:
                assert values == [sender + k / 16 for k in range(10)]


@pytest.mark.tpudist(world_size=2, timeout=120)  # the project's pytest plugin: runs on each rank
def test_recv_from_any_source_with_no_sender_times_out():
    import torch.distributed as dist

    result = cases.recv_any_source_timeout()
    if dist.get_rank() == 1:
        assert result == "sender idle"
        return
    assert result.startswith("CollectiveTimeout after"), result
    assert 2.0 <= float(result.split()[2].rstrip("s:")) < 10, result
    # The pairing gives up at the group timeout ("no rank of the group sent rank 0 a message with
    # tag=0 within the group timeout of 2s"), or the waiter does, a moment earlier.
    assert "recv" in result and "timeout of 2s" in result, result


def _barrier_timeout(tmp_path, backend: str, first_world_timeout_s: float):
    procs, env = [], dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1", XLA_FLAGS="")
    for rank in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HELPERS, "gloo_parity_cases.py"), backend, str(tmp_path),
             str(first_world_timeout_s)], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=150)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        outs.append((proc.returncode, [line for line in out.splitlines() if line.startswith("RESULT")],
                     out[-3000:]))
    return outs


@pytest.mark.parametrize("first_world_timeout_s", [0, 16], ids=["fresh", "after_a_longer_world"])
def test_barrier_timing_out_on_one_rank_raises_there_and_both_exit_cleanly(tmp_path,
                                                                         first_world_timeout_s):
    """Group timeout 1 s; rank 0 alone enters the barrier. It raises (gloo: after the timeout;
    "tpu": after it, plus the grace in which timed-out ranks name absentees), both ranks destroy
    the group and exit 0: JAX's heartbeat and shutdown barrier no longer follow the 1 s timeout
    (they aborted the process). "after_a_longer_world": XLA keeps the first world's 16 s collective
    timeout, so the 1 s group enforces its own from the caller's side, and rank 1 waits in JAX's
    shutdown barrier until rank 0's barrier leaves XLA (a shutdown timeout of max(10, 1) s aborted
    it)."""
    for backend in ("gloo", "tpu"):
        (tmp_path / backend).mkdir()
        start = time.monotonic()
        (code0, lines0, out0), (code1, lines1, out1) = _barrier_timeout(
            tmp_path / backend, backend, first_world_timeout_s)
        assert (code0, code1) == (0, 0), (backend, out0, out1)
        assert lines1 == ["RESULT destroyed"], (backend, out1)
        assert lines0[-1] == "RESULT destroyed" and lines0[0].startswith("RESULT raised"), (backend, out0)
        seconds = float(lines0[0].split(" after ")[1].split("s:")[0])
        # gloo raises at once ("Connection closed by peer") where rank 1 destroyed without waiting
        earliest = 0.0 if (backend, first_world_timeout_s > 0) == ("gloo", True) else 0.9
        assert earliest <= seconds < 9, (backend, lines0[0])
        if backend == "tpu":
            assert "CollectiveTimeout" in lines0[0] and "timeout of 1s" in lines0[0], lines0[0]
        assert time.monotonic() - start < 100
