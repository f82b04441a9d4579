"""The shipped kernels: RMSNorm and causal attention, each with its pure-JAX reference.

The functions a model calls have the semantics of ``tpudist/training/model.py``:

    rms_norm(x, weight, eps)            # RMSNorm.forward: f32 statistics, type_as(x), * weight
    attention(q, k, v, causal=True)     # F.scaled_dot_product_attention(q, k, v, is_causal=causal)

``rms_norm_pallas`` and ``attention_pallas`` are the same computations as Pallas TPU kernels with
Pallas backward kernels (``pallas_rms_norm``: row blocks; ``flash_attention``: a flash attention with
causal tile skipping and grouped-query heads; interpret mode off TPU, compiled by Mosaic on TPU;
``pallas=True`` in the functions below). :func:`warmup` compiles them for given shapes into JAX's
persistent compile cache (``python -m tpudist warmup``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from tpudist.kernels.kernel import custom_jax_kernel

_FLOATS = ("float16", "bfloat16", "float32", "float64")


# -- RMSNorm ------------------------------------------------------------------------------------------
def rms_norm_reference(x, weight, *, eps: float = 1e-6):
    """RMSNorm in JAX: statistics in float32, normalised value cast back to x's dtype, times weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def _check_rms_norm(x, weight, *, eps: float = 1e-6):
    if x.ndim < 1 or weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        return "x of shape (..., dim) and weight of shape (dim,)"
    if str(x.dtype) not in _FLOATS or str(weight.dtype) not in _FLOATS:
        return f"floating-point x and weight ({', '.join(_FLOATS)})"
    if not eps >= 0:
        return "eps >= 0"
    return None


rms_norm_kernel = custom_jax_kernel("tpudist::rms_norm", shard_dims="... _, _ -> ... _",
                                    check=_check_rms_norm)(rms_norm_reference)


def _fits_pallas_rms_norm(x, weight) -> bool:
    from tpudist.kernels.pallas_rms_norm import KERNEL_DTYPES

    return str(x.dtype) in KERNEL_DTYPES and str(weight.dtype) in KERNEL_DTYPES


def _pallas_rms_norm(x, weight, *, eps: float = 1e-6):
    """The Pallas RMSNorm (``pallas_rms_norm``); float16/float64 inputs run the reference (Mosaic has no
    64-bit floats and v5e no f16 arithmetic), with the same result."""
    if not _fits_pallas_rms_norm(x, weight):
        return rms_norm_reference(x, weight, eps=eps)
    from tpudist.kernels.pallas_rms_norm import rms_norm_forward

    return rms_norm_forward(x, weight, eps=eps)


def _pallas_rms_norm_backward(x, weight, grad, *, eps: float = 1e-6):
    if not _fits_pallas_rms_norm(x, weight):
        return jax.vjp(lambda x, w: rms_norm_reference(x, w, eps=eps), x, weight)[1](grad)
    from tpudist.kernels.pallas_rms_norm import rms_norm_backward

    return rms_norm_backward(x, weight, grad, eps=eps)


rms_norm_pallas_kernel = custom_jax_kernel("tpudist::rms_norm_pallas", backward=_pallas_rms_norm_backward,
                                           shard_dims="... _, _ -> ... _",
                                           check=_check_rms_norm)(_pallas_rms_norm)


# -- attention ----------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal: bool = True, scale: float = 0.0):
    """Scaled dot-product attention on ``(batch, heads, seq, head_dim)``; softmax in float32.

    ``causal`` masks like SDPA's ``is_causal`` (top-left aligned); ``scale=0`` means 1/sqrt(head_dim).
    k and v may have fewer heads than q (grouped-query attention: query head h reads kv head
    ``h // (q_heads // kv_heads)``, SDPA's ``enable_gqa=True``).
    """
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    if k.shape[1] != q.shape[1]:
        k, v = (jnp.repeat(t, q.shape[1] // k.shape[1], axis=1) for t in (k, v))
    logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        mask = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), dtype=bool))
        logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v.astype(jnp.float32)).astype(q.dtype)


