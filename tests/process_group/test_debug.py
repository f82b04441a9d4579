"""Debug mode DETAIL: a store-based cross-rank check before every collective of every group."""

from __future__ import annotations

import re

import pytest
import rank_fns_debug as fns

from tpudist.process_group.debug import Call, debug_level
from tpudist.process_group.keys import ProgramKey
from tpudist.testing import RankPool


# -- pure: the level and the call record --------------------------------------------------------
@pytest.mark.parametrize("environ,level", [
    ({}, "OFF"),
    ({"TPUDIST_DEBUG": "DETAIL"}, "DETAIL"),
    ({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "DETAIL"),  # torch's switch is honoured
    ({"TORCH_DISTRIBUTED_DEBUG": "detail"}, "DETAIL"),
    ({"TPUDIST_DEBUG": "OFF", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "OFF"),  # ours wins
    ({"TPUDIST_DEBUG": "", "TORCH_DISTRIBUTED_DEBUG": "INFO"}, "INFO"),
])
def test_debug_level_comes_from_tpudist_debug_then_torch_distributed_debug(environ, level):
    assert debug_level(environ) == level


def test_a_debug_level_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=re.escape("TPUDIST_DEBUG='LOUD' is not a debug level: use one "
                                                   "of OFF, INFO, DETAIL")):
        debug_level({"TPUDIST_DEBUG": "LOUD"})


def test_a_call_goes_through_the_store_and_reads_well():
    key = ProgramKey("broadcast", (2, 4), "int32", (0, 1), None, (1,))
    call = Call.of("broadcast", key, "3", 7)
    assert Call.decode(call.encode()) == call
    assert str(call) == "broadcast(shape=(2, 4), dtype=int32, src=1) as #7 on group 3"
    send = Call.of("send", ProgramKey("permute", (2,), "int32", (0, 1), None, ((0, 1),)), "0", 1)
    recv = Call.of("recv", ProgramKey("permute", (2,), "int32", (0, 1), None, ((0, 1),)), "0", 1)
    back = Call.of("recv", ProgramKey("permute", (2,), "int32", (0, 1), None, ((1, 0),)), "0", 1)
    assert send.agrees_with(recv) and not send.agrees_with(back)
    assert str(send) == "send via permute(shape=(2,), dtype=int32, pairs=[(0, 1)]) as #1 on group 0"
    assert not call.agrees_with(Call.of("broadcast", key, "3", 8))  # the sequence number counts


# -- real ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def detail3():
    with RankPool(3, env={"TPUDIST_DEBUG": "DETAIL"}, timeout=300) as pool:
        yield pool


_CALL = "rank {r} called {what} as #"
# kind -> what group ranks 0 and 1 called ({root} is the group's rank 0, as a global rank)
_EXPECTED = {
    "shape": ["all_reduce(shape=(3,), dtype=float32, reduce_op=SUM)",
              "all_reduce(shape=(4,), dtype=float32, reduce_op=SUM)"],
    "dtype": ["all_reduce(shape=(4,), dtype=float32, reduce_op=SUM)",
              "all_reduce(shape=(4,), dtype=int32, reduce_op=SUM)"],
    "reduce_op": ["all_reduce(shape=(4,), dtype=float32, reduce_op=SUM)",
                  "all_reduce(shape=(4,), dtype=float32, reduce_op=MAX)"],
    "op": ["all_reduce(shape=(4,), dtype=float32, reduce_op=SUM)",
           "broadcast(shape=(4,), dtype=int32, src=0)"],
    "skipped": ["all_reduce(shape=(4,), dtype=float32, reduce_op=SUM)",
                "all_reduce(shape=(4,), dtype=float32, reduce_op=SUM)"],
    "reduce_root": ["reduce via all_reduce(shape=(4,), dtype=float32, reduce_op=SUM, dst=0)",
                    "reduce via all_reduce(shape=(4,), dtype=float32, reduce_op=SUM, dst=1)"],
    "gather_vs_all_gather": ["gather via all_gather(shape=(4,), dtype=int32, dst=0)",
                             "all_gather(shape=(4,), dtype=int32)"],
    "p2p_shape": ["send via permute(shape=(2,), dtype=int32, pairs=[(0, 1)])",
                  "recv via permute(shape=(3,), dtype=int32, pairs=[(0, 1)])"],
}


@pytest.mark.parametrize("which", ["world", "sub"])
@pytest.mark.parametrize("kind", list(_EXPECTED))
def test_ranks_that_disagree_all_raise_naming_each_call(detail3, kind, which):
    results = detail3.run(fns.mismatched, kind, which)
    members = list(range(3)) if which == "world" else fns.SUB_RANKS
    involved = members[:2] if kind == "p2p_shape" else members
    for rank, (outcome, after, names) in enumerate(results):
        assert after == [9.0, 9.0] if which == "world" else [5.0, 5.0]  # both groups still work
        if rank not in involved:
            continue
        assert outcome.startswith("CollectiveMismatch: "), outcome
        assert "TPUDIST_DEBUG=DETAIL: global ranks" in outcome
        for r, what in zip(involved, _EXPECTED[kind]):
            assert _CALL.format(r=r, what=what) in outcome, outcome
        assert "Every rank of a group must issue the same collectives, with the same shapes, dtypes, " \
               "reduce ops and roots, in the same order" in outcome
        assert "No data was exchanged; the group remains usable." in outcome
        if kind == "skipped":  # the same call on both sides: only the group and its count differ
            assert re.search(rf"rank {involved[0]} called [^;]* on group {names['twin']};", outcome)
            assert re.search(rf"rank {involved[1]} called [^;]* on group {names['group']}[;.]", outcome)
            assert "a rank skipped or added a collective" in outcome
        else:
            assert f"on group {names['group']}" in outcome


def test_every_kind_of_program_runs_correctly_under_detail(detail3):
    for r, out in enumerate(detail3.run(fns.every_op)):
        assert out["all_reduce"] == [6.0] * 3
        assert out["all_gather"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert out["all_to_all"] == [0.0] + [1.0] * 2 + [2.0] * 3  # uneven: rank j sent j + 1
        assert out["broadcast"] == [2.0, 2.0]
        assert out["ring"] == [float((r - 1) % 3)] * 2


def test_detail_store_keys_stay_bounded(detail3):
    for last, alive in detail3.run(fns.keys_left, 20):
        assert last >= 20
        assert alive == [last]  # my key of each earlier call is gone


def test_detail_uses_the_store_per_call_and_the_default_mode_does_not(detail3, pool3_default):
    calls = 10
    for rank, traffic in enumerate(detail3.run(fns.store_traffic, calls)):
        programs = calls * (2 if rank in fns.SUB_RANKS else 1)
        assert traffic.get("set", 0) == programs and traffic.get("wait", 0) == programs
    assert pool3_default.run(fns.store_traffic, calls) == [{}, {}, {}]


@pytest.fixture(scope="module")
def pool3_default():
    with RankPool(3, timeout=300) as pool:
        yield pool


def test_torch_distributed_debug_detail_is_honoured():
    with RankPool(2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=300) as pool:
        results = pool.run(fns.mismatched, "shape", "world")
    for outcome, after, _ in results:
        assert "TPUDIST_DEBUG=DETAIL: global ranks [0, 1] are about to run different collectives" in outcome
        assert after == [4.0, 4.0]


def test_a_rank_that_never_arrives_is_named_within_the_group_timeout():
    timeout_s = 5.0
    with RankPool(3, backend=None, env={"TPUDIST_DEBUG": "DETAIL", "XLA_FLAGS": ""}, timeout=120) as pool:
        pool.run(fns.init_world, timeout_s)
        results = pool.run(fns.one_rank_absent, 2, timeout_s + 6)
    assert results[2] == "absent"
    for text, elapsed in results[:2]:
        assert text.startswith("CollectiveTimeout: "), text
        assert timeout_s - 0.5 <= elapsed <= timeout_s + 2.0  # the store wait is the group timeout
        assert "TPUDIST_DEBUG=DETAIL: global ranks [2] did not reach all_reduce(shape=(3,), " \
               "dtype=float32, reduce_op=SUM) as #" in text
        assert "their last call over global ranks [0, 1, 2] was: rank 2: barrier(shape=(1,), " \
               "dtype=int32) as #1 on group (unnamed)" in text  # the world's creation barrier
