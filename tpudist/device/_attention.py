"""``F.scaled_dot_product_attention`` on tpu tensors as one op, not ten.

torch picks an SDPA backend per device through a C++ dispatch stub that a Python backend cannot
fill, so on a PrivateUse1 device every SDPA call took the MATH path: ~10 recorded ops per call (two
scaled copies, two bmm, softmax, the fully-masked-row guard ``isneginf``/``all``/``where``, ...),
each a kernel, each a shape that changes per token in decoding. Here SDPA is registered at
AutogradPrivateUse1 and, where the fused backend applies, runs as one op
(``_scaled_dot_product_flash_attention_for_cpu``, whose lowering is one JAX attention) with its own
backward, the way CPU tensors take the flash kernel.

The fused backend applies when, as for torch's own fused backends: ``dropout_p == 0`` (the mask of a
dropout cannot be replayed by the backward), the mask does not need a gradient, the inputs are 4-d
plain tpu tensors (no FakeTensor, DTensor or other subclass: those keep torch's decomposition), the
value's head dim equals the query's, no functorch transform or dispatch mode is active, and the
OVERRIDEABLE backend is enabled (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`` restores the
MATH path). Otherwise torch's MATH decomposition runs, as before. A backward with ``create_graph=True``
(a gradient penalty) recomputes through the MATH decomposition, so the double backward is exact.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_MATH = aten._scaled_dot_product_attention_math.default
_LIBS: list = []
STATS = {"fused": 0, "math": 0}  # SDPA calls per path in this process (tests read it)
# Inside torch.compile's trace of a graph (tpudist.compile), tensors are FakeTensors under AOTAutograd's
# dispatch modes: the fused op is recorded all the same, and the compiled program lowers it as eager does
_TRACING_FOR_COMPILE = contextvars.ContextVar("tpudist_sdpa_tracing_for_compile", default=False)


@contextlib.contextmanager
def fused_in_compile_traces():
    """SDPA on tpu tensors records the fused op (and its backward) in the graphs traced inside."""
    token = _TRACING_FOR_COMPILE.set(True)
    try:
        yield
    finally:
        _TRACING_FOR_COMPILE.reset(token)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        out, lse = _FORWARD(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): a backward that is itself differentiable
            return (*_math_backward(ctx, grad_out, q, k, v, mask), None, None, None)
        gq, gk, gv = _BACKWARD(grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask,
                               scale=ctx.scale)
        return gq, gk, gv, None, None, None


def _math_backward(ctx, grad_out, q, k, v, mask):
    """The gradients through torch's MATH decomposition, recomputed with a graph (for a double backward)."""
    inputs = [t for t, needed in zip((q, k, v), ctx.needs_input_grad) if needed]
    with torch.enable_grad():
        out = _MATH(q, k, v, mask, 0.0, ctx.is_causal, None, scale=ctx.scale, enable_gqa=k.shape[1] != q.shape[1])[0]
        grads = iter(torch.autograd.grad(out, inputs, grad_out, create_graph=True))
    return [next(grads) if needed else None for needed in ctx.needs_input_grad[:3]]


def _fused_applies(q, k, v, mask, dropout_p, enable_gqa) -> bool:
    if dropout_p != 0.0 or not torch._C._get_overrideable_sdp_enabled():  # noqa: SLF001
        return False
    tracing = _TRACING_FOR_COMPILE.get()
    if not tracing and (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[-1] != q.shape[-1]:
        return False
    if k.shape[-3] != q.shape[-3] and not (enable_gqa and q.shape[-3] % k.shape[-3] == 0):
        return False  # heads that differ without enable_gqa: the MATH path raises torch's own error
    if mask is not None and ((not tracing and type(mask) is not torch.Tensor) or mask.requires_grad):
        return False
    if not tracing and (torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active()):  # noqa: SLF001
        return False
    return True


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """The AutogradPrivateUse1 kernel of ``aten::scaled_dot_product_attention``."""
    if _fused_applies(q, k, v, attn_mask, dropout_p, enable_gqa):
        STATS["fused"] += 1
        return _FusedAttention.apply(q, k, v, attn_mask, is_causal, scale)
    STATS["math"] += 1
    if not torch._C._get_math_sdp_enabled():  # noqa: SLF001
        raise RuntimeError("scaled_dot_product_attention on tpu tensors: the MATH backend is disabled and the "
                           "fused backend does not apply (it needs dropout_p=0, 4-d plain tpu tensors, a mask "
                           "without grad); enable SDPBackend.MATH or SDPBackend.OVERRIDEABLE")
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # as torch's own SDPA does before its MATH op (which would add a bool mask as 1.0/0.0)
        attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    return _MATH(q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def register() -> None:
    """Install the kernel (once, from ``tpudist.device``'s import)."""
    lib = torch.library.Library("aten", "IMPL")
    _LIBS.append(lib)
    lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1", with_keyset=False)
