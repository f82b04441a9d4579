"""Less common nn ops: the transformer inference fast paths, adaptive max pooling, embedding bags, the
backwards of shrink activations and margin losses.

torch 2.13's ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` take their fused inference path
(``_native_multi_head_attention`` / ``_transformer_encoder_layer_fwd``) on any PrivateUse1 device in eval
mode without grad, so the device lowers them rather than steering torch off its fast path.
Backward ops are the vjp of their forward lowering (``jax.vjp``), so the two cannot disagree.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.ops.lowerings._util import to_float, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _f(x):
    return upcast(to_float(x))


def _pullback(forward, grad, x):
    xf = _f(x)
    _, vjp = jax.vjp(forward, xf)
    return vjp(upcast(grad).astype(xf.dtype))[0]


# -- transformer fast paths ------------------------------------------------------------------------

def _masked_softmax(scores, mask, mask_type):
    """ATen's ``masked_softmax`` (transformers/attention.cpp): any mask becomes bool (nonzero = masked
    out, so a float mask of 0 / -inf works and other float values mask too); type 1 is a (B, S) key
    padding mask, others broadcast. A fully masked row is NaN, as on the CPU."""
    if mask is not None:
        masked = mask != 0
        if mask_type == 1:
            masked = masked.reshape(masked.shape[0], 1, 1, masked.shape[-1])
        scores = jnp.where(masked, -jnp.inf, scores)
    shifted = scores - jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(shifted)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _mha(query, key, value, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
         mask_type):
    """(output (B, T, D), attention weights (B, H, T, S)) of ATen's native_multi_head_attention_cpu."""
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim={embed_dim} must divide evenly by num_heads={num_heads}")
    head_dim = embed_dim // num_heads
    wq, wk, wv = jnp.split(_f(qkv_weight), 3)
    bq, bk, bv = jnp.split(_f(qkv_bias), 3)

    def heads(x, w, b):
        y = _f(x) @ w.T + b
        return y.reshape(y.shape[0], y.shape[1], num_heads, head_dim).transpose(0, 2, 1, 3)

    q = heads(query, wq, bq) * (1.0 / math.sqrt(head_dim))  # (q + bias) / sqrt(head_dim), as ATen
    k, v = heads(key, wk, bk), heads(value, wv, bv)
    weights = _masked_softmax(q @ k.swapaxes(-1, -2), mask, mask_type)
    ctx = (weights @ v).transpose(0, 2, 1, 3).reshape(query.shape[0], query.shape[1], embed_dim)
    return ctx @ _f(proj_weight).T + _f(proj_bias), weights


@lowers(aten._native_multi_head_attention.default)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True,
                                mask_type=None):
    out, weights = _mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                        mask, mask_type)
    if not need_weights:  # the CPU kernel returns an undefined tensor; torch's meta kernel a (0,) one
        return out, jnp.zeros((0,), out.dtype)
    return out, (jnp.mean(weights, axis=1) if average_attn_weights else weights)


def _norm(x, weight, bias, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * _f(weight) + _f(bias)


@lowers(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                                  norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None,
                                  mask_type=None):
    """ATen's transformer_encoder_layer_forward (transformers/transformer.cpp), dense inputs only (the
    nested-tensor path never reaches a device kernel: "tpu" tensors cannot be nested)."""
    x0 = _f(src)
    if x0.size == 0:
        return x0

    def attend(x):
        return _mha(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                    mask_type)[0]

    def ffn(x):
        h = x @ _f(ffn_weight_1).T + _f(ffn_bias_1)
        h = jax.nn.gelu(h, approximate=False) if use_gelu else jnp.maximum(h, 0)
        return h @ _f(ffn_weight_2).T + _f(ffn_bias_2)

    if norm_first:
        x = x0 + attend(_norm(x0, norm_weight_1, norm_bias_1, eps))
        return x + ffn(_norm(x, norm_weight_2, norm_bias_2, eps))
    x = _norm(x0 + attend(x0), norm_weight_1, norm_bias_1, eps)
    return _norm(x + ffn(x), norm_weight_2, norm_bias_2, eps)


@lowers(aten._nested_tensor_from_mask_left_aligned.default)
def nested_tensor_from_mask_left_aligned(t, mask):
    """Whether every row of ``mask`` (True = a real token) is ones then zeros: nn.TransformerEncoder's
    check before its nested-tensor fast path (a data-dependent bool: it runs outside jax.jit)."""
    m = np.asarray(mask).astype(bool).reshape(mask.shape[0], -1)
    return bool(np.all(m[:, 1:] <= m[:, :-1]))


@lowers(aten._nested_tensor_from_mask.default)
def nested_tensor_from_mask(t, mask, mask_check=True):
    raise NotImplementedError(
        "aten._nested_tensor_from_mask: nested tensors cannot live on the 'tpu' device, and "
        "nn.TransformerEncoder takes its nested-tensor fast path in eval mode under no_grad when given a "
        "src_key_padding_mask; build it with TransformerEncoder(..., enable_nested_tensor=False) (same "
        "results, except that CPU's nested path zeroes the padded positions) or call "
        "torch.backends.mha.set_fastpath_enabled(False)")
