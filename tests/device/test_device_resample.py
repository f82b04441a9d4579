"""F.interpolate / nn.Upsample and the counting ops (histc, bincount, unique, put_, Embedding(max_norm))
on the "tpu" device, forward and backward, against CPU eager torch in Strict and Fused modes.

Everything runs in one worker process (installing the device renames PrivateUse1 for the whole
process), as in tests/device/test_device.py.
"""

from __future__ import annotations

import pytest

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# (mode, spatial dims, F.interpolate kwargs): every mode, size= and scale_factor= (non-integer, below 1,
# recompute_scale_factor), align_corners both ways
_CASES = [
    ("nearest", 1, dict(scale_factor=2)), ("nearest", 2, dict(scale_factor=1.5)), ("nearest", 3, dict(size=(3, 5, 4))),
    ("nearest-exact", 2, dict(size=(7, 3))), ("nearest-exact", 3, dict(scale_factor=0.6)),
    ("linear", 1, dict(size=9, align_corners=True)), ("bilinear", 2, dict(scale_factor=2, align_corners=False)),
    ("bilinear", 2, dict(scale_factor=1.7, align_corners=True, recompute_scale_factor=True)),
    ("bicubic", 2, dict(size=(8, 3), align_corners=False)), ("bicubic", 2, dict(scale_factor=0.7, align_corners=True)),
    ("trilinear", 3, dict(scale_factor=(1.5, 2, 0.5), align_corners=False)),
    ("area", 2, dict(size=(3, 2))), ("area", 1, dict(scale_factor=0.5)),
    ("bilinear", 2, dict(size=(3, 2), antialias=True, align_corners=False)),
    ("bicubic", 2, dict(scale_factor=0.4, antialias=True, align_corners=False)),
]


def _interpolate_cases(eager_mode, dtype_name):
    import torch
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.tpu.eager_mode(eager_mode):
        for i, (mode, nd, kwargs) in enumerate(_CASES):
            if dtype == torch.bfloat16 and kwargs.get("antialias"):
                continue  # CPU torch has no bfloat16 antialiasing to compare with
            x = torch.randn(2, 3, *(5 + k for k in range(nd)), generator=g).to(dtype)
            xc, xd = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
            yc, yd = F.interpolate(xc, mode=mode, **kwargs), F.interpolate(xd, mode=mode, **kwargs)
            grad = torch.randn(yc.shape, generator=g).to(dtype)
            yc.backward(grad)
            yd.backward(grad.to("tpu"))
            out[f"{i}:{mode}{nd}d {kwargs}"] = ((yc.detach(), xc.grad), (yd.detach().cpu(), xd.grad.cpu()))
        x = torch.randn(1, 2, 4, 5, generator=g).to(dtype)
        for name, module in (("Upsample", torch.nn.Upsample(scale_factor=2, mode="bilinear")),
                             ("UpsamplingBilinear2d", torch.nn.UpsamplingBilinear2d(scale_factor=2)),
                             ("UpsamplingNearest2d", torch.nn.UpsamplingNearest2d(size=(7, 9)))):
            out[name] = (module(x), module(x.to("tpu")).cpu())
    return out


@pytest.mark.parametrize("eager_mode", ["strict", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpolate_every_mode_forward_and_backward_match_cpu(dev, eager_mode, dtype):
    import torch

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=2e-2)
    for name, (expected, got) in dev(_interpolate_cases, eager_mode, dtype).items():
        torch.testing.assert_close(got, expected, msg=name, **tol)


def _counting_cases(eager_mode):
    import torch

    import tpudist.device  # noqa: F401

    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, generator=g)
    k = torch.randint(0, 7, (30,), generator=g)
    w = torch.randn(30, generator=g)
    out = {}
    with torch.tpu.eager_mode(eager_mode):
        xd, kd, wd = x.to("tpu"), k.to("tpu"), w.to("tpu")
        out["histc"] = (torch.histc(x, 6), torch.histc(xd, 6).cpu())
        out["histc range"] = (torch.histc(x, 5, min=-1, max=1), torch.histc(xd, 5, min=-1, max=1).cpu())
        out["bincount"] = (torch.bincount(k), torch.bincount(kd).cpu())
        out["bincount minlength weights"] = (torch.bincount(k, w, minlength=10), torch.bincount(kd, wd, minlength=10).cpu())
        for kwargs in (dict(), dict(return_inverse=True, return_counts=True), dict(sorted=False, return_inverse=True)):
            out[f"unique {kwargs}"] = (torch.unique(k.reshape(5, 6), **kwargs), tuple_cpu(torch.unique(kd.reshape(5, 6), **kwargs)))
        out["unique dim"] = (torch.unique(k.reshape(10, 3) % 2, dim=0, return_counts=True),
                             tuple_cpu(torch.unique(kd.reshape(10, 3) % 2, dim=0, return_counts=True)))
        out["unique_consecutive"] = (torch.unique_consecutive(k % 3, return_inverse=True, return_counts=True),
                                     tuple_cpu(torch.unique_consecutive(kd % 3, return_inverse=True, return_counts=True)))
        index, source = torch.tensor([0, 7, -1, 7]), torch.randn(4, generator=g)
        base = torch.randn(3, 4, generator=g)
        out["put_"] = (base.clone().put_(index, source), base.to("tpu").put_(index.to("tpu"), source.to("tpu")).cpu())
        out["put_ accumulate"] = (base.clone().put_(index, source, accumulate=True),
                                  base.to("tpu").put_(index.to("tpu"), source.to("tpu"), accumulate=True).cpu())
        # Embedding(max_norm) renormalises the looked-up rows of its weight in place, then trains
        torch.manual_seed(0)
        cpu = torch.nn.Embedding(8, 4, max_norm=1.0)
        cpu.weight.data.mul_(3)
        tpu = torch.nn.Embedding(8, 4, max_norm=1.0).to("tpu")
        tpu.weight.data.copy_(cpu.weight.data.to("tpu"))
        ids = torch.tensor([[1, 2, 2], [5, 0, 1]])
        for module, device in ((cpu, "cpu"), (tpu, "tpu")):
            module(ids.to(device)).pow(2).sum().backward()
        out["embedding max_norm weight"] = (cpu.weight.detach(), tpu.weight.detach().cpu())
        out["embedding max_norm grad"] = (cpu.weight.grad, tpu.weight.grad.cpu())
    return out


def tuple_cpu(values):
    return tuple(v.cpu() for v in values) if isinstance(values, tuple) else values.cpu()


@pytest.mark.parametrize("eager_mode", ["strict", "fused"])
def test_counting_ops_match_cpu(dev, eager_mode):
    import torch

    for name, (expected, got) in dev(_counting_cases, eager_mode).items():
        torch.testing.assert_close(got, expected, msg=name)
