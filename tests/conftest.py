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
