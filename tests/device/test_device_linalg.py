"""torch.linalg on tpu tensors and through torch.compile(backend="tpu"), against CPU torch: det and
slogdet of contiguous, transposed and sliced inputs (torch factors A^T for a contiguous real A and A
otherwise, returns that LU, and its backward reads A's strides to know which), and the errors torch's
checks raise (_linalg_check_errors, which AOTAutograd runs under with_effects)."""

from __future__ import annotations

import pytest

VIEWS = ("contiguous", "transposed", "sliced")


def _det_and_slogdet(device: str, view: str, compiled: bool):
    import torch

    def f(x):
        a = {"contiguous": x[..., :4].contiguous(), "transposed": x[..., :4].mT, "sliced": x[..., :4]}[view]
        det = torch.ops.aten._linalg_det(a)
        slog = torch.ops.aten._linalg_slogdet(a)
        return [*det, *slog], det[0].sum() + slog[1].sum() + torch.linalg.inv(a).sum()

    fn = torch.compile(f, backend="tpu", fullgraph=True, dynamic=False) if compiled else f
    x = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    outs, total = fn(x)
    grad, = torch.autograd.grad(total, [x])
    return [o.detach().cpu() for o in outs] + [grad.cpu()]


def run_det(view: str, mode: str):
    import torch

    import tpudist.compile  # noqa: F401 - the "tpu" compile backend
    import tpudist.device  # noqa: F401
    from tpudist.ops.opcheck import compare

    torch.tpu.set_eager_mode("strict" if mode == "compiled" else mode)
    return compare(_det_and_slogdet("cpu", view, False),
                   _det_and_slogdet("tpu", view, mode == "compiled"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("view", VIEWS)
def test_det_and_slogdet_factor_what_cpu_factors(dev, view, mode):
    assert dev(run_det, view, mode) is None


def run_singular(compiled: bool):
    import torch

    import tpudist.compile  # noqa: F401 - the "tpu" compile backend
    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode("strict")
    a = torch.ones(2, 3, 3)
    fn = torch.linalg.inv
    if compiled:
        fn = torch.compile(lambda x: torch.linalg.inv(x) * 2, backend="tpu", fullgraph=True, dynamic=False)
    messages = []
    for f, x in ((torch.linalg.inv, a), (fn, a.to("tpu")), (fn, a)):  # CPU eager; ours (compiled: on CPU too)
        try:
            f(x).cpu()
            messages.append(None)
        except Exception as err:  # noqa: BLE001 - the message is what is compared
            messages.append(str(err))
    return messages


@pytest.mark.parametrize("compiled", [False, True], ids=["strict", "compiled"])
def test_singular_inverse_raises_torch_s_error(dev, compiled):
    cpu, *ours = dev(run_singular, compiled)
    assert cpu.startswith("linalg.inv: (Batch element 0): The diagonal element 2 is zero")
    assert ours[0] is not None and cpu in ours[0]
    if compiled:
        assert ours[1] is not None and cpu in ours[1]
