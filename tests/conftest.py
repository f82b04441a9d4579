import os

# Rank processes and this process share 2 cores: keep intra-op threads at one (FACTS.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402

from tpudist.testing import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def pool2():
    """Two "tpu" ranks shared by the tests of one module."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    """Four "tpu" ranks shared by the tests of one module."""
    with RankPool(4) as pool:
        yield pool


# The longest modules first (from `pytest --durations`): with `--dist worksteal` (pyproject) a
# worker that finishes early takes the other's short tests from the back of its queue, so the run
# does not end waiting on one long test started last.
_LONG_FIRST = ("test_upstream_c10d.py", "test_collectives.py", "test_device_dist.py", "test_compile_dist.py",
               "test_recovery.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.name
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: each module keeps its own order
