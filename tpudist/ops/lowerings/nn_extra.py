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
from tpudist.ops.registry import lowers, shapes_from_lowering

aten = torch.ops.aten


def _f(x):
    return upcast(to_float(x))


def _pullback(forward, grad, x):
    xf = _f(x)
    y, vjp = jax.vjp(forward, xf)
    return vjp(upcast(grad).astype(y.dtype).reshape(y.shape))[0]  # (a (1,) meta result may get a () grad)


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
        "src_key_padding_mask; build it with TransformerEncoder(..., enable_nested_tensor=False) (for an "
        "nn.Transformer, set model.encoder.use_nested_tensor = False; same results, except that CPU's "
        "nested path zeroes the padded positions) or call "
        "torch.backends.mha.set_fastpath_enabled(False)")


# -- activation and loss backwards ----------------------------------------------------------------

@lowers(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def shrink_backward(grad_out, x, lambd):
    # both pass the gradient where |x| > lambd and zero it elsewhere (ATen's shrink_backward kernel)
    return jnp.where(jnp.abs(x) > lambd, grad_out, jnp.zeros((), grad_out.dtype))


def _vjp_through_table(op, grad, x, *rest):
    """The gradient w.r.t. ``x`` of ``op(x, *rest)`` (its first result), as its lowering or
    decomposition computes it (``tpudist.ops.call``)."""
    from tpudist.ops.interpret import call

    def forward(v):
        out = call(op, v, *rest)
        return out[0] if isinstance(out, (tuple, list)) else out

    return _pullback(forward, grad, x)


@lowers(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad_out, x, target, p, margin, weight=None, reduction=1):
    """ATen's formula (MultiMarginCriterion.cpp): a hinge counts only where it is > 0 (a vjp through
    max(0, z) would give half a gradient at z == 0)."""
    xf = _f(x).reshape(-1, x.shape[-1] if x.ndim else 1)  # a 0-d input is one sample of one class
    t = target.reshape(-1)
    picked = jnp.take_along_axis(xf, t[:, None], axis=1)
    z = margin - picked + xf
    other = jnp.arange(xf.shape[1])[None] != t[:, None]
    slope = jnp.where(other & (z > 0), 1.0 if p == 1 else 2.0 * z, 0.0).astype(xf.dtype) / xf.shape[1]
    if weight is not None:
        slope = slope * _f(weight)[t][:, None]
    g = upcast(grad_out)
    g = g.reshape(-1, 1) / (xf.shape[0] if reduction == 1 else 1) if reduction != 0 else g.reshape(-1, 1)
    dx = slope - jax.nn.one_hot(t, xf.shape[1], dtype=slope.dtype) * jnp.sum(slope, axis=1, keepdims=True)
    return (dx * g).reshape(x.shape)


@lowers(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_out, x, target, reduction, is_target):
    return _vjp_through_table(aten.multilabel_margin_loss_forward.default, grad_out, x, target, reduction)


# -- max pooling: adaptive windows, and backwards from the flat indices of the forward -------------

def _adaptive_max(x, output_size):
    """(values, flat indices into each input plane) of adaptive max pooling over the last
    len(output_size) dims; window i of a dim of size L is [floor(i*L/out), ceil((i+1)*L/out)). Windows
    are padded to the longest by repeating their last element, which leaves the first maximum first."""
    nd, lead = len(output_size), x.ndim - len(output_size)
    sizes = x.shape[lead:]
    gathers, flat = [], 0
    for d, (size, out) in enumerate(zip(sizes, output_size)):
        starts = np.array([(i * size) // out for i in range(out)])
        ends = np.array([-(-((i + 1) * size) // out) for i in range(out)])
        window = np.minimum(starts[:, None] + np.arange(max(ends - starts, default=1))[None], ends[:, None] - 1)
        shape = [1] * (2 * nd)
        shape[2 * d:2 * d + 2] = window.shape
        gathers.append(window.reshape(shape))
        flat = flat * size + gathers[-1]
    per_dim = [2 * d for d in range(nd)] + [2 * d + 1 for d in range(nd)]  # (out_0, out_1, .., k_0, k_1, ..)
    patches = x[(Ellipsis, *gathers)]  # lead + (out_0, k_0, out_1, k_1, ...)
    patches = patches.transpose(*range(lead), *[lead + a for a in per_dim])
    patches = patches.reshape(x.shape[:lead] + tuple(output_size) + (-1,))
    flat = np.broadcast_to(flat, np.broadcast_shapes(*[w.shape for w in gathers])).transpose(per_dim)
    flat = jnp.asarray(flat.reshape(tuple(output_size) + (-1,)))
    best = jnp.argmax(patches, axis=-1)[..., None]
    values = jnp.take_along_axis(patches, best, axis=-1)[..., 0]
    return values, jnp.take_along_axis(jnp.broadcast_to(flat, patches.shape), best, axis=-1)[..., 0]


@lowers(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(x, output_size):
    values, indices = _adaptive_max(x, list(output_size))
    return values, indices.astype(jnp.int64)


def _scatter_to_planes(grad, x, indices, nd):
    """The backward of a max pooling: each output's gradient added at its flat index into its input
    plane (the last ``nd`` dims of x)."""
    lead = x.shape[:x.ndim - nd]
    rows = int(np.prod(lead, dtype=np.int64))
    g = upcast(grad).reshape(rows, -1)
    idx = indices.reshape(rows, -1)
    plane = int(np.prod(x.shape[x.ndim - nd:], dtype=np.int64))
    out = jnp.zeros((rows, plane), g.dtype).at[jnp.arange(rows)[:, None], idx].add(g)
    return out.reshape(x.shape)


@lowers(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad, x, indices):
    return _scatter_to_planes(grad, x, indices, 2)


@lowers(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad, x, indices):
    return _scatter_to_planes(grad, x, indices, 3)


@lowers(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_planes(grad, x, indices, 3)


@lowers(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(x, target, reduction):
    """(loss, is_target) as ATen's CPU kernel. torch 2.13's decomposition does not drop the slots after
    a row's first -1 (a row [2, -1, 0, 0] also counts label 0 twice), so it is not used."""
    xf = _f(x).reshape((-1, x.shape[-1]) if x.ndim else (1, 1))
    t = target.reshape(xf.shape)
    dim = xf.shape[1]
    valid = jnp.cumprod(t != -1, axis=-1).astype(bool)  # the target slots before the first -1
    safe = jnp.where(valid, t, 0)
    picked = jnp.take_along_axis(xf, safe, axis=-1)  # x[target[k]] per slot k
    is_target = jnp.any((jnp.arange(dim) == safe[:, :, None]) & valid[:, :, None], axis=1)
    hinge = jnp.maximum(1.0 - picked[:, :, None] + xf[:, None, :], 0.0) / dim  # (row, slot, class)
    per_row = jnp.sum(jnp.where(valid[:, :, None] & ~is_target[:, None, :], hinge, 0.0), axis=(1, 2))
    if reduction == 1:
        loss = jnp.mean(per_row)
    elif reduction == 2:
        loss = jnp.sum(per_row)
    else:
        loss = per_row.reshape(x.shape[:-1])  # () for one sample, as CPU (see shapes_from_lowering below)
    return loss.astype(x.dtype), is_target.astype(x.dtype).reshape(target.shape)


# torch 2.13's meta kernel gives an unreduced loss of one sample (1-d input) the shape (1,); its CPU
# kernel, like this lowering, gives (): the device reads the result shapes off the lowering
shapes_from_lowering(aten.multilabel_margin_loss_forward.default)


# -- embedding bags ---------------------------------------------------------------------------------
# Result shapes follow torch's meta kernel (the device allocates from it), which differs from the CPU
# kernel's in the auxiliary results: offset2bag always has one entry per index, bag_size one per offset,
# max_indices is (0,) unless mode is max. Only the backward ops below read them.

_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset):
    if indices.ndim != 1:
        raise ValueError(f"aten._embedding_bag takes 1-D indices with offsets, got indices of shape "
                         f"{tuple(indices.shape)}; call torch.nn.functional.embedding_bag, which flattens 2-D input")
    num_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    # the bag of index i: the last bag whose start offset is <= i (empty bags repeat an offset)
    offset2bag = jnp.searchsorted(offsets[:num_bags], jnp.arange(indices.shape[0]), side="right") - 1
    return jnp.clip(offset2bag, 0, max(num_bags - 1, 0)), num_bags


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    offset2bag, num_bags = _bags(indices, offsets, include_last_offset)
    keep = indices != padding_idx
    rows = upcast(weight)[indices]
    if per_sample_weights is not None:
        rows = rows * upcast(per_sample_weights)[:, None]
    count = jax.ops.segment_sum(keep.astype(jnp.int64), offset2bag, num_bags)
    bag_size = jnp.zeros(offsets.shape[0], jnp.int64).at[:num_bags].set(count)
    if mode == _MAX:
        masked = jnp.where(keep[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(masked, offset2bag, num_bags)
        first = jnp.where(keep[:, None] & (masked == best[offset2bag]), jnp.arange(indices.shape[0])[:, None],
                          indices.shape[0])
        at = jax.ops.segment_min(first, offset2bag, num_bags)  # the first maximal row, as the CPU loop
        nonempty = count[:, None] > 0
        max_indices = jnp.where(nonempty, indices[jnp.clip(at, 0, indices.shape[0] - 1)], 0)
        return jnp.where(nonempty, best, 0), offset2bag, bag_size, max_indices
    total = jax.ops.segment_sum(jnp.where(keep[:, None], rows, 0), offset2bag, num_bags)
    if mode == _MEAN:
        total = total / jnp.maximum(count, 1)[:, None].astype(total.dtype)
    return total, offset2bag, bag_size, jnp.zeros((0,), jnp.int64)


@lowers(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    g = upcast(grad)
    out = jnp.zeros((num_weights, g.shape[-1]), g.dtype)
    if mode == _MAX:
        nonempty = (bag_size[:g.shape[0]] > 0)[:, None]
        cols = jnp.broadcast_to(jnp.arange(g.shape[-1]), g.shape)
        return out.at[maximum_indices, cols].add(jnp.where(nonempty, g, 0))
    contrib = g[offset2bag]
    if mode == _MEAN:
        contrib = contrib / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(g.dtype)
    if per_sample_weights is not None:
        contrib = contrib * upcast(per_sample_weights)[:, None]
    if scale_grad_by_freq:
        freq = jnp.zeros(num_weights, g.dtype).at[indices].add(1)
        contrib = contrib / freq[indices][:, None]
    contrib = jnp.where((indices != padding_idx)[:, None], contrib, 0)
    return out.at[indices].add(contrib)


@lowers(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    if mode != _SUM:
        raise ValueError(f"embedding_bag: per_sample_weights are only supported for mode='sum', got mode={mode}")
    dots = jnp.sum(upcast(grad)[offset2bag] * upcast(weight)[indices], axis=-1)
    return jnp.where(indices != padding_idx, dots, 0)


@lowers(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag with sparse=True: sparse gradients do not exist on the 'tpu' "
                                  "device; build nn.EmbeddingBag with sparse=False")
    if offset2bag.shape[0] != indices.shape[0]:  # CPU's sum mode leaves it empty: rebuild it from offsets
        offset2bag = _bags(indices, offsets, False)[0]
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lowers(aten.rrelu_with_noise_functional.default)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """ATen's CPU rule (RReLU): in training each element <= 0 is scaled by a slope drawn from
    U(lower, upper), which also goes into noise, and the others get slope 1; in eval every negative
    element is scaled by (lower + upper) / 2 and noise is returned as it came."""
    from tpudist.ops.rng import next_key

    xf = _f(x)
    if not training:
        return jnp.where(xf >= 0, xf, xf * ((lower + upper) / 2)), noise
    slopes = jax.random.uniform(next_key(), x.shape, xf.dtype, lower, upper)
    slopes = jnp.where(xf <= 0, slopes, 1)
    return xf * slopes, slopes.astype(noise.dtype)


# -- fractional max pooling: the window starts come from random_samples, an input, so it is deterministic

def _fractional_starts(sample, size, out, pool):
    """ATen's generate_intervals (FractionalMaxPool2d.cpp), in the input's float type as there:
    start i = int((i + u) * alpha) - int(u * alpha), alpha = (size - pool) / (out - 1); the last is size - pool."""
    i = jnp.arange(out, dtype=sample.dtype)
    if out > 1:
        alpha = jnp.asarray(size - pool, sample.dtype) / jnp.asarray(out - 1, sample.dtype)
        starts = ((i + sample[..., None]) * alpha).astype(jnp.int32) - (sample[..., None] * alpha).astype(jnp.int32)
    else:
        starts = jnp.zeros(sample.shape + (out,), jnp.int32)
    return starts.at[..., out - 1].set(size - pool) if out else starts


def _fractional_max(x, kernel_size, output_size, samples):
    """(values, flat indices into each plane) over the last nd dims; samples (N, C, nd) hold, per plane,
    the uniform draw of each dim, in the order ATen reads them (2-D: W then H; 3-D: T, H, W)."""
    nd = len(output_size)
    planes = x.reshape((-1,) + x.shape[-nd - 1:])  # (N, C, *spatial), unbatched input as N = 1
    sizes = planes.shape[2:]
    order = [1, 0] if nd == 2 else [0, 1, 2]
    s = samples[:planes.shape[0]].astype(upcast(to_float(x)).dtype)  # ATen reads rows 0..N-1 only
    starts = [_fractional_starts(s[..., order[d]], sizes[d], output_size[d], kernel_size[d]) for d in range(nd)]

    def one_plane(plane, *plane_starts):
        gathers, flat = [], 0
        for d in range(nd):
            window = plane_starts[d][:, None] + jnp.arange(kernel_size[d])[None]  # (out_d, k_d)
            shape = [1] * (2 * nd)
            shape[2 * d:2 * d + 2] = window.shape
            gathers.append(window.reshape(shape))
            flat = flat * sizes[d] + gathers[-1]
        per_dim = [2 * d for d in range(nd)] + [2 * d + 1 for d in range(nd)]
        patches = plane[tuple(gathers)].transpose(per_dim).reshape(tuple(output_size) + (-1,))
        full = tuple(n for d in range(nd) for n in (output_size[d], kernel_size[d]))
        flat = jnp.broadcast_to(flat, full).transpose(per_dim).reshape(patches.shape)
        best = jnp.argmax(patches, axis=-1)[..., None]  # the first maximum, as ATen's strict > scan
        return (jnp.take_along_axis(patches, best, axis=-1)[..., 0], jnp.take_along_axis(flat, best, axis=-1)[..., 0])

    fn = jax.vmap(jax.vmap(one_plane))
    values, indices = fn(planes, *starts)
    lead = x.shape[:-nd]
    return values.reshape(lead + tuple(output_size)), indices.reshape(lead + tuple(output_size)).astype(jnp.int64)


@lowers(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(x, kernel_size, output_size, random_samples):
    return _fractional_max(x, list(kernel_size), list(output_size), random_samples)


@lowers(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_to_planes(grad, x, indices, 2)


@lowers(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_to_planes(grad, x, indices, 3)


# -- CTC loss ---------------------------------------------------------------------------------------

def _ctc_labels(targets, target_lengths, batch, max_len, blank):
    """(N, 2 * max_len + 1) extended labels blank, t1, blank, t2, ..., blank; targets are (N, S) padded
    or the 1-D concatenation of each sample's targets."""
    s = jnp.arange(max_len)
    if targets.ndim == 1:
        starts = jnp.cumsum(target_lengths) - target_lengths
        labels = targets[jnp.clip(starts[:, None] + s[None], 0, max(targets.shape[0] - 1, 0))] \
            if targets.shape[0] else jnp.zeros((batch, max_len), jnp.int64)
    else:
        labels = targets[:, :max_len]
    labels = jnp.where(s[None] < target_lengths[:, None], labels, blank)
    extended = jnp.full((batch, 2 * max_len + 1), blank, labels.dtype)
    return extended.at[:, 1::2].set(labels)


def _logsumexp(*terms):
    """log(sum(exp(terms))) elementwise whose gradient is 0, not NaN, where every term is -inf."""
    top = terms[0]
    for t in terms[1:]:
        top = jnp.maximum(top, t)
    finite = jnp.isfinite(top)
    shift = jnp.where(finite, top, 0.0)
    total = sum(jnp.exp(t - shift) for t in terms)
    return jnp.where(finite, shift + jnp.log(jnp.where(finite, total, 1.0)), -jnp.inf)


def _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank):
    """(negative log likelihood (N,), log_alpha (N, T, 2S+1)) by the alpha recursion of Graves et al.
    (2006), in log space; a time step past a sample's input length leaves its alphas as they were."""
    lp = upcast(log_probs)
    if lp.ndim == 2:  # unbatched (T, C)
        lp = lp[:, None]
    steps, batch = lp.shape[0], lp.shape[1]
    if isinstance(target_lengths, jax.core.Tracer):  # the widest a sample's targets can be
        max_len = targets.shape[-1]
    else:  # int[] lengths (the .default overload) or a concrete tensor: as torch's meta kernel
        max_len = int(np.max(np.asarray(target_lengths), initial=0))
    input_lengths = jnp.asarray(input_lengths).reshape(batch)
    target_lengths = jnp.asarray(target_lengths).reshape(batch)
    labels = _ctc_labels(targets, target_lengths, batch, max_len, blank)  # (N, L)
    width = labels.shape[1]
    s = jnp.arange(width)
    skip = (s >= 2) & (labels != blank) & (labels != jnp.roll(labels, 2, axis=1))  # may come from s - 2
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(labels[None], (steps, batch, width)), axis=2)  # (T, N, L)
    first = jnp.where(s[None] < jnp.minimum(2, 2 * target_lengths[:, None] + 1), emit[0], -jnp.inf)

    def step(alpha, t):
        prev1 = jnp.concatenate([jnp.full((batch, 1), -jnp.inf), alpha[:, :-1]], axis=1)
        prev2 = jnp.concatenate([jnp.full((batch, 2), -jnp.inf), alpha[:, :-2]], axis=1)
        total = _logsumexp(alpha, prev1, jnp.where(skip, prev2, -jnp.inf)) + emit[t]
        alpha = jnp.where((t < input_lengths)[:, None], total, alpha)
        return alpha, alpha

    last, rest = jax.lax.scan(step, first, jnp.arange(1, steps))
    log_alpha = jnp.concatenate([first[None], rest], axis=0).transpose(1, 0, 2)  # (N, T, L)
    end = 2 * target_lengths
    final = _logsumexp(jnp.take_along_axis(last, end[:, None], axis=1)[:, 0],
                          jnp.where(end > 0, jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None],
                                                                  axis=1)[:, 0], -jnp.inf))
    return -final, log_alpha


@lowers(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # zero_infinity only matters in the backward here: ATen's _ctc_loss returns inf, ctc_loss zeroes it
    nll, log_alpha = _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank)
    return nll.reshape(() if log_probs.ndim == 2 else nll.shape), log_alpha


@lowers(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity=False):
    """ATen's CTC gradient, which is not d nll / d log_probs: it is exp(log_probs) * grad minus the
    label posteriors, the gradient with respect to the logits when log_probs came from log_softmax
    (ctc_loss_backward_cpu_template); zero past each input length and, with zero_infinity, for
    infinite losses."""
    lp = upcast(log_probs)
    nll, pullback = jax.vjp(lambda v: _ctc_forward(v, targets, input_lengths, target_lengths, blank)[0], lp)
    g = upcast(grad).reshape(nll.shape)
    if zero_infinity:
        g = jnp.where(jnp.isinf(nll), 0.0, g)
    posterior_part = pullback(g)[0]
    batched = (lp if lp.ndim == 3 else lp[:, None])
    gb = g.reshape(1, -1, 1)
    out = jnp.exp(batched) * gb + posterior_part.reshape(batched.shape)
    if not zero_infinity:  # an impossible alignment: ATen's formula gives exp(... + inf) terms, NaN
        out = jnp.where(jnp.isinf(nll).reshape(1, -1, 1), jnp.nan, out)
    steps = jnp.arange(batched.shape[0])[:, None, None]
    out = jnp.where(steps < jnp.asarray(input_lengths).reshape(1, -1, 1), out, 0.0)
    return out.reshape(lp.shape)
