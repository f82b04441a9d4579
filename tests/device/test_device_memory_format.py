"""Memory formats on the device against CPU eager: strides, values, views, backward, training (issue #38).

A device result takes the strides torch gives it on the CPU (the meta kernel's, corrected by
``tpudist/device/_layouts.py`` where CPU's kernels keep the input's format), and its storage holds the
value in that physical order, so ``.stride()``, ``.is_contiguous(memory_format=...)`` and the views that
depend on them (``x_cl.permute(0, 2, 3, 1).view(-1, C)``) behave as on the CPU. Before, every result was
contiguous: the strides, the view and the format checks below failed.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

DEV_TIMEOUT = 600  # seconds a call in the worker may take (the ``dev`` fixture in conftest.py)

# -- views.permuted_order and the dense permuted read/write (no device) ------------------------------


@pytest.mark.parametrize("sizes, strides, order", [
    ((2, 3, 5, 4), (60, 20, 4, 1), (0, 1, 2, 3)),          # contiguous
    ((2, 3, 5, 4), (60, 1, 12, 3), (0, 2, 3, 1)),          # channels_last
    ((2, 3, 4, 3, 5), (180, 1, 45, 15, 3), (0, 2, 3, 4, 1)),  # channels_last_3d
    ((4, 6), (1, 4), (1, 0)),                              # a transposed matrix
    ((2, 1, 5, 4), (20, 1, 4, 1), (0, 2, 1, 3)),           # a size-1 dim's stride is never used
    ((0, 3), (1, 7), (1, 0)),                              # no elements: any layout is dense
    ((2, 3), (6, 2), None),                                # gaps (x[:, ::2])
    ((2, 3), (1, 1), None),                                # overlaps
    ((3, 4), (0, 1), None),                                # expanded
])
def test_permuted_order(sizes, strides, order):
    from tpudist.device import views

    assert views.permuted_order(sizes, strides) == order


@pytest.mark.parametrize("sizes, strides, offset", [
    ((2, 3, 5, 4), (60, 1, 12, 3), 0), ((2, 3, 5, 4), (60, 1, 12, 3), 7), ((4, 6), (1, 4), 3),
    ((2, 3, 4, 3, 5), (180, 1, 45, 15, 3), 0),
])
def test_dense_permuted_read_and_write_match_numpy(sizes, strides, offset):
    """views.read/write of a dense permuted view against numpy's as_strided over the same flat buffer."""
    from numpy.lib.stride_tricks import as_strided

    from tpudist.device import views

    n = offset + int(np.prod(sizes)) + 5
    flat = np.arange(n, dtype=np.float32)
    item = flat.itemsize
    want = as_strided(flat[offset:], sizes, [s * item for s in strides])
    assert np.array_equal(np.asarray(views.read(flat, sizes, strides, offset)), want)
    value = np.random.default_rng(0).standard_normal(sizes).astype(np.float32)
    expected = flat.copy()
    as_strided(expected[offset:], sizes, [s * item for s in strides])[...] = value
    assert np.array_equal(np.asarray(views.write(flat, value, sizes, strides, offset)), expected)


# -- ops, views and copies against CPU -----------------------------------------------------------------


def _inputs(device):
    """The same random tensors on ``device`` (made on the CPU, then moved)."""
    torch.manual_seed(0)
    shapes = {"x": (2, 3, 5, 4), "x5": (2, 3, 4, 3, 5), "m": (4, 6), "w": (6, 3, 3, 3), "w1": (6, 3, 1, 1),
              "wg": (6, 1, 3, 3), "wt": (3, 4, 3, 3), "w3": (4, 3, 3, 3, 3), "g": (3,), "b": (3,),
              "c1": (2, 1, 5, 4), "hw1": (2, 3, 1, 1), "n1": (1, 3, 5, 4)}
    values = {k: torch.randn(*s) for k, s in shapes.items()}
    values["rv"] = torch.rand(3) + 0.5
    return {k: v.to(device) for k, v in values.items()}


