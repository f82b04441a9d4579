"""``TPUDIST_TEST_SHARD=i/n``: which slice of the collected tests a pytest run keeps (tests/conftest.py's hook;
scripts/chip_suite.sh's ``CHIP_SUITE_SHARD``)."""

from __future__ import annotations

import pytest


def shard_bounds(shard: str, count: int) -> tuple[int, int]:
    """``TPUDIST_TEST_SHARD="i/n"``: the [start, end) of the i-th of n contiguous, near-equal slices of
    ``count`` collected tests (contiguous, so a module's fixtures start once or twice, not per test);
    ``"i-j/n"``: the i-th to the j-th of them, as one run (a chip command covers several slices)."""
    try:
        first, n = shard.split("/")
        i, j = (int(part) for part in first.split("-")) if "-" in first else (int(first),) * 2
        n = int(n)
    except ValueError:
        i = j = n = 0
    if not 1 <= i <= j <= n:
        raise pytest.UsageError(f"TPUDIST_TEST_SHARD={shard!r} must be 'i/n' with 1 <= i <= n, or 'i-j/n' with "
                                "1 <= i <= j <= n (e.g. '2/6': the second sixth of the collected tests, in "
                                "collection order; '2-3/6': the second and third)")
    return count * (i - 1) // n, count * j // n
