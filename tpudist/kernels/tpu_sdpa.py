"""The device's SDPA on a TPU: the Pallas flash attention, where it measured faster than XLA's.

``tpudist/ops/lowerings/nn.py`` lowers ``aten._scaled_dot_product_flash_attention_for_cpu`` (what
``F.scaled_dot_product_attention`` on tpu tensors becomes, ``tpudist/device/_attention.py``) and its
backward; it asks :func:`forward` and :func:`backward` first, which return None unless the Pallas
kernels (``flash_attention``) apply, and the lowering then runs its XLA attention as before. Off TPU
nothing changes: the first test is the platform.

The kernels apply when (:func:`why_not` says which rule fails):

- the arrays live on a TPU (the platform of concrete arrays; JAX's default backend while tracing);
- ``TPUDIST_PALLAS_SDPA`` is not ``0`` (read when the lowering traces: a program compiled before keeps
  its choice);
- no ``attn_mask`` (``is_causal`` is fine) and no dropout;
- q, k, v are bfloat16, 4-d, k/v heads divide q's heads, head_dim 64 or 128 (the head dims measured);
- seq_q and seq_k are at least ``MIN_SEQ`` (512).

The rule is where the kernels measured faster than both XLA attentions the device could run instead:
the jitted reference (einsum, float32 softmax, einsum) and this lowering's bf16 path today
(``_flash_low_precision`` / ``_flash_backward``, which mirror the rounding of torch's CPU kernel).
TPU v5e, JAX 0.10.2, batch 8, 16 query heads on 8 kv heads, bf16, milliseconds, forward / forward+backward
(``benchmarks/tpu_attention.py``; 2026-12-05)::

    seq  head_dim causal | Pallas        | XLA reference  | lowering today  | fwd+bwd vs the faster
    256  64       yes    | 0.211 / 0.379 | 0.124 /  0.212 |  0.202 /  0.397 | 0.56x: XLA stays
    512  64       yes    | 0.277 / 0.694 | 0.656 /  2.185 |  0.690 /  2.200 | 3.1x
    1024 64       yes    | 0.619 / 2.062 | 2.456 /  8.213 |  3.304 /  7.205 | 3.5x (the target model)
    1024 64       no     | 0.726 / 2.359 | 2.502 /  8.059 |  3.306 /  7.244 | 3.1x
    2048 64       yes    | 2.018 / 7.180 | 9.181 / 30.301 | 12.862 / 29.611 | 4.1x
    1024 128      yes    | 0.582 / 1.884 | 2.554 /  8.300 |  3.455 /  8.759 | 4.4x
    2048 128      yes    | 1.884 / 6.351 | 9.706 / 31.496 | 14.029 / 36.211 | 5.0x

float32 is left to XLA: at float32 accuracy (``Precision.HIGHEST`` in the kernels) they matched XLA's
default-precision attention (2.227 / 8.856 against 2.195 / 8.343 ms at seq 1024), and XLA's default is
one bf16 pass (3e-3 relative), which the kernels would only match by giving up float32 accuracy.
Sequences between 256 and 512 were not measured, so they stay on XLA.
"""

from __future__ import annotations

import os

import jax

ENV = "TPUDIST_PALLAS_SDPA"
MIN_SEQ = 512  # measured: 3.1x faster at 512, 0.56x at 256 (table above)
HEAD_DIMS = (64, 128)  # the head dims measured
DTYPES = ("bfloat16",)


def _platform(*arrays) -> str:
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return next(iter(x.devices())).platform
    return jax.default_backend()


def why_not(q, k, v, attn_mask=None, dropout_p: float = 0.0) -> str | None:
    """None when the device's SDPA runs the Pallas kernels for these inputs, else the rule that fails."""
    if _platform(q, k, v) != "tpu":
        return f"the arrays are not on a TPU (platform {_platform(q, k, v)!r})"
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if attn_mask is not None or dropout_p != 0:
        return "an attn_mask or dropout (the kernels take is_causal only)"
    if not (q.ndim == k.ndim == v.ndim == 4) or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"q, k, v of 4 dims with kv heads dividing q heads (got q={q.shape}, k={k.shape})"
    if not (str(q.dtype) == str(k.dtype) == str(v.dtype)) or str(q.dtype) not in DTYPES:
        return f"dtype {q.dtype}: the kernels measured faster for {DTYPES} only"
    if q.shape[3] not in HEAD_DIMS or v.shape[3] != q.shape[3]:
        return f"head_dim {q.shape[3]} (v: {v.shape[3]}): measured for {HEAD_DIMS}"
    if min(q.shape[2], k.shape[2]) < MIN_SEQ:
        return f"seq_q={q.shape[2]}, seq_k={k.shape[2]}: XLA is faster below {MIN_SEQ}"
    return None


def forward(q, k, v, attn_mask, is_causal: bool, scale):
    """``(out, logsumexp)`` from the Pallas forward kernel, or None where it does not apply."""
    if why_not(q, k, v, attn_mask) is not None:
        return None
    from tpudist.kernels.flash_attention import flash_attention_forward

    return flash_attention_forward(q, k, v, causal=bool(is_causal), scale=scale)


def backward(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal: bool, scale):
    """``(dq, dk, dv)`` from the Pallas dq and dk/dv kernels, or None where they do not apply."""
    if why_not(q, k, v, attn_mask) is not None:
        return None
    from tpudist.kernels.flash_attention import flash_attention_backward

    return flash_attention_backward(q, k, v, out, logsumexp, grad_out, causal=bool(is_causal), scale=scale)


__all__ = ["DTYPES", "ENV", "HEAD_DIMS", "MIN_SEQ", "backward", "forward", "why_not"]
