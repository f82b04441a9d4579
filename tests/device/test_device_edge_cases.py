"""Edge cases of ops on the "tpu" device against CPU eager torch, found by running OpInfo's samples
beyond the first one the suite compares (``test_device_opinfo.py``): each one a wrong value or an
error CPU torch does not give, in Debug, Strict and Fused modes.

- ``addmm``/``addmv``/``addr``/``baddbmm``/``addbmm`` with ``beta=0.0``: the bias is ignored, its nan
  too (the device passes a float scalar to the program as a value, so the lowering cannot branch on it);
- the same in int64 with float ``alpha``/``beta``: torch converts them to the integer dtype first;
- ``div(rounding_mode="trunc")`` of integer tensors of different ranks (broadcast);
- ``as_strided`` past the end of the storage raises torch's error instead of reading clamped elements;
- ``repeat_interleave`` with tensor repeats (its length read on the host; its meta kernel refuses);
- 0x0 matrices in ``cholesky`` and ``pinv(hermitian=True)``, a 0-size ``log_softmax`` (JAX errors).
"""

from __future__ import annotations

import pytest
import torch

from tpudist.testing import RankPool

MODES = ("debug", "strict", "fused")


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _cases():
    g = torch.Generator().manual_seed(0)
    nan = torch.full((3, 4), float("nan"))
    m, v, w = torch.randn(3, 5, generator=g), torch.randn(5, generator=g), torch.randn(5, 4, generator=g)
    b1, b2 = torch.randn(2, 3, 5, generator=g), torch.randn(2, 5, 4, generator=g)
    i = lambda *shape: torch.randint(-9, 9, shape, generator=g)  # noqa: E731
    return {
        "addmm beta=0.0 nan bias": (torch.addmm, (nan, m, w), {"beta": 0.0, "alpha": 1.5}),
        "addmv beta=0.0 nan bias": (torch.addmv, (nan[:, 0], m, v), {"beta": 0.0}),
        "addr beta=0.0 alpha=0.0 nan bias": (torch.addr, (nan[:1, :1], torch.zeros(1), torch.zeros(1)),
                                             {"beta": 0.0, "alpha": 0.0}),
        "baddbmm beta=0.0 nan bias": (torch.baddbmm, (nan.expand(2, 3, 4), b1, b2), {"beta": 0.0}),
        "addbmm beta=0.0 nan bias": (torch.addbmm, (nan, b1, b2), {"beta": 0.0}),
        "addmm beta=0.5": (torch.addmm, (torch.ones(3, 4), m, w), {"beta": 0.5, "alpha": 2.0}),
        "int64 addmv float alpha beta": (torch.addmv, (i(3), i(3, 5), i(5)), {"beta": 0.2, "alpha": 0.6}),
        "int64 addmm float alpha beta": (torch.addmm, (i(3, 4), i(3, 5), i(5, 4)), {"beta": 2.7, "alpha": -1.5}),
        "int64 baddbmm float alpha beta": (torch.baddbmm, (i(2, 3, 4), i(2, 3, 5), i(2, 5, 4)),
                                           {"beta": 1.9, "alpha": 3.2}),
        "int64 addbmm float alpha beta": (torch.addbmm, (i(3, 4), i(2, 3, 5), i(2, 5, 4)), {"beta": 0.5, "alpha": 1.0}),
        "int64 div trunc (5,1) by (5,)": (torch.div, (i(5, 1), i(5).clamp(min=1)), {"rounding_mode": "trunc"}),
        "int64 div trunc (2,5,3) by (5,3)": (torch.div, (i(2, 5, 3), i(5, 3).clamp(min=1)), {"rounding_mode": "trunc"}),
        "as_strided in bounds": (torch.as_strided, (torch.arange(10.0), (2, 2), (1, 2)), {"storage_offset": 6}),
        "repeat_interleave tensor repeats": (torch.repeat_interleave, (b2, torch.tensor([0, 3, 1, 2, 0])), {"dim": 1}),
        "repeat_interleave of repeats": (torch.repeat_interleave, (torch.tensor([2, 0, 1], dtype=torch.int32),), {}),
        "cholesky of 0x0": (torch.linalg.cholesky, (torch.zeros(3, 0, 0),), {}),
        "cholesky_ex upper of 0x0": (torch.linalg.cholesky_ex, (torch.zeros(0, 0),), {"upper": True}),
        "pinv hermitian of 0x0": (torch.linalg.pinv, (torch.zeros(2, 0, 0),), {"hermitian": True}),
        "log_softmax of a 0-size bf16": (torch.log_softmax, (torch.zeros(5, 0, 0, dtype=torch.bfloat16), -1), {}),
    }


CASES = list(_cases())


def run_case(name: str, mode: str):
    """(CPU result, device result back on the CPU) of the case."""
    import tpudist.device  # noqa: F401

    fn, args, kwargs = _cases()[name]
    want = fn(*args, **kwargs)
    with torch.tpu.eager_mode(mode):
        got = fn(*(a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
        got = tuple(g.cpu() for g in got) if isinstance(got, tuple) else got.cpu()
    return (tuple(want) if isinstance(want, tuple) else want), got


def as_strided_past_the_end(mode: str):
    import tpudist.device  # noqa: F401

    errors = []
    with torch.tpu.eager_mode(mode):
        for device in ("cpu", "tpu"):
            x = torch.arange(10.0, device=device)
            try:
                x.as_strided((2, 2), (1, 2), storage_offset=10).cpu()
            except RuntimeError as e:
                errors.append(str(e))
            else:
                errors.append(None)
        # an empty view may start anywhere; a view of a view counts from the storage's start
        empty = torch.arange(10.0, device="tpu").as_strided((0, 3), (1, 1), storage_offset=20)
        tail = torch.arange(10.0, device="tpu")[4:].as_strided((3,), (2,), storage_offset=5).cpu()
    return errors, tuple(empty.shape), tail.tolist()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
def test_edge_case_matches_cpu(dev, name, mode):
    want, got = dev(run_case, name, mode)
    if isinstance(want, tuple):  # cholesky_ex: (factor, info)
        assert len(got) == len(want)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=False)


@pytest.mark.parametrize("mode", MODES)
def test_as_strided_past_the_storage_raises_torchs_error(dev, mode):
    (cpu_error, tpu_error), empty_shape, tail = dev(as_strided_past_the_end, mode)
    assert cpu_error is not None and tpu_error == cpu_error
    assert "out of bounds for storage of size 40" in tpu_error
    assert empty_shape == (0, 3) and tail == [5.0, 7.0, 9.0]
