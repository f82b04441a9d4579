"""The soak: seeded random collective sequences on the "tpu" backend, checked bit for bit against gloo
and a local reference. Plans are values (tested here without processes); runs use 4 and 2 ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tpudist.testing import RankPool, run_command
from tpudist.testing.soak import OPS, Call, _diff, _fold, gloo_can, group_specs, make_plan, run_plan

REPO = Path(__file__).resolve().parents[2]


# -- plans: pure values ------------------------------------------------------------------------------
def test_plan_is_deterministic_per_seed_and_varies_across_seeds():
    assert make_plan(7, 4, 300) == make_plan(7, 4, 300)
    assert make_plan(7, 4, 300) != make_plan(8, 4, 300)
    assert make_plan(7, 4, 300)[:50] == make_plan(7, 4, 50)  # a prefix replays a shorter soak
    assert make_plan(7, 4, 100) != make_plan(7, 2, 100)


def test_plan_covers_every_op_group_and_async_batches():
    plan = make_plan(1, 4, 600)
    assert {c.op for c in plan} == set(OPS)
    assert {c.group for c in plan} == set(range(len(group_specs(4))))
    assert {c.reduce_op for c in plan} >= {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR",
                                           "PREMUL_SUM"}
    assert {c.shape for c in plan} >= {(), (0,), (0, 3)}
    assert any(a.async_op and b.async_op for a, b in zip(plan, plan[1:]))
    assert not any(c.async_op for c in plan if c.op in ("send_recv", "ring", "barrier"))
    assert any(gloo_can(c) for c in plan) and not all(gloo_can(c) for c in plan)
    sizes = [len(s) for s in group_specs(4)]
    for c in plan:
        assert c.root is None or 0 <= c.root < sizes[c.group], c
        assert c.op not in ("send_recv", "ring") or sizes[c.group] >= 2, c


def test_call_prints_and_round_trips():
    call = make_plan(3, 4, 1)[0]
    assert eval(repr(call), {"Call": Call}) == call  # noqa: S307 - our own repr
    assert str(Call("all_reduce", 2, "int8", (2, 3), reduce_op="BXOR", async_op=True, index=9)) == \
        "all_reduce[g2] int8[2, 3] reduce=BXOR async #9"
    assert group_specs(4) == ((0, 1, 2, 3), (0, 3), (0, 3), (3,), (1, 2, 3), (1, 3))


def test_gloo_limits_are_routed_to_the_reference():
    assert not gloo_can(Call("all_reduce", 0, "int16", (5,), reduce_op="SUM"))
    assert not gloo_can(Call("all_reduce", 0, "float32", (5,), reduce_op="AVG"))
    assert not gloo_can(Call("all_gather_uneven", 0, "float32", (2, 3), splits=((1, 0, 2, 1),)))
    assert gloo_can(Call("all_to_all_single_uneven", 0, "int64", (2, 3), splits=((1, 2), (0, 1))))


def test_comparison_is_bitwise():
    assert _diff([torch.tensor([0.0])], [torch.tensor([-0.0])]) is not None  # sign of zero
    assert _diff([torch.tensor([1], dtype=torch.int32)], [torch.tensor([1], dtype=torch.int64)]) is not None
    assert _diff([torch.zeros(0, 3)], [torch.zeros(3, 0)]) is not None
    assert _diff([torch.tensor(2.0)], [torch.tensor(2.0)]) is None
    ints = [torch.tensor([3, -2], dtype=torch.int8), torch.tensor([1, 2], dtype=torch.int8)]
    assert _fold(ints, "BXOR").tolist() == [2, -4] and _fold(ints, "PRODUCT").tolist() == [3, -4]
    flags = [torch.tensor([True, False]), torch.tensor([True, True])]
    assert _fold(flags, "SUM").tolist() == [True, True] and _fold(flags, "MIN").tolist() == [True, False]


# -- runs: 4 ranks in a pool, 2 ranks through the command line ---------------------------------------
@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, backend="tpu", timeout=100) as pool:
        yield pool


def test_soak_4_ranks_no_mismatch(pool4):
    reports = pool4.run(run_plan, 1, 300)
    assert [r.calls for r in reports] == [300] * 4
    assert all(r.gloo_checked > 20 for r in reports), reports
    mismatches = [m for r in reports for m in r.mismatches]
    assert not mismatches, "\n".join(mismatches[:20])


def crossed_order(backend: str):
    """Two groups with the same members; their first ranks issue all_reduces on them in opposite
    orders (legal in c10d when async). Returns the results, or the error each rank raised."""
    import torch.distributed as dist

    n, me = dist.get_world_size(), dist.get_rank()
    first, second = (dist.new_group([0, n - 1], backend=backend) for _ in range(2))
    if me not in (0, n - 1):
        return None
    a, b = torch.tensor([1.0 if me == 0 else 2.0]), torch.tensor([10.0 if me == 0 else 20.0])
    order = [(a, first), (b, second)] if me == 0 else [(b, second), (a, first)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t, g in order]
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        return type(e).__name__
    return a.item(), b.item()


def test_groups_sharing_members_never_cross_silently(pool4):
    """FACTS.md hazard: such groups share one XLA communicator. gloo gets the crossed order right; the
    tpu backend must then raise on both ranks (CollectiveMismatch), never return crossed sums."""
    gloo, tpu = pool4.run(crossed_order, "gloo"), pool4.run(crossed_order, "tpu")
    pool4.close(graceful=False)  # the mismatch leaves the pair's communicator unusable
    assert gloo[0] == gloo[3] == (3.0, 30.0)  # crossed would be 21.0 / 12.0
    assert tpu[0] == tpu[3] == "CollectiveMismatch", tpu


def test_soak_command_2_ranks():
    command = [sys.executable, "-m", "tpudist", "soak", "--ranks", "2", "--calls", "200", "--seed", "2",
               "--chunk", "100", "--timeout", "60"]
    returncode, out = run_command(command, cwd=REPO, timeout=150)
    assert returncode == 0, out[-4000:]
    assert "calls 200/200:" in out and "mismatches 0" in out and "MISMATCH" not in out, out[-4000:]
    assert "calls/s" in out
