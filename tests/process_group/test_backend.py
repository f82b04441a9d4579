"""The "tpu" backend's contract beyond the data: registration, errors, re-init, async, caching."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

import rank_fns
from tpudist.testing import RankError, RankPool, run_command, run_ranks, torchrun_command


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, backend="tpu", timeout=120) as p:
        yield p


@pytest.mark.parametrize("kind,expected", [
    ("shape", ["rank 0 called all_reduce sum of 3 x float32 (#", "rank 1 called all_reduce sum of 4 x float32 (#"]),
    ("dtype", ["rank 0 called all_reduce sum of 4 x float32", "rank 1 called all_reduce sum of 4 x int32"]),
    ("reduce_op", ["rank 0 called all_reduce sum of 4 x float32", "rank 1 called all_reduce max of 4 x float32"]),
    ("op", ["rank 0 called all_reduce sum of 4 x float32", "rank 1 called broadcast of 4 x int32"]),
    ("all_to_all_splits", ["split sizes must agree"]),
    ("reduce_root", ["rank 0 called reduce sum to rank 0 of 4 x float32", "rank 1 called reduce sum to rank 1"]),
    ("gather_root", ["rank 0 called gather to rank 1 of 2 x int32", "rank 1 called gather to rank 0 of 2"]),
    # two groups with the same members (one XLA communicator), issued in opposite orders
    ("swapped_groups", ["on group {a})", "on group {b})"]),
])
def test_ranks_that_disagree_get_an_error_not_garbage(pool, kind, expected):
    results = pool.run(rank_fns.mismatched, kind)
    for outcome, after, fill in results:
        for text in expected:
            assert text.format(**fill) in outcome
        assert after == [2.0, 2.0]  # no data moved, and the group still works


@pytest.mark.parametrize("kind,expected", [
    ("meta_device", "ValueError: all_reduce: tensor is on device=meta; the tpu process group takes cpu "
                    "tensors and 'tpu' device tensors (import tpudist.device), all of one call on one device: "
                    "move it with .cpu() or .to('tpu')"),
    ("avg_int", "TypeError: all_reduce: reduce_op=AVG needs a floating or complex tensor, got "
                "dtype=torch.int32; use SUM and divide"),
    ("band_float", "TypeError: all_reduce: reduce_op=BAND needs an integer or bool tensor, got "
                   "dtype=torch.float32"),
    ("gather_list_dtype", "TypeError: all_gather: all tensors must have one dtype, got "
                          "dtypes=['torch.float32', 'torch.int64']"),
    ("gather_list_len", "needs a list of size=2 output tensors, got [1]"),
    ("reduce_scatter_size", "ValueError: reduce_scatter_tensor: input has 4 elements (shape (4,)) but 6 "
                            "are needed"),
    ("all_gather_coalesced_layout", "ValueError: all_gather_coalesced: output_tensor_lists must hold "
                                    "size=2 lists (one per rank), each with one tensor per input (1 "
                                    "inputs); got 1 lists of lengths [2]. output_tensor_lists[r][i] "
                                    "receives rank r's input i."),
    ("sparse_max", "ValueError: all_reduce: reduce_op=MAX is not supported for sparse tensors: allreduce "
                   "of sparse tensors only works with ReduceOp.SUM (as on gloo); reduce t.to_dense() "
                   "instead"),
    ("a2a_split_sum", "ValueError: all_to_all_single: input_split_sizes=[3, 3] must be 2 non-negative "
                      "sizes summing to input.shape[0]=4"),
])
def test_bad_input_is_refused_with_the_rule_and_the_values(pool, kind, expected):
    for outcome in pool.run(rank_fns.bad_input, kind):
        assert expected in outcome


def test_async_ops_complete_in_order_and_programs_are_cached(pool):
    for res in pool.run(rank_fns.async_and_cache):
        assert res["results"] == [0.0, 2.0, 4.0, 6.0]
        assert res["completed"] == [True] * 4
        assert res["fut"] == [2.0, 2.0, 2.0]
        assert res["new_programs"] == 1  # the 1000-element program is reused; only the 17-element one is new


def test_destroy_then_init_again_in_the_same_process(tmp_path):
    results = run_ranks(2, rank_fns.reinit_twice, str(tmp_path), backend=None, timeout=180)
    assert results == [[3.0, 3.0]] * 2


def test_ranks_get_chip_coordinates_of_the_emulated_topology():
    results = run_ranks(4, rank_fns.rank_topology, topology="v5p:2x2x1", timeout=180)
    assert results == [("v5p:2x2x1", c) for c in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]]


def test_a_topology_that_does_not_match_the_world_is_refused():
    with pytest.raises(RuntimeError, match="TPUDIST_TOPOLOGY=v5p:2x2x1 has 4 chips but the world has "
                                           "world_size=2 ranks: tpudist runs one rank per chip"):
        run_ranks(2, rank_fns.rank_topology, topology="v5p:2x2x1", timeout=120)


def test_monitored_barrier_names_the_missing_rank(pool):
    results = pool.run(rank_fns.monitored, 1)
    assert results[1] == "skipped"
    assert results[0].startswith("monitored_barrier: ranks [1] of group 0 did not arrive within 1.0s")


def test_backend_is_found_under_torchrun_without_importing_tpudist(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        dist.init_process_group("tpu")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        assert "tpudist" not in sys.argv
        print(f"rank {dist.get_rank()} sum {t.item()} backend {dist.get_backend()}", flush=True)
        dist.destroy_process_group()
    """))
    returncode, out = run_command(torchrun_command(2, str(script)), timeout=180)
    assert returncode == 0, out
    assert "rank 0 sum 3.0 backend tpu" in out and "rank 1 sum 3.0 backend tpu" in out


