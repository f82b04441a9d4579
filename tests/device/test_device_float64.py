"""float64 on a TPU: XLA emulates it with pairs of float32, so the device warns once per process when a
float64 (or complex128) value is first put on or made on a chip, and the chip test checks the limits
docs/device.md states (measured on a TPU v5e with scripts/probes/f64_in_range.py).

The warning tests run anywhere (the platform check is patched); the chip test skips elsewhere.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.device import _storage

ON_TPU = jax.devices()[0].platform == "tpu"


@pytest.fixture
def chip(monkeypatch):
    """The device as if it were a TPU (the check only), with the once-per-process warning not yet shown."""
    monkeypatch.setattr(_storage, "_on_tpu", lambda: True)
    monkeypatch.setattr(_storage, "_warned_float64", [False])


def _caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "float64 on a TPU" in str(w.message)]


@pytest.mark.parametrize("how", ["copy", "factory", "cast", "complex128"])
def test_float64_on_a_tpu_warns_once(chip, how):
    x = torch.randn(11, 3, 5)  # kernels warn when they are built: shapes no other test makes
    make = {
        "copy": lambda: x.double().to("tpu"),
        "factory": lambda: torch.zeros(13, 5, 3, dtype=torch.float64, device="tpu"),
        "cast": lambda: x.to("tpu").mul(3).to(torch.float64).add(1).cpu(),
        "complex128": lambda: torch.randn(2, dtype=torch.complex128).to("tpu"),
    }[how]
    first = _caught(make)
    assert len(first) == 1, first
    assert "pairs of float32" in first[0] and "(|x| > 3.4e38) become inf" in first[0] and "on the CPU" in first[0]
    assert _caught(make) == []  # once per process
    assert _caught(lambda: torch.ones(2, dtype=torch.float64, device="tpu")) == []


def test_other_dtypes_and_other_platforms_do_not_warn(monkeypatch, chip):
    assert _caught(lambda: (torch.randn(3).to("tpu") * 2, torch.arange(4, device="tpu"),
                            torch.randn(2, dtype=torch.complex64).to("tpu"), torch.randn(2).half().to("tpu"))) == []
    monkeypatch.setattr(_storage, "_on_tpu", lambda: False)
    assert _caught(lambda: (torch.randn(3).double().to("tpu"), torch.zeros(6, 7, dtype=torch.float64,
                                                                            device="tpu"))) == []
    assert _storage._warned_float64 == [False]  # noqa: SLF001


@pytest.mark.skipif(not ON_TPU, reason=f"needs a TPU chip; JAX's first device is {jax.devices()[0].platform}")
def test_float64_limits_on_the_chip():
    """What docs/device.md says of float64 on a TPU: values inside float32's range come back within
    2**-40 relative (not bit for bit), beyond it inf, -0.0 as 0.0; float32 and int64 copies are exact."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(20000) * 10.0 ** rng.uniform(-30, 30, 20000))
    back = x.to("tpu").cpu()
    rel = ((back - x).abs() / x.abs()).max().item()
    assert rel < 2.0**-40, rel
    edges = torch.tensor([3.5e38, -1e300, -0.0], dtype=torch.float64).to("tpu").cpu()
    assert edges[0] == float("inf") and edges[1] == float("-inf") and not edges[2].signbit()
    f32 = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    assert torch.equal(f32.to("tpu").cpu(), f32)
    ints = torch.from_numpy(rng.integers(-2**62, 2**62, 1000))
    assert torch.equal(ints.to("tpu").cpu(), ints)


