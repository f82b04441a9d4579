"""``TPUDIST_TEST_SHARD=i/n`` (tests/conftest.py; scripts/chip_suite.sh's ``CHIP_SUITE_SHARD``): the i-th of n
contiguous slices of the collected tests; ``i-j/n`` the i-th to the j-th."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from shards import shard_bounds  # tests/helpers

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests/compile/test_compile_losses.py"


def test_shards_are_contiguous_near_equal_and_cover_everything():
    for count in (0, 1, 5, 63, 1835):
        for n in (1, 2, 3, 7, 40):
            bounds = [shard_bounds(f"{i}/{n}", count) for i in range(1, n + 1)]
            assert bounds[0][0] == 0 and bounds[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [end - start for start, end in bounds]
            assert max(sizes) - min(sizes) <= 1, (count, n, sizes)


def test_a_range_of_shards_is_their_union():
    for count in (0, 7, 1835):
        assert shard_bounds("3-5/40", count) == (shard_bounds("3/40", count)[0], shard_bounds("5/40", count)[1])
        assert shard_bounds("1-40/40", count) == (0, count) and shard_bounds("4-4/9", count) == shard_bounds("4/9", count)


@pytest.mark.parametrize("bad", ["3/2", "0/4", "two/6", "1", "3-2/6", "2-7/6", "1-/4"])
def test_a_bad_shard_is_refused_with_the_rule(bad):
    with pytest.raises(pytest.UsageError, match=rf"TPUDIST_TEST_SHARD='{bad}' must be 'i/n' with 1 <= i <= n"):
        shard_bounds(bad, 10)


def test_pytest_runs_only_the_shard():
    """The hook itself, in a pytest of its own: the second third of a module's tests, in order."""
    def collect(shard):
        env = {k: v for k, v in os.environ.items() if k != "TPUDIST_TEST_SHARD"}
        if shard:
            env["TPUDIST_TEST_SHARD"] = shard
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-p", "no:xdist", MODULE], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return [line for line in done.stdout.splitlines() if "::" in line]

    everything, second = collect(None), collect("2/3")
    start, end = shard_bounds("2/3", len(everything))
    assert len(everything) > 10 and second == everything[start:end]