def _cases():
    """name -> fn(inputs) returning a tensor; inputs are ``_inputs(device)``."""
    import torch.nn.functional as F

    cl, cl3 = torch.channels_last, torch.channels_last_3d

    def xcl(t):
        return t["x"].contiguous(memory_format=cl)

    def inplace_add(t):
        y = xcl(t).clone()
        y.add_(1)
        return y

    def setitem(t):
        y = xcl(t).clone()
        y[:, 1] = 5.0
        y[:, :, 2:] *= 2
        return y

    def copy_into(t):
        y = torch.empty(2, 3, 5, 4, device=t["x"].device, memory_format=cl)
        return y.copy_(t["x"])

    return {
        "contiguous_cl": xcl,
        "contiguous_cl3d": lambda t: t["x5"].contiguous(memory_format=cl3),
        "to_memory_format": lambda t: t["x"].to(memory_format=cl),
        "to_dtype_keeps_format": lambda t: xcl(t).to(torch.float64),
        "back_to_contiguous": lambda t: xcl(t).contiguous(),
        "clone": lambda t: xcl(t).clone(),
        "clone_contiguous": lambda t: xcl(t).clone(memory_format=torch.contiguous_format),
        "zeros_like": lambda t: torch.zeros_like(xcl(t)),
        "empty_cl_filled": lambda t: torch.empty(2, 3, 5, 4, device=t["x"].device, memory_format=cl).fill_(2.0),
        "empty_strided_filled": lambda t: torch.empty_strided((2, 3, 5, 4), (60, 1, 12, 3),
                                                              device=t["x"].device).fill_(3.0),
        "relu": lambda t: torch.relu(xcl(t)),
        "add_scalar": lambda t: xcl(t) + 1,
        "add_contiguous": lambda t: xcl(t) + t["x"],
        "mul_broadcast": lambda t: xcl(t) * t["g"].view(1, 3, 1, 1),
        "sum_channels": lambda t: xcl(t).sum(1, keepdim=True),
        "mean_spatial": lambda t: xcl(t).mean((2, 3), keepdim=True),
        "conv": lambda t: F.conv2d(xcl(t), t["w"], padding=1),
        "conv_weight_cl": lambda t: F.conv2d(t["x"], t["w"].contiguous(memory_format=cl)),
        "conv_1x1": lambda t: F.conv2d(xcl(t), t["w1"]),
        "conv_1x1_contiguous": lambda t: F.conv2d(t["x"], t["w1"]),
        "conv_depthwise_strided": lambda t: F.conv2d(xcl(t), t["wg"], stride=2, groups=3),
        "conv_transpose": lambda t: F.conv_transpose2d(xcl(t), t["wt"], stride=2),
        "conv3d": lambda t: F.conv3d(t["x5"].contiguous(memory_format=cl3), t["w3"], padding=1),
        "conv_channels_1": lambda t: F.conv2d(t["c1"].contiguous(memory_format=cl), t["w"][:, :1]),
        "conv_spatial_1": lambda t: F.conv2d(t["hw1"].contiguous(memory_format=cl), t["w1"]),
        "conv_batch_1": lambda t: F.conv2d(t["n1"].contiguous(memory_format=cl), t["w"]),
        "batch_norm_train": lambda t: F.batch_norm(xcl(t), t["b"].clone(), t["rv"].clone(), t["g"], t["b"],
                                                   training=True),
        "batch_norm_eval": lambda t: F.batch_norm(xcl(t), t["b"], t["rv"], t["g"], t["b"], training=False),
        "max_pool": lambda t: F.max_pool2d(xcl(t), 2),
        "avg_pool": lambda t: F.avg_pool2d(xcl(t), 2),
        "adaptive_avg_pool": lambda t: F.adaptive_avg_pool2d(xcl(t), 1),
        "interpolate": lambda t: F.interpolate(xcl(t), scale_factor=2, mode="nearest"),
        "cat": lambda t: torch.cat([xcl(t), xcl(t)], 1),
        "transposed_matrix": lambda t: t["m"].t() * 2,
        "permute_view": lambda t: xcl(t).permute(0, 2, 3, 1).view(-1, 3),
        "permute_view_3d": lambda t: t["x5"].contiguous(memory_format=cl3).permute(0, 2, 3, 4, 1).view(-1, 3),
        "slice_channels": lambda t: xcl(t)[:, 1:],
        "narrow_then_add": lambda t: xcl(t)[:, :, 1:4] + 0,
        "flatten": lambda t: xcl(t).flatten(1),
        "inplace_add": inplace_add,
        "setitem": setitem,
        "copy_into_cl": copy_into,
    }


