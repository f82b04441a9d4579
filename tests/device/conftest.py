"""Fixtures shared by the device tests."""

from __future__ import annotations

import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)


@pytest.fixture
def mode(request):
    """The eager mode named by the test's parameter (``indirect=True``), restored afterwards."""
    previous = torch.tpu.get_eager_mode()
    torch.tpu.set_eager_mode(request.param)
    yield request.param
    torch.tpu.set_eager_mode(previous)
