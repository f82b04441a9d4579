"""``TPUDIST_TEST_SHARD=i/n``: which slice of the collected tests a pytest run keeps (tests/conftest.py's hook;
scripts/chip_suite.sh's ``CHIP_SUITE_SHARD``)."""

from __future__ import annotations

import pytest


def shard_bounds(shard: str, count: int) -> tuple[int, int]:
    """``TPUDIST_TEST_SHARD="i/n"``: the [start, end) of the i-th of n contiguous, near-equal slices of
    ``count`` collected tests (contiguous, so a module's fixtures start once or twice, not per test)."""
    try:
        i, n = (int(part) for part in shard.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"TPUDIST_TEST_SHARD={shard!r} must be 'i/n' with 1 <= i <= n (e.g. '2/6': the "
                                "second sixth of the collected tests, in collection order)")
    return count * (i - 1) // n, count * i // n
