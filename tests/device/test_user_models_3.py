"""More user training loops on the "tpu" device in Strict and Fused mode, against the same loop on CPU eager.

- ``torch.optim.SGD(fused=True)`` and ``Adagrad(fused=True)``: their fused kernels (``_fused_sgd_``,
  ``_fused_adagrad_``) had no lowering, so ``opt.step()`` raised UnsupportedOp on tpu tensors.
- A spectral-feature model (``torch.stft`` magnitudes, ``torch.fft.rfft`` real/imag/angle): the device's
  real-input FFT left -2.4e-7 in the imaginary part of the Nyquist bin where the CPU has +0, so
  ``angle()`` of a negative Nyquist bin was -pi instead of pi and training drifted (loss 1.3e-2 relative
  at step 2).

Each case trains 2 steps from the same weights: losses within 1e-5 relative, every gradient within 1e-5
of the step's largest, parameters after the last step within 1e-4 of how far training moved them.
Measured (strict and fused): losses 1e-7, gradients 2-7e-7, parameters 2-6e-7 of their movement.
All cases run in one worker process that installs the device (it renames PrivateUse1 for the process).
"""

from __future__ import annotations

import pytest

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- in the worker ------------------------------------------------------------------------------------


def _mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _spectral():
    import torch
    from torch import nn

    class Spectral(nn.Module):
        """Log-magnitude STFT frames and the first rfft bins (real, gated imaginary, phase) -> 4 classes."""

        def __init__(self):
            super().__init__()
            self.register_buffer("window", torch.hann_window(32))
            self.frames, self.bins = nn.Linear(17, 4), nn.Linear(51, 4)

        def forward(self, x):
            spec = torch.stft(x, 32, 8, window=self.window, return_complex=True)
            frames = self.frames(spec.abs().clamp_min(1e-5).log().transpose(1, 2)).mean(1)
            r = torch.fft.rfft(x, dim=-1)[..., :51]
            return frames + self.bins(r.real * r.imag.sigmoid() + r.angle())

    return Spectral()


OPTIMIZERS = ("sgd_fused_nesterov", "sgd_fused_maximize", "adagrad_fused", "adagrad_fused_tensor_lr")


def _optimizer(case: str, params):
    import torch

    return {
        "sgd_fused_nesterov": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                                      weight_decay=1e-2, fused=True),
        "sgd_fused_maximize": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.5, dampening=0.1, maximize=True,
                                                      fused=True),
        "adagrad_fused": lambda: torch.optim.Adagrad(params, lr=0.1, lr_decay=0.01, weight_decay=1e-2, fused=True),
        "adagrad_fused_tensor_lr": lambda: torch.optim.Adagrad(params, lr=torch.tensor(0.1), fused=True),
    }[case]()


def _train(build, opt_fn, batches, device, steps=2):
    """Losses, gradients (CPU copies) per step, and the parameters at the end."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build().to(device)
    opt = opt_fn(list(model.parameters()))
    losses, grads = [], []
    for x, y in batches[:steps]:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.cpu() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads, [p.detach().cpu() for p in model.parameters()]


def run_case(case: str, mode: str) -> dict:
    """(loss error, gradient error, parameter error) of the device run against CPU, or the error text."""
    import torch

    import tpudist.device  # noqa: F401

    g = torch.Generator().manual_seed(1)
    if case == "spectral":
        build, opt_fn = _spectral, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
        batches = [(torch.randn(2, 100, generator=g), torch.randint(0, 4, (2,), generator=g)) for _ in range(2)]
    else:
        build, opt_fn = _mlp, lambda ps: _optimizer(case, ps)
        batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in build().parameters()]
    want_losses, want_grads, want_params = _train(build, opt_fn, batches, "cpu")
    try:
        with torch.tpu.eager_mode(mode):
            losses, grads, params = _train(build, opt_fn, batches, "tpu")
    except Exception as e:  # noqa: BLE001 - reported by name to the test process
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    loss_err = max(abs(a - b) / abs(a) for a, b in zip(want_losses, losses))
    grad_err = max((a - b).abs().max().item() / max(t.abs().max().item() for t in step_want)
                   for step_want, step_got in zip(want_grads, grads) for a, b in zip(step_want, step_got))
    param_err = max((a - b).norm().item() / (a - p0).norm().item()
                    for a, b, p0 in zip(want_params, params, initial))
    return {"loss": loss_err, "grad": grad_err, "param": param_err}


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("case", [*OPTIMIZERS, "spectral"])
def test_trains_like_cpu(dev, case, mode):
    out = dev(run_case, case, mode)
    assert "error" not in out, out
    assert out["loss"] <= 1e-5 and out["grad"] <= 1e-5 and out["param"] <= 1e-4, out  # NaN fails too
