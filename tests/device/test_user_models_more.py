"""Distance losses users pick, on the "tpu" device in Strict and Fused mode, against CPU eager torch.

- ``F.pairwise_distance`` (and ``triplet_margin_loss``, ``nn.PairwiseDistance``, ``torch.dist``): torch's
  norm decomposition calls ``p.item()`` on the float ``p`` the device passes as a program input; it
  raised "aten._local_scalar_dense ... cannot run inside jax.jit" instead of running.
- ``torch.cdist(x, x)``: the backward at a zero distance (the diagonal) is 0 in torch and was NaN.
- ``torch.autocast("tpu", dtype=torch.bfloat16)`` training of a CNN (bf16 convolutions, depthwise too,
  BatchNorm): its convolution backward raised a JAX dtype error.

Loss and input gradients must match CPU within 1e-5 (relative to the gradient's largest entry); the
autocast CNN within 2e-2 of CPU autocast (one bf16 rounding apart; bf16 against float32 is ~15% here).
All cases run in one worker process that installs the device (it renames PrivateUse1 for the process).
"""

from __future__ import annotations

import pytest
import torch

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- in the worker ------------------------------------------------------------------------------------


def _distance_cases() -> dict:
    import torch.nn.functional as F

    return {
        "pairwise_distance": lambda x: F.pairwise_distance(x[:3], x[3:]).sum(),
        "pairwise_distance_p1": lambda x: torch.nn.PairwiseDistance(p=1.0)(x[:3], x[3:]).sum(),
        "triplet_margin_swap": lambda x: F.triplet_margin_loss(x[:2], x[2:4], x[4:], margin=1.0, swap=True),
        "dist_p3": lambda x: torch.dist(x[0], x[1], 3.0),
        "cdist_self": lambda x: (torch.cdist(x, x) * torch.arange(6.0, device=x.device)).sum(),
        "cdist_self_p3": lambda x: (torch.cdist(x, x, p=3.0) * torch.arange(6.0, device=x.device)).sum(),
    }


def run_distances(mode: str) -> dict:
    """name -> (loss error, gradient error) against CPU eager, or the error text."""
    import tpudist.device  # noqa: F401

    x0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.tpu.eager_mode(mode):
        for name, fn in _distance_cases().items():
            x = x0.clone().requires_grad_()
            want = fn(x)
            want.backward()
            xd = x0.to("tpu").requires_grad_()
            try:
                got = fn(xd)
                got.backward()
                grad = xd.grad.cpu()
            except Exception as e:  # noqa: BLE001 - reported by name to the test process
                out[name] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            out[name] = (abs(got.item() - want.item()) / abs(want.item()),
                         ((grad - x.grad).abs().max() / x.grad.abs().max()).item())
    return out


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_distance_losses_match_cpu(dev, mode):
    out = dev(run_distances, mode)
    failed = {k: v for k, v in out.items() if isinstance(v, str)}
    assert not failed, failed
    off = {k: v for k, v in out.items() if not (v[0] <= 1e-5 and v[1] <= 1e-5)}  # NaN fails too
    assert not off, out


def _cnn():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
                         nn.Conv2d(8, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def run_autocast_cnn(mode: str, steps: int = 2) -> dict:
    """Per step: (cpu loss, device loss, max gradient difference / largest cpu gradient)."""
    import copy

    import torch.nn.functional as F

    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    models = {"cpu": _cnn().train()}
    models["tpu"] = copy.deepcopy(models["cpu"]).to("tpu")
    opts = {d: torch.optim.AdamW(m.parameters(), lr=3e-3) for d, m in models.items()}
    g = torch.Generator().manual_seed(1)
    out = []
    with torch.tpu.eager_mode(mode):
        for _ in range(steps):
            x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
            losses = {}
            for device, model in models.items():
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
                losses[device] = loss.item()
            pairs = [(a.grad, b.grad.cpu()) for a, b in zip(models["cpu"].parameters(), models["tpu"].parameters())]
            scale = max(a.abs().max().item() for a, _ in pairs)
            out.append((losses["cpu"], losses["tpu"], max((a - b).abs().max().item() for a, b in pairs) / scale))
            for opt in opts.values():
                opt.step()
                opt.zero_grad()
    return out


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_autocast_bf16_cnn_trains_like_cpu_autocast(dev, mode):
    out = dev(run_autocast_cnn, mode)
    assert all(abs(got - want) <= 2e-2 * abs(want) and grad_err <= 2e-2 for want, got, grad_err in out), out
