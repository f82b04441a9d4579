"""The "tpu" device on torch's inference fast paths and data-dependent ops, against CPU eager torch.

``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` / ``nn.MultiheadAttention`` in eval mode under
``no_grad`` call ``_transformer_encoder_layer_fwd`` / ``_native_multi_head_attention`` on a PrivateUse1
device (module_db runs them with grad, so never on that path). Boolean-mask ops and
``cross_entropy(weight=..., label_smoothing=...)`` (whose CPU composite calls ``masked_select``) run
eagerly with data-dependent shapes. Everything runs in one worker process, as in tests/device/test_device.py.
"""

from __future__ import annotations

import pytest

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _transformer_fast_paths():
    import copy

    import torch
    import torch.nn as nn

    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False, False, False, True, True], [False] * 5])
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    out = {}
    with torch.no_grad():
        for norm_first, activation in ((False, "relu"), (True, "gelu")):
            layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True, norm_first=norm_first,
                                               activation=activation).eval()
            on_tpu = copy.deepcopy(layer).to("tpu")
            for name, kw in (("plain", {}), ("padding", {"src_key_padding_mask": padding}),
                             ("causal", {"src_mask": causal})):
                dev_kw = {k: v.to("tpu") for k, v in kw.items()}
                out[f"layer_{norm_first}_{activation}_{name}"] = (layer(x, **kw), on_tpu(x.to("tpu"), **dev_kw).cpu())
        mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
        on_tpu = copy.deepcopy(mha).to("tpu")
        xd = x.to("tpu")
        for need_weights in (True, False):
            e, a = mha(x, x, x, need_weights=need_weights), on_tpu(xd, xd, xd, need_weights=need_weights)
            out[f"mha_{need_weights}"] = (e, tuple(None if t is None else t.cpu() for t in a))
        stack = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 12, batch_first=True), 2).eval()
        on_tpu = copy.deepcopy(stack).to("tpu")
        unaligned = torch.tensor([[False, True, False, True, False], [False] * 5])  # not left-aligned: dense path
        out["stack_unaligned"] = (stack(x, src_key_padding_mask=unaligned),
                                  on_tpu(xd, src_key_padding_mask=unaligned.to("tpu")).cpu())
        try:
            on_tpu(xd, src_key_padding_mask=padding.to("tpu"))
            out["nested_error"] = None
        except NotImplementedError as e:
            out["nested_error"] = str(e)
    return out


def test_transformer_and_attention_fast_paths_match_cpu(dev):
    import torch

    out = dev(_transformer_fast_paths)
    assert "enable_nested_tensor=False" in out.pop("nested_error")
    for name, (expected, got) in out.items():
        if name.startswith("mha"):
            torch.testing.assert_close(got[0], expected[0], msg=name)
            if expected[1] is None:  # need_weights=False: None, as on CPU (not the meta kernel's (0,) tensor)
                assert got[1] is None, name
            else:
                torch.testing.assert_close(got[1], expected[1], msg=name)
        else:
            torch.testing.assert_close(got, expected, msg=name)


def _data_dependent_ops(mode):
    import torch
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    out = {}
    with torch.tpu.eager_mode(mode):
        x = torch.randn(5, 7, requires_grad=True)
        target = torch.tensor([0, 2, -100, 6, 3])
        weight = torch.rand(7)
        xd = x.detach().to("tpu").requires_grad_()
        for reduction in ("mean", "sum", "none"):
            kw = {"weight": weight, "label_smoothing": 0.15, "reduction": reduction}
            e = F.cross_entropy(x, target, **kw)
            a = F.cross_entropy(xd, target.to("tpu"), **{**kw, "weight": weight.to("tpu")})
            grad = torch.rand(e.shape)
            out[f"ce_{reduction}"] = ((e, torch.autograd.grad(e, x, grad)[0]),
                                      (a.cpu(), torch.autograd.grad(a, xd, grad.to("tpu"))[0].cpu()))
        mask = x.detach() > 0
        md, xv = mask.to("tpu"), xd.detach()
        out["nonzero"] = (torch.nonzero(mask), torch.nonzero(md).cpu())
        out["index"] = (x.detach()[mask], xv[md].cpu())
        out["masked_select"] = (torch.masked_select(x.detach(), mask[0]), torch.masked_select(xv, md[0]).cpu())
        values = torch.arange(float(mask.sum()))
        put = x.detach().clone()
        put[mask] = values
        put_d = xv.clone()
        put_d[md] = values.to("tpu")
        out["index_put"] = (put, put_d.cpu())
    return out


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_data_dependent_ops_and_smoothed_weighted_cross_entropy_match_cpu(dev, mode):
    import torch

    for name, (expected, got) in dev(_data_dependent_ops, mode).items():
        torch.testing.assert_close(got, expected, msg=name)


def _multilabel_margin_losses(mode):
    """F.multilabel_margin_loss of one sample (1-d) and of a batch, every reduction, forward and backward:
    (CPU, tpu) pairs. torch's meta kernel gives one sample's unreduced loss the shape (1,), CPU ()."""
    import torch
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    out = {}
    cases = {"one_sample": [1, 3, -1, 0], "batch": [[4, -1, 0, 0, 0], [0, 1, 2, 3, 4], [-1, 0, 0, 0, 0]]}
    with torch.tpu.eager_mode(mode):
        for name, target in cases.items():
            target = torch.tensor(target)
            for reduction in ("none", "mean", "sum"):
                x = torch.randn(*target.shape, requires_grad=True)
                xd = x.detach().to("tpu").requires_grad_()
                loss = F.multilabel_margin_loss(x, target, reduction=reduction)
                loss_d = F.multilabel_margin_loss(xd, target.to("tpu"), reduction=reduction)
                cotangent = torch.randn(loss.shape)
                loss.backward(cotangent)
                loss_d.backward(cotangent.to("tpu"))
                out[f"{name}_{reduction}"] = (loss.detach(), loss_d.detach().cpu())
                out[f"{name}_{reduction}_grad"] = (x.grad, xd.grad.cpu())
    return out


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_multilabel_margin_loss_shapes_and_values_match_cpu(dev, mode):
    import torch

    for name, (expected, got) in dev(_multilabel_margin_losses, mode).items():
        assert got.shape == expected.shape, (name, got.shape, expected.shape)  # () for one sample, not (1,)
        torch.testing.assert_close(got, expected, msg=name)
