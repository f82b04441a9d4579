"""torch.compile(backend="tpu") of user losses and models less covered elsewhere, against CPU eager torch.

- ``F.multilabel_margin_loss``: torch 2.13's decomposition (which AOTAutograd runs at the Autograd
  key) counts the target slots after a row's -1 as class 0 targets; the backend swaps in a corrected
  one. Loss and gradients for every reduction, on CPU tensors and on "tpu" device tensors.
- A MobileNet-style CNN (depthwise-separable convs, squeeze-excitation, Hardswish/Hardsigmoid,
  BatchNorm in train mode) with channels_last weights and input, compiled on device tensors: loss and
  every parameter gradient at each of 2 AdamW steps within 1e-4 (relative to the largest gradient of
  the step) of CPU eager.

Device cases run in one worker process (installing the device renames PrivateUse1 process-wide).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=600, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- multilabel margin loss ---------------------------------------------------------------------------

def run_multilabel_margin(device: str) -> dict:
    """reduction -> (loss error, gradient error) of the compiled loss against CPU eager."""
    import torch.nn.functional as F

    if device == "tpu":
        import tpudist.device  # noqa: F401
    x0 = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    # a -1 ends a row's targets; no -1 (all five slots are targets); a -1 first (no targets); repeats
    target = torch.tensor([[1, 3, -1, 0, 0], [0, 1, 2, 3, 4], [-1, 1, 2, 2, 2], [2, 2, -1, 1, 1]])
    weights = torch.arange(1.0, 5.0)
    out = {}
    for reduction in ("none", "mean", "sum"):
        def loss(x, t, w):
            return (F.multilabel_margin_loss(x, t, reduction=reduction) * w).sum()

        x = x0.clone().requires_grad_()
        want = loss(x, target, weights)
        want.backward()
        torch._dynamo.reset()  # noqa: SLF001 - one graph per reduction
        xd = x0.clone().to(device).requires_grad_()
        got = torch.compile(loss, backend="tpu", dynamic=False)(xd, target.to(device), weights.to(device))
        got.backward()
        out[reduction] = (abs(got.item() - want.item()), (xd.grad.cpu() - x.grad).abs().max().item())
    return out


def _check_multilabel(out: dict) -> None:
    assert all(loss_err <= 1e-5 and grad_err <= 1e-6 for loss_err, grad_err in out.values()), out


def test_multilabel_margin_loss_compiled_cpu():
    _check_multilabel(run_multilabel_margin("cpu"))


def test_multilabel_margin_loss_compiled_device(dev):
    _check_multilabel(dev(run_multilabel_margin, "tpu"))


# -- a channels_last depthwise-separable CNN ---------------------------------------------------------

def _mobilenet():
    from torch import nn

    class SqueezeExcite(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.reduce, self.expand = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

        def forward(self, x):
            scale = self.expand(nn.functional.relu(self.reduce(nn.functional.adaptive_avg_pool2d(x, 1))))
            return x * nn.functional.hardsigmoid(scale)

    def separable(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                             nn.ReLU6(inplace=True), SqueezeExcite(cin), nn.Conv2d(cin, cout, 1, bias=False),
                             nn.BatchNorm2d(cout), nn.Hardswish())

    return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(), separable(8, 16, 1),
                         separable(16, 24, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10))


def _ce(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def run_mobilenet_channels_last(steps: int = 2) -> dict:
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    ref = _mobilenet().to(memory_format=torch.channels_last).train()
    model = copy.deepcopy(ref).to("tpu").to(memory_format=torch.channels_last)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01) for m in (ref, model)]
    step = torch.compile(_ce, backend="tpu", dynamic=False)
    g = torch.Generator().manual_seed(7)
    losses, grad_errs = [], []
    for _ in range(steps):
        x = (torch.randn(4, 3, 16, 16, generator=g) * 2 + 1).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (4,), generator=g)
        want, got = _ce(ref, x, y), step(model, x.to("tpu"), y.to("tpu"))
        want.backward()
        got.backward()
        scale = max(p.grad.abs().max().item() for p in ref.parameters())
        grad_errs.append(max((a.grad - b.grad.cpu()).abs().max().item() / scale
                             for a, b in zip(ref.parameters(), model.parameters())))
        losses.append((want.item(), got.item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "grad_errs": grad_errs, "device": str(next(model.parameters()).device)}


def test_channels_last_depthwise_cnn_trains_compiled_on_device(dev):
    out = dev(run_mobilenet_channels_last)
    assert out["device"] == "tpu:0", out
    assert all(abs(got - want) <= 1e-4 * abs(want) for want, got in out["losses"]), out
    assert all(err <= 1e-4 for err in out["grad_errs"]), out


# -- a spectral-feature model (stft, rfft phase) -----------------------------------------------------

def run_spectral(device: str) -> tuple:
    """(loss error, largest gradient error) of the compiled forward+backward against CPU eager. The input's
    DC and Nyquist bins are negative: their phase is pi only if their imaginary part is exactly +0."""
    import sys
    from pathlib import Path

    import torch.nn.functional as F

    if device == "tpu":
        import tpudist.device  # noqa: F401
    sys.path.insert(0, str(Path(__file__).parents[1] / "device"))
    from test_user_models_3 import _spectral  # the model of the eager device test

    torch._dynamo.reset()  # noqa: SLF001
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    ref = _spectral()
    model = copy.deepcopy(ref).to(device)
    x, y = torch.randn(2, 100, generator=g), torch.randint(0, 4, (2,), generator=g)
    x[:, ::2] -= 3

    def loss(m, x, y):
        return F.cross_entropy(m(x), y)

    want = loss(ref, x, y)
    want.backward()
    got = torch.compile(loss, backend="tpu", dynamic=False)(model, x.to(device), y.to(device))
    got.backward()
    return (abs(got.item() - want.item()) / abs(want.item()),
            max((a.grad - b.grad.cpu()).abs().max().item() / a.grad.abs().max().item()
                for a, b in zip(ref.parameters(), model.parameters())))


def test_spectral_model_compiled_cpu():
    loss_err, grad_err = run_spectral("cpu")
    assert loss_err <= 1e-5 and grad_err <= 1e-5, (loss_err, grad_err)


def test_spectral_model_compiled_device(dev):
    loss_err, grad_err = dev(run_spectral, "tpu")
    assert loss_err <= 1e-5 and grad_err <= 1e-5, (loss_err, grad_err)
