"""Issue 15's latency levers keep the backend's contract: the gloo loop thread's scheduling (set,
switched per program, off switch, warnings instead of failures) and the small-op envelope
(ranks that disagree get CollectiveMismatch on every rank, and the group goes on working)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

import rank_fns_latency as fns
from tpudist.process_group import runtime
from tpudist.testing import RankPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling")


def test_loop_thread_is_idle_except_for_data_programs_over_the_bound(pool2):
    for res in pool2.run(fns.loop_policies):
        assert res["tid"] is not None and res["in_process"]
        assert res["after_small"] == os.SCHED_IDLE
        assert res["after_medium"] == os.SCHED_IDLE  # a data program of at most IDLE_DATA_BYTES
        assert res["after_large"] == os.SCHED_OTHER
        assert res["again"] == os.SCHED_IDLE
        assert res["forced"] == os.SCHED_OTHER
        assert res["results"] == [2.0] * 4
        assert res["idle_threads"] == [res["tid"]]  # that one thread, nothing else


def test_off_switch_leaves_every_thread_alone():
    with RankPool(2, env={"TPUDIST_GLOO_LOOP_IDLE": "0"}, timeout=120) as pool:
        for res in pool.run(fns.loop_policies):
            assert res["tid"] is None
            assert res["idle_threads"] == []
            assert res["results"] == [2.0] * 4


def test_no_loop_thread_found_warns_and_changes_nothing():
    loop = runtime.GlooLoop()
    with pytest.warns(RuntimeWarning, match="could not identify jaxlib's gloo loop thread"):
        loop.attach(runtime._thread_ids())  # noqa: SLF001 - no thread started since: none found
    assert loop.tid is None
    loop.idle(True)  # a no-op without a thread
    assert not loop.is_idle


def test_refused_policy_change_warns_and_detaches():
    loop = runtime.GlooLoop()
    loop.tid = 2**22 + 12345  # above pid_max: no such thread, the kernel refuses (ESRCH)
    with pytest.warns(RuntimeWarning, match="the kernel refused to set jaxlib's gloo loop thread"):
        loop.idle(True)
    assert loop.tid is None and not loop.is_idle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.idle(False)  # detached: no second warning


@pytest.mark.parametrize("kind,expected", [
    ("small_vs_small", ["rank 0 called all_reduce sum of 4 x float32", "rank 1 called all_gather of 4 x int32"]),
    ("small_vs_large", ["rank 0 called all_reduce sum of 1 x float32",
                        f"rank 1 called all_reduce sum of {fns.LARGE} x float32"]),
    ("at_the_edge", [f"rank 0 called all_reduce sum of {fns.LARGE - 1} x float32",
                     f"rank 1 called all_reduce sum of {fns.LARGE} x float32"]),
    ("barrier_vs_small", ["rank 0 called barrier of 1 x int32", "rank 1 called broadcast of 2 x int32"]),
    ("flat_vs_flat", ["rank 0 called all_reduce sum of 4 x float32", "rank 1 called all_reduce max of 4 x float32"]),
    ("flat_broadcast_vs_flat_all_to_all", [f"rank 0 called broadcast of {fns.LARGE * 2} x int32",
                                           f"rank 1 called all_to_all of {fns.LARGE * 2} x int32"]),
    ("flat_vs_general", ["rank 0 called all_reduce sum of 4 x float32", "rank 1 called all_reduce max of 4 x uint8"]),
])
def test_small_op_mismatch_raises_on_every_rank_and_the_group_stays_usable(pool2, kind, expected):
    for outcome, small, large in pool2.run(fns.mismatched_small, kind):
        assert outcome.startswith("CollectiveMismatch: "), outcome
        for text in expected:
            assert text in outcome
        assert small == [2.0, 2.0] and large == [2.0, 2.0]  # no data moved, and the group works


def test_flat_all_reduce_path_is_taken_where_it_applies_and_matches_the_general_path(pool2):
    """Sync, contiguous, non-bool all_reduces that fit the envelope run the flat path (small.py);
    the rest run the general path, with the same results and errors."""
    total = 1.0 + 2.0  # rank r contributes r + 1
    for out in pool2.run(fns.flat_all_reduce_edges):
        assert out["scalar"] == (total, 1)
        assert out["empty"] == ([], 1)
        assert out["payload"] == ([total] * (fns.LARGE - 1), 1)
        assert out["over"] == ([total] * fns.LARGE, 0)
        assert out["parameter"] == ([total] * 3, 1) and out["grad_fn"] == ([total] * 3, 1)
        message, flat_calls = out["int_avg"]
        assert message.startswith("TypeError: all_reduce: reduce_op=AVG needs a floating") and flat_calls == 0
        assert out["bool"] == ([True, False], 0)
        assert out["premul"] == ([6.0, 6.0], 0) and out["async"] == ([2.0, 2.0], 0)
        for dtype in ("torch.bfloat16", "torch.float16"):
            assert out[f"{dtype}_flat"][1] == 1 and out[f"{dtype}_general"][1] == 0
            assert out[f"{dtype}_same_bits"], out
        result, flat_calls = out["behind_async"]
        assert result == [total] * 2
        if out["rank"] == 0:  # its async call waited for rank 1: this one queued behind it
            assert flat_calls == 0
        assert out["big"] == [2.0, 2.0]
        assert out["subgroup"] == ([total] * 2, 1)
        data = out["data"]  # larger than the envelope: the flat path's data program
        assert data["sum"] == ([total] * fns.LARGE, 1)
        assert data["int max"] == ([5.0] * fns.LARGE, 1)
        assert data["premul"] == ([3.0 * total] * fns.LARGE, 1)
        assert data["bool"] == ([1.0] * fns.LARGE, 0) and data["async"] == ([total] * fns.LARGE, 0)
        message, flat_calls = data["int avg"]
        assert message.startswith("TypeError: all_reduce: reduce_op=AVG needs a floating") and flat_calls == 0
        assert data["bf16 flat"][1] == 1 and data["bf16 general"][1] == 0
        assert data["bf16 same bits"]


def test_flat_all_gather_and_reduce_scatter_paths_match_the_general_path(pool2):
    """Sync all_gather_into_tensor and reduce_scatter_tensor of contiguous CPU tensors (FSDP2's
    collectives) skip the general path's machinery; the rest, and their errors, are unchanged."""
    for out in pool2.run(fns.flat_gather_scatter_edges):
        assert out["ag 3"] == ([1.0] * 3 + [2.0] * 3, 1)
        assert out[f"ag {fns.LARGE}"] == ([1.0] * fns.LARGE + [2.0] * fns.LARGE, 1)
        assert out["ag in place bf16"] == ([1.0] * 3 + [2.0] * 3, 1)
        assert out["ag async"] == ([1.0] * 3 + [2.0] * 3, 0)
        assert out["ag strided output"] == ([1.0] * 3 + [2.0] * 3, 0)
        rank = out["rs 2"][0][0] != 1.0  # arange(4) + r summed over ranks: [1, 3, 5, 7], 2 each
        assert out["rs 2"] == ([5.0, 7.0] if rank else [1.0, 3.0], 1)
        large = [2.0 * (i + rank * fns.LARGE) + 1 for i in range(fns.LARGE)]
        assert out[f"rs {fns.LARGE}"] == (large, 1)
        assert out["rs max bf16"] == ([4.0, 6.0] if rank else [0.0, 2.0], 1)
        message, flat_calls = out["rs int avg"]
        assert message.startswith("TypeError: reduce_scatter_tensor: reduce_op=AVG needs a floating")
        assert flat_calls == 0
        assert out["rs bool"] == ([1.0, 0.0], 0)


