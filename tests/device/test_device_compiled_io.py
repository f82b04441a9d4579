"""What crosses a compiled graph's edge on tpu tensors, against CPU eager: the activations a forward
saves for its backward leave it in their own shape (a ``Shaped`` storage value, not flattened: on a
TPU that reshape is a copy of the tensor), and every other use of such a storage reads it as usual."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tpudist.compile.program import STATS

MODES = ("strict", "fused")


def _tanh_layer(w, x):
    y = torch.tanh(x @ w)  # tanh's backward reads its output: y is saved, and returned to the caller too
    return y, (y * y).sum()


def _run(device: str, compiled: bool):
    torch.manual_seed(0)
    w = torch.randn(6, 5).to(device).requires_grad_()
    x = torch.randn(4, 6).to(device)
    f = torch.compile(_tanh_layer, backend="tpu", fullgraph=True, dynamic=False) if compiled else _tanh_layer
    y, loss = f(w, x)
    loss.backward()
    y = y.detach()

    def host(t):  # a copy of its own (a CPU tensor's .cpu() is the tensor itself)
        return t.cpu().clone()

    seen = {"y": host(y), "grad": host(w.grad), "picked": host(y.view(-1)[7]), "t": host(y.t() + 1),
            "rows": host(y[1:3]), "copy": host(copy.deepcopy(y))}
    buffer = io.BytesIO()
    torch.save(y, buffer)
    buffer.seek(0)
    seen["saved"] = host(torch.load(buffer))
    y.mul_(2).add_(1)  # in place, in the storage the forward made
    seen["in_place"] = host(y)
    y.untyped_storage().resize_(8 * y.element_size())  # FSDP2 frees and shrinks storages so
    seen["resized"] = host(torch.empty(0, device=device).set_(y.untyped_storage(), 0, (8,), (1,)))
    return seen


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_a_saved_activation_the_caller_keeps_reads_as_cpu(mode):
    before = STATS.shaped_results
    torch._dynamo.reset()  # noqa: SLF001
    got, want = _run("tpu", compiled=True), _run("cpu", compiled=False)
    assert STATS.shaped_results > before  # y left the forward in its own shape
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def _layouts(x):
    return ((x * 2).transpose(1, 3), (x + 1).contiguous(memory_format=torch.channels_last), x[:, :, ::2] * 3)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_results_keep_eager_strides(mode):
    """A compiled graph's results on the device keep eager's dense strides (their storage in that
    physical order), so views of eager's layout work; values and gradients as CPU eager."""
    torch._dynamo.reset()  # noqa: SLF001
    x = torch.randn(2, 3, 4, 5)
    xd, xe = x.to("tpu").requires_grad_(), x.clone().requires_grad_()
    got, want = torch.compile(_layouts, backend="tpu", fullgraph=True, dynamic=False)(xd), _layouts(xe)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.stride() == w.stride(), (i, g.stride(), w.stride())
        torch.testing.assert_close(g.cpu(), w.detach(), msg=str(i))
    torch.testing.assert_close(got[1].permute(0, 2, 3, 1).view(-1, 3).cpu(), want[1].permute(0, 2, 3, 1).view(-1, 3))
    weights = [torch.randn(w.shape) for w in want]  # not ints that change per call: test_device_decode counts
    sum((g * k.to("tpu")).sum() for g, k in zip(got, weights)).backward()  # the kernels such ints compile
    sum((w * k).sum() for w, k in zip(want, weights)).backward()
    torch.testing.assert_close(xd.grad.cpu(), xe.grad)