def test_64_bit_values_are_not_truncated(pool):
    for res in pool.run(rank_fns.wide_values):
        assert res["int64_max"] == [2**40 + 1, -(2**62)]
        assert res["float64_sum"] == 2.0 + 3 * 2.0**-40
        assert res["complex128_bcast"] == complex(1e-300, 2.0**-40)


def test_collectives_without_the_fingerprint_check(pool):
    for total, gathered in pool.run(rank_fns.unverified_collectives):
        assert total == [3.0] * 5
        assert gathered == [[0.0, 0.0], [1.0, 1.0]]


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    # init_process_group(timeout=10 s) sets XLA's collective timeout before its backend starts.
    with RankPool(3, backend=None, timeout=120, env={"XLA_FLAGS": ""}) as pool:
        pool.run(rank_fns.init_world, 10)
        results = pool.run(rank_fns.one_rank_absent, 2, 25)
    assert results[2] == "absent"
    for text in results[:2]:
        assert text.startswith("CollectiveTimeout after ")
        assert int(text.split()[2].rstrip("s:")) <= 10 + 5 + 5  # timeout + grace + slack
        assert "ranks [2] never reached it" in text


def test_a_killed_rank_makes_every_survivor_raise_naming_it():
    with RankPool(3, backend=None, timeout=120, env={"XLA_FLAGS": ""}) as pool:
        pool.run(rank_fns.init_world, 10)
        with pytest.raises(RankError) as info:
            pool.run(rank_fns.one_rank_killed, 2)
    assert list(info.value.failures) == [2] and "died" in info.value.failures[2]
    for rank in (0, 1):
        text = info.value.results[rank]
        assert text.startswith("CollectiveError after ")
        assert int(text.split()[2].rstrip("s:")) <= 10  # well within the 10 s group timeout
        assert "ranks [2] did not report (they died or hang)" in text


def test_split_group_works_where_torchs_refuses_cpu_backends():
    with RankPool(4) as pool:
        results = pool.run(rank_fns.split_groups)
    for rank, res in enumerate(results):
        half = [0, 1] if rank < 2 else [2, 3]
        expected = [i * (sum(half) + 2) for i in range(5)]
        for case, backend in (("halves", "tpu"), ("gloo", "gloo"), ("again", "tpu")):
            assert res[case] == (backend, half, True, expected), (rank, case)
        if rank == 0:
            assert "inner" not in res
        else:
            inner = [1, 3] if rank in (1, 3) else [2]
            assert res["inner"][:3] == ("tpu", inner, True), rank
        assert res["none"] == (rank >= 2), rank
        assert res["errors"] == [
            "split_group: split_ranks=[] must list at least one split, e.g. [[0, 1], [2, 3]]",
            "split_group: rank 1 is in split_ranks[0] and split_ranks[1]; splits must not overlap",
            "split_group: split_ranks[0]=[0, 4] holds rank 4, but the parent group's ranks are 0..3 "
            "(group ranks, not global)",
            "split_group: split_ranks[0]=[0, 0] lists a rank twice",
            "split_group: split_ranks[0] is empty; every split needs a rank",
        ]


def test_a_call_with_a_tpu_tensor_reaches_device_collectives_with_its_options(monkeypatch):
    """group.py's router, the one place that picks the device path: the device function gets the
    channel, the call's arguments in order and default options where the call gave none (omitted or
    by keyword); a call without a tpu tensor reaches the method (the host path) untouched."""
    import torch.distributed as dist

    from tpudist.process_group import group

    tpu, cpu = torch.zeros(1), torch.zeros(1)  # tpu stands in for a tpu tensor: dc.on_device is the check
    monkeypatch.setattr(group.dc, "on_device", lambda *args: any(t is tpu for a in args if isinstance(a, list)
                                                                 for t in a))
    got = []
    routed = group._route(lambda self, tensors, opts=None: ("host", tensors, opts),
                          lambda channel, *args: got.append((channel, *args)) or "device", dist.BroadcastOptions)
    owner = types.SimpleNamespace(channel="channel")
    opts = dist.BroadcastOptions()
    host = routed(owner, [cpu])
    assert host[0] == "host" and host[1][0] is cpu and host[2] is None
    assert routed(owner, [cpu], opts)[2] is opts
    assert [routed(owner, [tpu], opts), routed(owner, [tpu]), routed(owner, tensors=[tpu])] == ["device"] * 3
    assert [(channel, tensors[0] is tpu) for channel, tensors, _ in got] == [("channel", True)] * 3
    assert got[0][2] is opts and all(type(g[2]) is dist.BroadcastOptions and g[2] is not opts for g in got[1:])
    assert set(group.DEVICE_PATHS) <= set(vars(group.ProcessGroupTPU))
