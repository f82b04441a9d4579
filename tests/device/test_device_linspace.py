"""``torch.linspace`` on the device against CPU, bit for bit.

It raised ``TracerArrayConversionError`` for float endpoints (Python floats are program inputs on the device,
and the lowering computed with numpy), so ``torch.linspace(0.0, 1.0, n, device="tpu")`` failed in every
mode. The values follow torch's CPU kernel: the step in the result's dtype, the second half counted down
from ``end``, float32 through one fused multiply-add, 16-bit floats rounded after every operation.
"""

from __future__ import annotations

import pytest

DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64"]
RANGES = [(0.0, 1.0), (0, 10), (-1.5, 2.5), (2.0, -3.0), (-7.3, 9.9), (3, 3), (1e-3, 123.456)]
LENGTHS = [0, 1, 2, 7, 100, 1001]

DEV_TIMEOUT = 600  # seconds a call in the worker may take (the ``dev`` fixture in conftest.py)


def _grid_mismatches(lengths) -> list:
    """Every (dtype, length, range) whose device result is not CPU's, with how many elements differ."""
    import torch

    bad = []
    for name in DTYPES:
        dtype = getattr(torch, name)
        for steps in lengths:
            for start, end in RANGES:
                want = torch.linspace(start, end, steps, dtype=dtype)
                got = torch.linspace(start, end, steps, dtype=dtype, device="tpu").cpu()
                if got.dtype != want.dtype or not torch.equal(got, want):
                    bad.append((name, steps, start, end, int((got != want).sum())))
    return bad


def linspace_mismatches(mode: str) -> list:
    """``_grid_mismatches`` over ``LENGTHS``, and a traced endpoint reused."""
    import torch

    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    bad = _grid_mismatches(LENGTHS)
    # a traced endpoint reused with other values compiles nothing new and stays exact
    for start in (0.25, -4.5):
        want = torch.linspace(start, 1.0, 50)
        got = torch.linspace(start, 1.0, 50, device="tpu").cpu()
        if not torch.equal(got, want):
            bad.append(("float32", 50, start, 1.0, int((got != want).sum())))
    return bad


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_linspace_equals_cpu(dev, mode):
    assert dev(linspace_mismatches, mode) == []


def linspace_mismatches_on_host(mode: str) -> tuple:
    """``linspace_mismatches`` with the real results computed on the host, as on a TPU
    (``factories.LINSPACE_ON_HOST``), at lengths no other test builds a kernel for; and how often the
    host computed them."""
    import torch

    import tpudist.device  # noqa: F401
    from tpudist.ops.lowerings import factories

    torch.tpu.set_eager_mode(mode)
    platforms, on_host, calls = factories.LINSPACE_ON_HOST, factories._linspace_on_host, []
    factories.LINSPACE_ON_HOST = ("cpu", "tpu")
    factories._linspace_on_host = lambda *a: (calls.append(a), on_host(*a))[1]
    try:
        return _grid_mismatches((3, 13, 501)), len(calls)
    finally:
        factories.LINSPACE_ON_HOST, factories._linspace_on_host = platforms, on_host


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_linspace_on_the_host_equals_cpu(dev, mode):
    bad, host_calls = dev(linspace_mismatches_on_host, mode)
    assert bad == []
    assert host_calls >= len(DTYPES) * 3 * len(RANGES)
