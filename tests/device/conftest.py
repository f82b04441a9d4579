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


@pytest.fixture
def fresh_caches(monkeypatch):
    """The device's kernel, site, program and growth caches empty for the test, as in a fresh process, and
    the process's own back afterwards. For tests that count what compiles at which step: a site another
    test of the process already saw compiles at other steps (``_core``'s automatic dynamic ints keep its
    first value as a constant or made it a runtime input; ``_grow`` remembers the first length a cat saw)."""
    from tpudist.device import _core, _execute, _fused, _grow

    kernels = {}
    monkeypatch.setattr(_core, "_KERNELS", kernels)
    monkeypatch.setattr(_execute, "_KERNELS", kernels)
    monkeypatch.setattr(_core, "_SITES", {})
    monkeypatch.setattr(_core, "_HINTS", {})
    monkeypatch.setattr(_core, "_num_generalised", 0)
    monkeypatch.setattr(_fused, "_PROGRAMS", {})
    # growing sequences: the first length a cat site saw, the lengths of its latest results, the arange ends
    for name in _grow.LEARNED:
        monkeypatch.setattr(_grow, name, type(getattr(_grow, name))())
