"""Factories on the device against CPU eager: ``torch.logspace`` and integer ``torch.arange`` bit for bit, the
strides of ``*_like`` results, and ``new_*``/``*_like`` given another device.

``torch.logspace`` raised ``NoFunctionalTwin`` (its CompositeExplicit kernel calls ``logspace.out``, whose
functional twin, ``logspace.default``, has tensor options the out= form lacks). Integer ``arange`` with float
arguments took the float length and values (torch truncates start and step, and int64 also end, before
counting). ``zeros_like``/``empty_like`` of a transposed tensor came out contiguous, and ``x.new_empty(n,
device="cpu")`` of a tpu ``x`` came out on the device (DCP's async_save stages tensors so).
"""

from __future__ import annotations

import pytest

DEV_TIMEOUT = 600  # seconds a call in the worker may take (the ``dev`` fixture in conftest.py)
MODES = ["strict", "fused"]

LOGSPACE_DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64", "int16"]
LOGSPACE_RANGES = [(0, 2), (0.0, 1.0), (-1.5, 2.5), (2.0, -3.0), (-2.3, 1.9), (1, 1), (0.1, 3.7)]
LOGSPACE_LENGTHS = [0, 1, 2, 7, 50]
LOGSPACE_BASES = [10.0, 2.0, 0.1, 2.5]

ARANGE_DTYPES = ["int64", "int32", "int16", "int8", "uint8", "float32", "bfloat16", "float16"]
ARANGE_ARGS = [(5,), (0.5, 5.3, 1.1), (-3.7, 4.2, 0.9), (2.5, -4.0, -1.5), (0, 10, 3), (1.9, 7), (-2.5, 3.5, 1.0),
               (0.0, 1.0, 0.1), (-1, 8.5, 2.5), (3, -3, -1), (0.1, 2.9, 0.7)]


def logspace_mismatches(mode: str) -> list:
    """Every (dtype, length, range, base) whose device result is not CPU's, bit for bit."""
    import torch

    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    bad = []
    for name in LOGSPACE_DTYPES:
        dtype = getattr(torch, name)
        for steps in LOGSPACE_LENGTHS:
            for start, end in LOGSPACE_RANGES:
                for base in LOGSPACE_BASES:
                    want = torch.logspace(start, end, steps, base=base, dtype=dtype)
                    got = torch.logspace(start, end, steps, base=base, dtype=dtype, device="tpu").cpu()
                    if got.dtype != want.dtype or not torch.equal(got, want):
                        bad.append((name, steps, start, end, base))
    for name in ("float32", "int64", "bfloat16"):  # the out= form computes in its out tensor's dtype
        dtype = getattr(torch, name)
        out = torch.empty(7, device="tpu", dtype=dtype)
        torch.logspace(-1.5, 2.5, 7, base=2.0, out=out)
        if not torch.equal(out.cpu(), torch.logspace(-1.5, 2.5, 7, base=2.0, dtype=dtype)):
            bad.append(("out", name))
    want = torch.logspace(-1, 2, 9, base=3.0, dtype=torch.complex64)  # complex: torch's own rounding is not kept
    got = torch.logspace(-1, 2, 9, base=3.0, dtype=torch.complex64, device="tpu").cpu()
    if not torch.allclose(got, want, rtol=1e-6, atol=0):
        bad.append(("complex64", (got - want).abs().max().item()))
    return bad


def arange_mismatches(mode: str) -> list:
    """Every (dtype, arguments) whose device result (or error) is not CPU's."""
    import torch

    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    bad = []
    for name in ARANGE_DTYPES:
        dtype = getattr(torch, name)
        for args in ARANGE_ARGS:
            try:
                want = torch.arange(*args, dtype=dtype)
            except ValueError as e:  # an int64 step that truncates to 0
                with pytest.raises(ValueError) as raised:
                    torch.arange(*args, dtype=dtype, device="tpu")
                if str(raised.value) != str(e):
                    bad.append((name, args, str(e), str(raised.value)))
                continue
            got = torch.arange(*args, dtype=dtype, device="tpu").cpu()
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                bad.append((name, args, want.tolist(), got.tolist()))
    for args in [(0, 5, -1), (5, 0, 1), (0.0, float("inf")), (0, 1, 0)]:  # torch's errors, now from the lowering
        with pytest.raises(RuntimeError) as cpu:
            torch.arange(*args)
        with pytest.raises(RuntimeError) as device:
            torch.arange(*args, device="tpu")
        if str(device.value).split(":")[0] != str(cpu.value).split(":")[0]:
            bad.append((args, str(cpu.value), str(device.value)))
    return bad


@pytest.mark.parametrize("mode", MODES)
def test_logspace_equals_cpu(dev, mode):
    assert dev(logspace_mismatches, mode) == []


@pytest.mark.parametrize("mode", MODES)
def test_integer_arange_with_float_arguments_equals_cpu(dev, mode):
    """float64 is left out: torch's CPU kernel rounds it as its vector width and FMA make it (AVX512 here: one
    element of (-3.7, 4.2, 0.9) is an ulp from start + i * step)."""
    assert dev(arange_mismatches, mode) == []


def like_results(mode: str) -> dict:
    """(strides, values, device) of ``*_like``/``new_*`` results on the device and on CPU, per case."""
    import torch

    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    base = torch.arange(24.0).reshape(2, 3, 4)
    inputs = {"transposed": lambda t: t.transpose(0, 2), "permuted": lambda t: t.permute(1, 2, 0),
              "sliced": lambda t: t[:, 1:], "contiguous": lambda t: t}
    ops = {"zeros_like": torch.zeros_like, "empty_like": lambda t: torch.empty_like(t).zero_(),
           "ones_like": torch.ones_like, "full_like": lambda t: torch.full_like(t, 2.5),
           "zeros_like_contiguous": lambda t: torch.zeros_like(t, memory_format=torch.contiguous_format),
           "rand_like": lambda t: torch.rand_like(t).zero_()}
    out = {}
    for (input_name, view), (op_name, op) in ((i, o) for i in inputs.items() for o in ops.items()):
        got, want = op(view(base.to("tpu"))), op(view(base))
        out[input_name, op_name] = ((got.stride(), got.cpu().tolist(), got.device.type),
                                    (want.stride(), want.tolist(), "tpu"))
    x = base.to("tpu")
    for name, make in {"new_empty": lambda t: t.new_empty((2, 5), device="cpu").shape,
                       "new_zeros": lambda t: t.new_zeros((2, 5), device="cpu").tolist(),
                       "new_ones": lambda t: t.new_ones((3,), device="cpu", dtype=torch.int32).tolist(),
                       "new_full": lambda t: t.new_full((3,), 7.0, device="cpu").tolist(),
                       "zeros_like": lambda t: (torch.zeros_like(t.transpose(0, 2), device="cpu").stride(),
                                                torch.zeros_like(t, device="cpu").tolist()),
                       "empty_like": lambda t: torch.empty_like(t.transpose(0, 2), device="cpu").stride()}.items():
        result = make(x)
        device = {"new_empty": x.new_empty((2, 5), device="cpu"), "new_zeros": x.new_zeros(1, device="cpu"),
                  "zeros_like": torch.zeros_like(x, device="cpu")}.get(name)
        out["cpu", name] = ((result, None if device is None else device.device.type),
                            (make(base), None if device is None else "cpu"))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_like_results_keep_strides_and_other_devices_as_cpu(dev, mode):
    for case, (got, want) in dev(like_results, mode).items():
        assert got == want, case
