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


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst distance of ``got`` (float32) from ``want`` (float64), in ulps of the float32 value."""
    spacing = torch.from_numpy(__import__("numpy").spacing(want.abs().float().numpy())).double()
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
        cpu, device = ulps(fn(x), want), ulps(fn(x.to("tpu")).cpu(), want)
        report[name] = (round(cpu, 1), round(device, 1))
        if device > cpu + ULP_MARGIN:
            worse[name] = report[name]
    print(f"\n{mode}: (CPU, device) worst ulps: {report}")
    assert not worse, worse
