"""The shipped kernels: RMSNorm and causal attention, each with its pure-JAX reference.

The functions a model calls have the semantics of ``tpudist/training/model.py``:

    rms_norm(x, weight, eps)            # RMSNorm.forward: f32 statistics, type_as(x), * weight
    attention(q, k, v, causal=True)     # F.scaled_dot_product_attention(q, k, v, is_causal=causal)

``rms_norm_pallas`` and ``attention_pallas`` are the same computations as Pallas kernels (row /
query blocks; interpret mode on CPU, compiled on TPU) whose gradients are the vjp of the pure-JAX
references (``pallas=True`` in the functions below). :func:`warmup` compiles them
for given shapes into JAX's persistent compile cache (``python -m tpudist warmup``).
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


def _pallas_rms_norm(x, weight, *, eps: float = 1e-6):
    from jax.experimental import pallas as pl

    dim = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    out_dtype = jnp.result_type(x.dtype, weight.dtype)
    # TPU blocks: the row count a multiple of 8 (or the whole array), the last dim whole.
    block = rows
    if rows % 8 == 0:
        block = max(b for b in range(8, min(rows, 256) + 1, 8) if rows % b == 0)

    def kernel(x_ref, w_ref, o_ref):
        xf = x_ref[...].astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        o_ref[...] = (normed.astype(x.dtype) * w_ref[...]).astype(out_dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, dim), out_dtype),
        grid=(rows // block,),
        in_specs=[pl.BlockSpec((block, dim), lambda i: (i, 0)), pl.BlockSpec((1, dim), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((block, dim), lambda i: (i, 0)),
    )(x.reshape(rows, dim), weight.reshape(1, dim))
    return out.reshape(x.shape)


rms_norm_pallas_kernel = custom_jax_kernel("tpudist::rms_norm_pallas", reference=rms_norm_reference,
                                           shard_dims="... _, _ -> ... _",
                                           check=_check_rms_norm)(_pallas_rms_norm)


# -- attention ----------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal: bool = True, scale: float = 0.0):
    """Scaled dot-product attention on ``(batch, heads, seq, head_dim)``; softmax in float32.

    ``causal`` masks like SDPA's ``is_causal`` (top-left aligned); ``scale=0`` means 1/sqrt(head_dim).
    """
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        mask = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), dtype=bool))
        logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v.astype(jnp.float32)).astype(q.dtype)


def _check_attention(q, k, v, *, causal: bool = True, scale: float = 0.0):
    if not (q.ndim == k.ndim == v.ndim == 4):
        return "q, k, v of 4 dims (batch, heads, seq, head_dim)"
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]:
        return ("q (batch, heads, seq_q, head_dim), k (batch, heads, seq_k, head_dim), "
                "v (batch, heads, seq_k, head_dim_v): equal batch and heads (repeat kv heads for "
                "grouped-query attention)")
    if not (str(q.dtype) == str(k.dtype) == str(v.dtype)) or str(q.dtype) not in _FLOATS:
        return f"q, k, v of one floating-point dtype ({', '.join(_FLOATS)})"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "seq_q >= 1 and seq_k >= 1"
    return None


attention_kernel = custom_jax_kernel("tpudist::attention", shard_dims="b h _ _, b h _ _, b h _ _ -> b h _ _",
                                     check=_check_attention)(attention_reference)


def _pallas_attention(q, k, v, *, causal: bool = True, scale: float = 0.0):
    """One grid step per (batch x head, block of queries): scores against all keys, softmax, times v."""
    from jax.experimental import pallas as pl

    batch, heads, seq_q, head_dim = q.shape
    seq_k, head_dim_v = k.shape[2], v.shape[3]
    scale = scale or 1.0 / math.sqrt(head_dim)
    block = seq_q  # TPU blocks: a multiple of 8 query rows (or all of them), whole key and head dims
    if seq_q % 8 == 0:
        block = max(b for b in range(8, min(seq_q, 128) + 1, 8) if seq_q % b == 0)

    def kernel(q_ref, k_ref, v_ref, o_ref):
        start = pl.program_id(1) * block
        logits = jnp.dot(q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32).T) * scale
        if causal:
            rows = start + jax.lax.broadcasted_iota(jnp.int32, (block, seq_k), 0)
            cols = jax.lax.broadcasted_iota(jnp.int32, (block, seq_k), 1)
            logits = jnp.where(cols <= rows, logits, -jnp.inf)
        weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
        weights = weights / weights.sum(axis=-1, keepdims=True)
        o_ref[...] = jnp.dot(weights, v_ref[...].astype(jnp.float32)).astype(o_ref.dtype)

    sq = pl.squeezed
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch * heads, seq_q, head_dim_v), q.dtype),
        grid=(batch * heads, seq_q // block),
        in_specs=[pl.BlockSpec((sq, block, head_dim), lambda h, i: (h, i, 0)),
                  pl.BlockSpec((sq, seq_k, head_dim), lambda h, i: (h, 0, 0)),
                  pl.BlockSpec((sq, seq_k, head_dim_v), lambda h, i: (h, 0, 0))],
        out_specs=pl.BlockSpec((sq, block, head_dim_v), lambda h, i: (h, i, 0)),
    )(q.reshape(batch * heads, seq_q, head_dim), k.reshape(batch * heads, seq_k, head_dim),
      v.reshape(batch * heads, seq_k, head_dim_v))
    return out.reshape(batch, heads, seq_q, head_dim_v)


attention_pallas_kernel = custom_jax_kernel("tpudist::attention_pallas", reference=attention_reference,
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

    Shapes ``(batch, heads, seq, head_dim)``; k and v have q's heads (repeat them first for
    grouped-query attention, as the model does). ``pallas=True`` runs the Pallas kernel instead.

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

    With the persistent compile cache on (``tpudist.jax_cache.enable_persistent_cache``), later
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
