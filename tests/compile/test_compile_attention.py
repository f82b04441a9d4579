"""Attention in compiled graphs means what it means in eager torch: the fused op, forward and backward.

Eager torch runs ``F.scaled_dot_product_attention`` as one fused kernel (CPU tensors: torch's CPU flash
kernel, float32 accumulation over bf16 inputs; tpu tensors: the device's fused op, the same). The
compiled graphs keep that op and its backward (``_scaled_dot_product_flash_attention_for_cpu`` and
``..._backward``), which the op table lowers as the device does (on a TPU chip: the Pallas flash
kernels where they fit). Tracing through the math backend instead upcast bf16 attention to float32
matmuls, six bf16 passes each on the chip. A graph whose attention drops out keeps the math backend
(the fused backward cannot replay a dropout mask). Values and gradients are compared with CPU eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpudist.testing import RankPool

FUSED = "aten._scaled_dot_product_flash_attention_for_cpu.default"
FUSED_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
# bf16 results may be 1 ulp apart where XLA sums in another order than torch's CPU kernel
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=600, env={"TPUDIST_EAGER_MODE": "fused"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _attention(q, k, v, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def run_attention(device: str, dtype: torch.dtype, dropout_p: float = 0.0) -> dict:
    """Compiled attention on ``device`` against CPU eager: the ops of the graphs the backend compiled,
    the largest differences of the output and of each input's gradient (or None with dropout: its
    draws differ by design), the output's shape and whether every result is finite."""
    if device == "tpu":
        import tpudist.device  # noqa: F401
    from tpudist.compile import program

    ops: list[str] = []

    class Recording(program.GraphProgram):
        def __init__(self, gm, *args, **kwargs):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            super().__init__(gm, *args, **kwargs)

    real, program.GraphProgram = program.GraphProgram, Recording
    try:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randn(2, 4, 48, 32, generator=g).to(dtype) for _ in range(3)]
        cotangent = torch.randn(2, 4, 48, 32, generator=g).to(dtype)
        eager_in = [t.clone().requires_grad_() for t in inputs]
        eager = _attention(*eager_in, dropout_p)
        eager.backward(cotangent)
        got_in = [t.to(device).requires_grad_() for t in inputs]
        torch._dynamo.reset()  # noqa: SLF001 - each case compiles its own graphs
        got = torch.compile(_attention, backend="tpu", fullgraph=True, dynamic=False)(*got_in, dropout_p)
        got.backward(cotangent.to(device))
    finally:
        program.GraphProgram = real
    results = [got.detach().cpu(), *[t.grad.cpu() for t in got_in]]
    differences = None
    if dropout_p == 0:
        differences = [float((a.float() - b.float()).abs().max())
                       for a, b in zip(results, [eager.detach(), *[t.grad for t in eager_in]])]
        tolerance = TOLERANCE[dtype]
        for a, b in zip(results, [eager.detach(), *[t.grad for t in eager_in]]):
            torch.testing.assert_close(a, b, **tolerance)
    return {"ops": ops, "differences": differences, "shape": tuple(got.shape),
            "finite": all(bool(r.float().isfinite().all()) for r in results)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_attention_of_cpu_tensors_is_the_fused_op(dtype):
    out = run_attention("cpu", dtype)
    assert FUSED in out["ops"] and FUSED_BACKWARD in out["ops"], out["ops"]
    assert "aten.bmm.default" not in out["ops"], out["ops"]  # no math decomposition beside it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_attention_of_device_tensors_is_the_fused_op(dev, dtype):
    out = dev(run_attention, "tpu", dtype)
    assert FUSED in out["ops"] and FUSED_BACKWARD in out["ops"], out["ops"]
    assert "aten.bmm.default" not in out["ops"], out["ops"]


def test_attention_with_dropout_is_traced_through_the_math_backend(dev):
    for out in (run_attention("cpu", torch.float32, 0.25), dev(run_attention, "tpu", torch.float32, 0.25)):
        assert FUSED not in out["ops"] and FUSED_BACKWARD not in out["ops"], out["ops"]
        assert out["shape"] == (2, 4, 48, 32) and out["finite"], out