@pytest.mark.skipif(not ON_TPU, reason=f"needs a TPU chip; JAX's first device is {jax.devices()[0].platform}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128, torch.int64])
def test_64_bit_products_on_the_chip(dtype):
    """mm, bmm, matmul and addmm in 64-bit dtypes compile on the chip (XLA:TPU has no 64-bit integer dot:
    int64 runs as products and sums) and give CPU's values: int64 exactly, float64 and complex128 within
    the emulation's error (pairs of float32: 2**-40 relative per value, more through sums)."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int64:
        a, b, c = (torch.randint(-2**40, 2**40, shape, generator=g) for shape in ((3, 33, 17), (3, 17, 9), (33, 9)))
    else:
        a, b, c = (torch.randn(shape, generator=g, dtype=dtype) for shape in ((3, 33, 17), (3, 17, 9), (33, 9)))
    cases = {"mm": lambda a, b, c: a[0] @ b[0], "bmm": lambda a, b, c: torch.bmm(a, b),
             "matmul": lambda a, b, c: torch.matmul(a, b[0]), "addmm": lambda a, b, c: torch.addmm(c, a[1], b[2]),
             "mv": lambda a, b, c: torch.mv(a[0], b[0][:, 0])}
    for name, fn in cases.items():
        want = fn(a, b, c)
        got = fn(a.to("tpu"), b.to("tpu"), c.to("tpu")).cpu()
        if dtype == torch.int64:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("platform,base,generalises", [
    ("cpu", 2**50, True), ("tpu", 2**50, False), ("tpu", 2**46, True)], ids=["cpu-2**50", "tpu-2**50", "tpu-2**46"])
def test_ints_enter_the_scalar_vector_only_where_they_stay_exact(monkeypatch, platform, base, generalises):
    """An int that changes at the same place becomes a runtime input, a float64 in the program's scalar
    vector: exact below 2**53 on the CPU, but a TPU's float64 keeps about 48 bits (ints near 2**53
    measured up to 8 off), so there an int of 2**47 or more stays a constant (a kernel per value)."""
    monkeypatch.setattr(_storage, "_on_tpu", lambda: platform == "tpu")
    n = {"cpu-2**50": 29, "tpu-2**50": 31, "tpu-2**46": 37}[f"{platform}-2**{base.bit_length() - 1}"]
    x = (torch.arange(3 * n) * 3).reshape(3, n)  # int64, shapes no other test adds ints to
    compiled = []
    with torch.tpu.eager_mode("strict"):
        dx = x.to("tpu")
        for i in range(5):
            stats = torch.tpu.cache_stats()
            before = stats["programs"] + stats["kernels"]
            got = (dx + (base + 7 * i)).cpu()
            stats = torch.tpu.cache_stats()
            compiled.append(stats["programs"] + stats["kernels"] - before)
            assert torch.equal(got, x + (base + 7 * i))
    # generalised: the first value and the second compile at most (a site another test generalised
    # compiles none); not: every value is a kernel of its own
    if generalises:
        assert compiled[2:] == [0, 0, 0], compiled
    else:
        assert all(c > 0 for c in compiled), compiled


def test_python_numbers_reach_float32_and_int64_programs_exactly():
    """Python floats and changing ints travel in the float64 scalar vector: on a TPU through its
    float64 emulation. A float32 op must still see float32(value) (what torch computes with), and an
    int64 op every int below 2**47 (the bound of ``_core._exact_ints`` there)."""
    rng = np.random.default_rng(1)
    # float32 normals (subnormals are another question, not yet measured on a TPU)
    floats = (rng.standard_normal(300) * 10.0 ** rng.uniform(-30, 37, 300)).tolist() + [0.1, 1 / 3, -2.5e-38]
    ints = [int(v) for v in rng.integers(-2**47 + 1, 2**47, 100)] + [2**47 - 1, -(2**47) + 1, 2**31 + 1]
    with torch.tpu.eager_mode("strict"):
        zero = torch.zeros(3, device="tpu")
        got = torch.stack([zero + v for v in floats]).cpu()
        want = torch.stack([torch.zeros(3) + v for v in floats])
        assert torch.equal(got, want), (got - want).abs().max()
        base = torch.tensor([0, 1, -1]).to("tpu")
        got = torch.stack([base + v for v in ints]).cpu()
        assert torch.equal(got, torch.stack([torch.tensor([0, 1, -1]) + v for v in ints]))


def test_complex128_reads_for_the_host_come_out_flat_on_a_tpu(chip):
    """XLA:TPU fails to compile a program whose result is an N-d complex128 array (measured on a v5e:
    scripts/probes/c128_reader.py), so on a TPU the reader of a copy to the host returns the view's
    elements flat and the host reshapes them. With the platform check patched, the flat readers run here:
    a whole tensor, a transposed view, a strided slice at an offset and a channels_last copy, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, 2, generator=g, dtype=torch.complex128)
    d = x.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float64 emulation warning the patched check shows
        assert torch.equal(d.cpu(), x)
        assert torch.equal(d.transpose(0, 2).cpu(), x.transpose(0, 2))
        assert torch.equal(d[1:, ::2, 3].cpu(), x[1:, ::2, 3])
        assert torch.equal(d.to("cpu", memory_format=torch.channels_last), x.to(memory_format=torch.channels_last))
        assert _storage.value_of(d.transpose(0, 2), for_host=True).shape == (x.numel(),)
        assert _storage.value_of(d.transpose(0, 2)).shape == (7, 5, 3, 2)  # a kernel's input keeps its shape
    z = torch.randn(4, 3, generator=g, dtype=torch.complex64).to("tpu")  # other dtypes keep their shape
    assert _storage.value_of(z.t(), for_host=True).shape == (3, 4)
    assert torch.equal(z.t().cpu(), z.cpu().t())
