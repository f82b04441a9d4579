"""float32 transcendental functions on the TPU chip, as accurate as torch's CPU kernels (skipped elsewhere).

XLA's TPU default approximates them (float32 ``log`` was 4027 ulp off on a v5e); tpudist's programs
ask for ``accuracy=HIGHEST`` (``tpudist.ops.accuracy``; the programs themselves are checked on CPU in
tests/ops/test_ops_accuracy.py). Each op runs on the chip, in Strict and Fused mode, and on the CPU;
both are compared with float64 in ulps of the float32 result. The device may be a few ulps farther
than the CPU (another algorithm), not thousands.

Run on the chip:  python -m pytest -q -p no:cacheprovider -s tests/device/test_device_float32_accuracy.py
"""

from __future__ import annotations

import jax
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "tpu",
                                reason=f"needs a TPU chip; JAX's first device is {jax.devices()[0].platform}")

# the device's worst error may be this many ulps beyond the CPU's own worst
ULP_MARGIN = 16
# Ops of the form x * (1 + f(x)) whose factor cancels to ~0 (gelu's tanh form for x << 0: 1 + tanh ->
# 0): one ulp of f(x) there is ~|x| * 6e-8 absolute against a result near 0 (CPU: 16.7M ulps of the
# result, the device 2.8e38), so their error is counted in ulps of max(|result|, |x|)
INPUT_SCALED = {"gelu_tanh"}

OPS = {
    "exp": (torch.exp, 4.0), "log": (torch.log, None), "log1p": (torch.log1p, None), "expm1": (torch.expm1, 4.0),
    "tanh": (torch.tanh, 3.0), "sigmoid": (torch.sigmoid, 3.0), "sin": (torch.sin, 3.0), "rsqrt": (torch.rsqrt, None),
    "softmax": (lambda x: torch.softmax(x, -1), 3.0), "log_softmax": (lambda x: F.log_softmax(x, -1), 3.0),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), 3.0), "silu": (F.silu, 3.0),
    "softplus": (F.softplus, 3.0),
}


@pytest.fixture(autouse=True)
def _restore():
    import tpudist.device  # noqa: F401

    mode = torch.tpu.get_eager_mode()
    yield
    torch.tpu.set_eager_mode(mode)


def ulps(got: torch.Tensor, want: torch.Tensor, floor: torch.Tensor | None = None) -> float:
    """The worst distance of ``got`` (float32) from ``want`` (float64), in ulps of the float32 value,
    or of ``floor`` where that is larger."""
    scale = want.abs() if floor is None else torch.maximum(want.abs(), floor.double().abs())
    spacing = torch.from_numpy(__import__("numpy").spacing(scale.float().numpy())).double()
    return float(((got.double() - want).abs() / spacing.clamp_min(1e-45)).max())


def _inputs(scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=g) * (scale or 1.0)
    return x if scale is not None else x.abs() + 1e-3  # None: positive inputs (log, rsqrt)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_float32_transcendentals_on_the_chip(mode):
    torch.tpu.set_eager_mode(mode)
    report, worse = {}, {}
    for name, (fn, scale) in OPS.items():
        x = _inputs(scale).reshape(256, 256)
        want = fn(x.double())
        floor = x if name in INPUT_SCALED else None
        cpu, device = ulps(fn(x), want, floor), ulps(fn(x.to("tpu")).cpu(), want, floor)
        report[name] = (round(cpu, 1), round(device, 1))
        if device > cpu + ULP_MARGIN:
            worse[name] = report[name]
    print(f"\n{mode}: (CPU, device) worst ulps: {report}")
    assert not worse, worse