def _check_attention(q, k, v, *, causal: bool = True, scale: float = 0.0):
    if not (q.ndim == k.ndim == v.ndim == 4):
        return "q, k, v of 4 dims (batch, heads, seq, head_dim)"
    if (k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        return ("q (batch, heads, seq_q, head_dim), k (batch, kv_heads, seq_k, head_dim), "
                "v (batch, kv_heads, seq_k, head_dim_v): q's batch, and heads a multiple of kv_heads "
                "(grouped-query attention)")
    if not (str(q.dtype) == str(k.dtype) == str(v.dtype)) or str(q.dtype) not in _FLOATS:
        return f"q, k, v of one floating-point dtype ({', '.join(_FLOATS)})"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "seq_q >= 1 and seq_k >= 1"
    return None


attention_kernel = custom_jax_kernel("tpudist::attention", shard_dims="b h _ _, b h _ _, b h _ _ -> b h _ _",
                                     check=_check_attention)(attention_reference)


def _pallas_attention(q, k, v, *, causal: bool = True, scale: float = 0.0):
    """The Pallas flash attention (``flash_attention``); float16/float64 run the reference (Mosaic has no
    64-bit floats and v5e no f16 matmul), with the same result."""
    from tpudist.kernels.flash_attention import KERNEL_DTYPES, flash_attention

    if str(q.dtype) not in KERNEL_DTYPES:
        return attention_reference(q, k, v, causal=causal, scale=scale)
    return flash_attention(q, k, v, causal=causal, scale=scale or None)


def _pallas_attention_backward(q, k, v, grad, *, causal: bool = True, scale: float = 0.0):
    """The dq and dk/dv kernels (the forward runs again for its logsumexp: a kernel's backward op gets
    the inputs only)."""
    return jax.vjp(lambda q, k, v: _pallas_attention(q, k, v, causal=causal, scale=scale), q, k, v)[1](grad)


attention_pallas_kernel = custom_jax_kernel("tpudist::attention_pallas", backward=_pallas_attention_backward,
                                            shard_dims="b h _ _, b h _ _, b h _ _ -> b h _ _",
                                            check=_check_attention)(_pallas_attention)


# -- what a model calls -------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, pallas: bool = False) -> torch.Tensor:
    """RMSNorm as ``tpudist/training/model.py``'s ``RMSNorm.forward`` computes it, as one JAX kernel.

    ``x.float() * rsqrt(mean(x.float()**2, -1) + eps)``, cast back to ``x.dtype``, times ``weight``
    (result dtype: torch's promotion of the two). ``pallas=True`` runs the Pallas kernel instead.

    Example:
        >>> rms_norm(torch.randn(2, 8, 64), torch.ones(64), 1e-5).shape
        torch.Size([2, 8, 64])
    """
    kernel = rms_norm_pallas_kernel if pallas else rms_norm_kernel
    return kernel(x, weight, eps=float(eps))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, *, pallas: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` as one JAX kernel.

    Shapes ``(batch, heads, seq, head_dim)``; k and v may have fewer heads than q, a divisor of q's
    (grouped-query attention, as SDPA's ``enable_gqa=True``). ``pallas=True`` runs the Pallas flash
    attention instead (bf16/float32; other dtypes run the reference).

    Example:
        >>> q = torch.randn(2, 4, 16, 8)
        >>> attention(q, q, q).shape
        torch.Size([2, 4, 16, 8])
    """
    kernel = attention_pallas_kernel if pallas else attention_kernel
    return kernel(q, k, v, causal=bool(causal), scale=0.0 if scale is None else float(scale))


KERNELS = (rms_norm_kernel, rms_norm_pallas_kernel, attention_kernel, attention_pallas_kernel)


def warmup(*, batch: int = 8, seq_len: int = 32, dim: int = 64, n_heads: int = 4,
           dtypes: tuple[torch.dtype, ...] = (torch.float32,), eps: float = 1e-5) -> int:
    """Compiles every shipped kernel, forward and backward, for a decoder of this shape.

    With the persistent compile cache on (``tpudist.runtime.jax_cache.enable_persistent_cache``), later
    processes calling the kernels on these shapes skip XLA compilation. Returns the programs compiled.
    """
    if dim % n_heads:
        raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}")
    count = 0
    for dtype in dtypes:
        x = torch.empty(batch, seq_len, dim, dtype=dtype, device="meta")
        weight = torch.empty(dim, dtype=dtype, device="meta")
        for kernel in (rms_norm_kernel, rms_norm_pallas_kernel):
            count += kernel.compile(x, weight, eps=float(eps))
        q = torch.empty(batch, n_heads, seq_len, dim // n_heads, dtype=dtype, device="meta")
        for kernel in (attention_kernel, attention_pallas_kernel):
            count += kernel.compile(q, q, q, causal=True, scale=0.0)
    return count


__all__ = ["KERNELS", "attention", "attention_kernel", "attention_pallas_kernel", "attention_reference", "rms_norm", "rms_norm_kernel",
           "rms_norm_pallas_kernel", "rms_norm_reference", "warmup"]
