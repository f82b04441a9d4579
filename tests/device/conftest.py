"""Fixtures shared by the device tests."""

from __future__ import annotations

import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.testing import RankPool


@pytest.fixture
def mode(request):
    """The eager mode named by the test's parameter (``indirect=True``), restored afterwards."""
    previous = torch.tpu.get_eager_mode()
    torch.tpu.set_eager_mode(request.param)
    yield request.param
    torch.tpu.set_eager_mode(previous)


@pytest.fixture(scope="module")
def dev(request):
    """One strict-mode worker process for a module's tests: ``dev(fn, *args, **kwargs)`` runs the module-level
    ``fn`` there and returns its result. A module sets ``DEV_TIMEOUT`` (seconds a call may take; default 300).
    (Older modules define their own ``dev``, which takes precedence.)"""
    timeout = getattr(request.module, "DEV_TIMEOUT", 300)
    with RankPool(1, backend=None, timeout=timeout, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]