def _facts(t: torch.Tensor) -> dict:
    """What a tensor's layout says of itself: strides and every format check."""
    return {"shape": tuple(t.shape), "stride": t.stride(), "dtype": t.dtype, "contiguous": t.is_contiguous(),
            "channels_last": t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last),
            "channels_last_3d": t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)}


def format_mismatches(mode: str) -> list:
    """Every case whose device result differs from CPU's: in strides, format checks or values."""
    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    cpu, dev = _inputs("cpu"), _inputs("tpu")
    bad = []
    for name, fn in _cases().items():
        want, got = fn(cpu), fn(dev)
        want_facts, got_facts = _facts(want), _facts(got)
        if got_facts != want_facts:
            bad.append((name, got_facts, want_facts))
            continue
        host = got.cpu()
        if not torch.allclose(host, want, rtol=1e-5, atol=1e-5):
            bad.append((name, "values", float((host - want).abs().max())))
    return bad


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_results_have_cpu_strides_and_values(dev, mode):
    assert dev(format_mismatches, mode) == []


def host_copies() -> dict:
    """Strides of copies across devices, as torch's _to_copy gives them (preserve_format keeps a dense
    tensor's strides; any other gets the format it suggests), and through torch.save / torch.load."""
    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode("strict")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 4)
    xcl = x.contiguous(memory_format=torch.channels_last)
    sliced = torch.randn(2, 3, 5, 8).contiguous(memory_format=torch.channels_last)[..., ::2]
    on_dev = xcl.to("tpu")
    out = {
        "to_device": (on_dev.stride(), xcl.stride()),
        "to_host": (on_dev.cpu().stride(), xcl.stride()),
        "host_values": torch.equal(on_dev.cpu(), xcl),
        "to_host_contiguous": (on_dev.to("cpu", memory_format=torch.contiguous_format).stride(), x.stride()),
        "to_device_as_cl": (x.to("tpu", memory_format=torch.channels_last).stride(), xcl.stride()),
        "non_dense_to_device": (sliced.to("tpu").stride(), sliced.to("cpu", copy=True).stride()),
        "non_dense_values": torch.equal(sliced.to("tpu").cpu(), sliced),
        "double_to_host": (on_dev.to("cpu", torch.float64).stride(), xcl.double().stride()),
    }
    saved = io.BytesIO()
    torch.save([on_dev, xcl], saved)
    for where in ("tpu", "cpu"):  # torch.load keeps the device of what was saved unless map_location moves it
        saved.seek(0)
        loaded = torch.load(saved, map_location=None if where == "tpu" else where)
        out[f"load_{where}"] = ([t.stride() for t in loaded], [xcl.stride()] * 2)
        out[f"load_{where}_values"] = all(torch.equal(t.cpu(), xcl) for t in loaded)
    saved.seek(0)
    out["load_onto_tpu"] = ([t.stride() for t in torch.load(saved, map_location="tpu")], [xcl.stride()] * 2)
    return out


def test_copies_across_devices_keep_strides(dev):
    facts = dev(host_copies)
    for name in ("host_values", "non_dense_values", "load_tpu_values", "load_cpu_values"):
        assert facts.pop(name), name
    for name, (got, want) in facts.items():
        assert got == want, name


def issue_38_reproduction() -> tuple:
    """The issue's report, as written: channels_last through .contiguous, then the NHWC view."""
    import tpudist.device  # noqa: F401

    x = torch.randn(2, 8, 6, 6)
    got = x.to("tpu").contiguous(memory_format=torch.channels_last)
    want = x.contiguous(memory_format=torch.channels_last)
    return got.stride(), want.stride(), got.permute(0, 2, 3, 1).view(-1, 8).cpu(), want.permute(0, 2, 3, 1).view(-1, 8)


