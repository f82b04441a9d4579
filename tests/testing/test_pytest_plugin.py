"""The pytest plugin (``@pytest.mark.tpudist``, ``tpudist_pool``), run through pytest's pytester:
a passing, a failing and a hanging test on real rank processes, and bad marker arguments."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest_plugins = ["pytester"]

_PASSING = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.tpudist(world_size=4, topology="v5p:2x2x1", timeout=120)
def test_all_reduce_matches_gloo(scale):
    from tpudist.process_group import topology
    assert str(topology()) == "v5p:2x2x1" and dist.get_world_size() == 4
    t = torch.arange(4, dtype=torch.float32) * (dist.get_rank() + 1) * scale
    ref = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(ref, group=dist.new_group(backend="gloo"))
    assert dist.get_backend() == "tpu" and torch.equal(t, ref), (t, ref)

@pytest.fixture
def scale():
    return 2.0

tpudist_pool_options = {"world_size": 2, "backend": "tpu"}

def rank_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()

def test_pool_fixture(tpudist_pool):
    assert tpudist_pool.world_size == 2
    assert tpudist_pool.run(rank_sum) == [3.0, 3.0]
    assert tpudist_pool.run(rank_sum) == [3.0, 3.0]  # the same ranks serve several runs
'''

_FAILING = '''
import pytest, torch.distributed as dist

@pytest.mark.tpudist(world_size=2, timeout=120)
def test_fails_on_rank_one():
    dist.barrier()
    if dist.get_rank() == 1:
        raise AssertionError("rank one saw " + "a wrong value")
'''

_HANGING = '''
import time, pytest, torch.distributed as dist

@pytest.mark.tpudist(world_size=2, backend=None, timeout=4)
def test_hangs():
    time.sleep(3600)
'''


def test_entry_point_names_the_plugin_module():
    (entry,) = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "tpudist"]
    assert entry.value == "tpudist.testing.pytest_plugin"


def test_plugin_loads_without_torch_or_jax(pytester):
    pytester.makepyfile(test_light='''
import sys
def test_light():
    assert "tpudist.testing.pytest_plugin" in sys.modules
    assert "jax" not in sys.modules and "torch" not in sys.modules
''')
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_passing_test_runs_on_every_rank_and_the_pool_fixture_serves_a_module(pytester):
    pytester.makepyfile(test_passing=_PASSING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_failing_rank_is_reported_with_its_traceback(pytester):
    pytester.makepyfile(test_failing=_FAILING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*tpudist: test_fails_on_rank_one failed on rank(s) [[]1[]] of 2 ranks*",
        "*----- rank 1 traceback -----*",
        "*Traceback (most recent call last):*",
        "*AssertionError: rank one saw a wrong value*",
    ])
    assert "----- rank 0 traceback" not in result.stdout.str()


def test_hanging_test_is_killed_at_its_timeout(pytester):
    pytester.makepyfile(test_hanging=_HANGING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*tpudist: test_hangs timed out on 2 ranks: ranks [[]0, 1[]] did not finish within "
        "timeout=4s and every rank was killed*"])
    assert result.duration < 60


@pytest.mark.parametrize("marker, error", [
    ("world_size=0", "world_size=0 must be an int >= 1"),
    ("timeout=-1", "timeout=-1 must be a positive number of seconds"),
    ("ranks=2", "unknown argument(s) ['ranks']; it takes world_size, topology, backend, timeout, env"),
    ("2", "takes keyword arguments only"),
])
def test_bad_marker_arguments_are_refused(pytester, marker, error):
    pytester.makepyfile(test_bad=f'''
import pytest
@pytest.mark.tpudist({marker})
def test_x():
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert error in result.stdout.str()


def test_a_pool_that_cannot_start_in_process_skips_the_test_with_its_reason(pytester, monkeypatch):
    monkeypatch.setenv("TPUDIST_POOL_START", "inprocess")
    pytester.makepyfile(test_in_process='''
import pytest

@pytest.mark.tpudist(world_size=2)
def test_marked():
    pass

def test_pool_fixture(tpudist_pool):
    pass

def test_plain():
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*needs rank processes*TPUDIST_POOL_START=inprocess*"])
