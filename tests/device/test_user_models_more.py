"""Distance losses users pick, on the "tpu" device in Strict and Fused mode, against CPU eager torch.

- ``F.pairwise_distance`` (and ``triplet_margin_loss``, ``nn.PairwiseDistance``, ``torch.dist``): torch's
  norm decomposition calls ``p.item()`` on the float ``p`` the device passes as a program input; it
  raised "aten._local_scalar_dense ... cannot run inside jax.jit" instead of running.
- ``torch.cdist(x, x)``: the backward at a zero distance (the diagonal) is 0 in torch and was NaN.

Loss and input gradients must match CPU within 1e-5 (relative to the gradient's largest entry).
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