def test_issue_38_permute_view_works(dev):
    got_stride, want_stride, got, want = dev(issue_38_reproduction)
    assert got_stride == want_stride
    assert torch.equal(got, want)


# -- backward and training --------------------------------------------------------------------------


def _backward(device: str) -> dict:
    import torch.nn.functional as F

    t = _inputs(device)
    x = t["x"].contiguous(memory_format=torch.channels_last).requires_grad_()
    w, g = t["w"].requires_grad_(), t["g"].requires_grad_()
    y = F.relu(F.batch_norm(F.conv2d(x, w[:3], padding=1), None, None, g, t["b"], training=True))
    y = F.max_pool2d(y, 2)
    (y * torch.arange(y.numel(), device=device).reshape(y.shape).sin()).sum().backward()
    return {name: (v.grad.stride(), v.grad.detach().cpu()) for name, v in (("x", x), ("w", w), ("g", g))}


def backward_grads(mode: str) -> tuple:
    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    return _backward("cpu"), _backward("tpu")


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_backward_grads_have_cpu_strides_and_values(dev, mode):
    want, got = dev(backward_grads, mode)
    for name in want:
        assert got[name][0] == want[name][0], name
        torch.testing.assert_close(got[name][1], want[name][1], rtol=1e-4, atol=1e-5)


def _train(device: str, rank: int, steps: int = 3) -> dict:
    """A small channels_last CNN (2-d or 3-d: ``rank`` 4 or 5) trained with SGD+momentum: its losses,
    parameters, and the strides of its parameters, gradients and activations."""
    from torch import nn

    fmt = torch.channels_last if rank == 4 else torch.channels_last_3d
    conv, bn, pool, adaptive = ((nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d) if rank == 4
                                else (nn.Conv3d, nn.BatchNorm3d, nn.MaxPool3d, nn.AdaptiveAvgPool3d))
    torch.manual_seed(0)
    model = nn.Sequential(conv(3, 8, 3, padding=1), bn(8), nn.ReLU(), pool(2),
                          conv(8, 8, 3, padding=1, groups=2, bias=False), bn(8), nn.GELU(), conv(8, 8, 1),
                          adaptive(1), nn.Flatten(), nn.Linear(8, 4))
    x = torch.randn(2, 3, *([6] * (rank - 2))).contiguous(memory_format=fmt)
    target = torch.randn(2, 4)
    # both orders of moving and converting: the 2-d model is converted on the host, the 3-d one on the device
    model = model.to(memory_format=fmt).to(device) if rank == 4 else model.to(device).to(memory_format=fmt)
    x, target = x.to(device), target.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    activations = []
    model[4].register_forward_hook(lambda m, i, o: activations.append((i[0].stride(), o.stride())))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    return {"losses": torch.stack(losses), "params": [p.detach().cpu() for p in model.parameters()],
            "param_strides": [p.stride() for p in model.parameters()],
            # a size-1 dim's stride is never used, and CPU's own differs with the thread count there (a
            # 1x1x1 conv3d weight's gradient: (8, 1, 1, 1, 1) on one thread, (8, 1, 8, 8, 8) on two)
            "grad_strides": [_used_strides(p.grad) for p in model.parameters()],
            "buffers": [b.detach().cpu() for b in model.buffers()], "activations": activations}


def _used_strides(t: torch.Tensor) -> tuple:
    return tuple(None if n == 1 else st for n, st in zip(t.shape, t.stride()))


def training_runs(mode: str, rank: int) -> tuple:
    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    return _train("cpu", rank), _train("tpu", rank)


@pytest.mark.parametrize("rank", [4, 5], ids=["channels_last", "channels_last_3d"])
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_cnn_training_matches_cpu(dev, mode, rank):
    want, got = dev(training_runs, mode, rank)
    for key in ("param_strides", "grad_strides", "activations"):
        assert got[key] == want[key], key
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["params"] + got["buffers"], want["params"] + want["buffers"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