def test_flat_broadcast_and_all_to_all_paths_match_the_general_path(pool2):
    """Sync broadcasts and even all_to_all_singles of contiguous CPU tensors skip the general
    path's machinery; the rest, and their errors, are unchanged."""
    for out in pool2.run(fns.flat_broadcast_all_to_all_edges):
        r = out["rank"]
        assert out["bc 3 from 0"] == ([1.0] * 3, 1)
        assert out["bc 3 from 1"] == ([11.0] * 3, 1)
        assert out[f"bc {fns.LARGE} from 1"] == ([11.0] * fns.LARGE, 1)
        assert out["bc torch.bfloat16"] == ([7.0, 8.0, 9.0, 10.0, 11.0], 1)
        assert out["bc torch.bool"] == ([1.0] * 5, 1)
        assert out["bc torch.complex64"] == ([7.0, 0.0, 8.0, 0.0, 9.0, 0.0, 10.0, 0.0, 11.0, 0.0], 1)
        assert out["bc async"] == ([1.0] * 3, 0) and out["bc strided"] == ([1.0] * 3, 0)
        assert out["bc parameter"] == ([1.0] * 2, 1)
        message, flat_calls = out["bc bad root"]
        assert "ValueError" in message and "not a rank of this group" in message and flat_calls == 0

        def expected(chunk):  # rank r receives chunk r of every rank's input, in rank order
            return [float(100 * src + r * chunk + i) for src in range(2) for i in range(chunk)]

        assert out["a2a 2"] == (expected(2), 1)
        assert out[f"a2a {fns.LARGE}"] == (expected(fns.LARGE), 1)
        assert out["a2a in place"] == (expected(2), 1)
        assert out["a2a 2-d bf16"][1] == 1
        assert sum(out["a2a 2-d bf16"][0], []) == expected(2)
        assert out["a2a splits"] == (expected(2), 0) and out["a2a async"] == (expected(2), 0)
        message, flat_calls = out["a2a uneven"]
        assert message.startswith("ValueError: all_to_all_single: without split sizes") and flat_calls == 0
        message, flat_calls = out["a2a dtypes"]
        assert message.startswith("ValueError") or message.startswith("TypeError"), message
        assert flat_calls == 0


def test_recurring_collectives_switch_to_one_program_with_the_same_results(pool2):
    """A data program every rank has run FUSE_AFTER times runs as one program from then on (the
    exchange at its head): the same results, on the flat and the general path, for every op with a
    data program, 64-bit types included."""
    for out in pool2.run(fns.recurring_collectives):
        for name, (wrong, fused) in out.items():
            assert wrong == [], (name, wrong)
            assert fused == 3, (name, fused)  # calls FUSE_AFTER .. FUSE_AFTER + 2


@pytest.mark.parametrize("kind,expected", [
    ("fused_vs_separate", [f"rank 1 called all_reduce sum of {fns.LARGE + 1} x float32"]),
    ("fused_vs_small", ["rank 1 called all_reduce sum of 1 x float32"]),
    ("fused_vs_fused", [f"rank 1 called all_reduce sum of {fns.LARGE + 5} x float32"]),
    ("fused_vs_barrier", ["rank 1 called barrier of 1 x int32"]),
])
def test_mismatch_with_a_recurring_collective_raises_on_every_rank(pool2, kind, expected):
    """A rank whose collective runs as one program and a rank issuing another collective (a new
    one, a small one, another recurring one, a barrier) both get CollectiveMismatch; no data moves
    and the group goes on working."""
    for outcome, after in pool2.run(fns.mismatched_recurring, kind):
        assert outcome.startswith("CollectiveMismatch: "), outcome
        assert f"rank 0 called all_reduce sum of {fns.LARGE} x float32" in outcome
        for text in expected:
            assert text in outcome
        assert after == [3.0, 3.0]
