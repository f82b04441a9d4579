"""Every collective on the "tpu" backend against the same call on torch's gloo backend."""

from __future__ import annotations

import pytest

import collective_cases as cc
from tpudist.testing import RankPool


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def pool(request):
    with RankPool(request.param, backend="tpu", timeout=300) as p:
        yield p


def _specs(pool):
    return [None, (0, pool.world_size - 1)] + ([(1, 2, 3), (3, 1)] if pool.world_size >= 4 else [])


# "envelope": small collectives finish in the rows exchange every program starts with (the default);
# "full": every op runs its full XLA lowering. Both must match gloo.
PATHS = pytest.mark.parametrize("path", ["envelope", "full"])


def _run(pool, path, fn, *args):
    return pool.run(cc.on_path, path == "envelope", fn, *args)


def _check(results, pool):
    problems = [p for rank_problems in results for p in rank_problems]
    if problems:
        pool.close(graceful=False)  # a failed collective can poison the communicators
    assert not problems, "\n".join(problems[:20])


@PATHS
def test_all_reduce_world_every_op_and_dtype(pool, path):
    _check(_run(pool, path, cc.case_all_reduce, None), pool)


@PATHS
def test_all_reduce_subgroups(pool, path):
    for spec in _specs(pool)[1:]:
        _check(_run(pool, path, cc.case_all_reduce, spec, ["SUM", "MAX", "PRODUCT", "BXOR"],
                        [cc.torch.float32, cc.torch.int64, cc.torch.bool]), pool)


@pytest.mark.parametrize("case", ["broadcast_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                  "gather_scatter", "point_to_point", "objects_and_misc"])
@PATHS
def test_collective_every_dtype_world_and_subgroups(pool, case, path):
    fn = getattr(cc, f"case_{case}")
    for spec in _specs(pool):
        _check(_run(pool, path, fn, spec), pool)
