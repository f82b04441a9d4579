"""Neural-network ops: activations and their backwards, softmax, layer/group/batch norm, nll_loss, attention.

Low-precision inputs compute in float32 and ``call`` rounds the result, as torch's CPU kernels do.
Backward ops whose formula is the vjp of the forward use ``jax.vjp`` on the forward lowering, so the
two cannot drift apart.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch

from tpudist.kernels import tpu_sdpa  # pure JAX; the Pallas kernels load only on a TPU
from tpudist.ops.lowerings._util import dim_of, is_low_precision, rounding_to, sigmoid, to_float, upcast
from tpudist.ops.registry import lowers, shapes_from_lowering
from tpudist.ops.rng import next_key

aten = torch.ops.aten


def _f(x):
    return upcast(to_float(x))


# -- activations -----------------------------------------------------------------------------------

@lowers(aten.relu.default)
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype)) if x.dtype != jnp.bool_ else x


@lowers(aten.gelu.default)
def gelu(x, *, approximate="none"):
    return jax.nn.gelu(_f(x), approximate=approximate == "tanh")


@lowers(aten.silu.default)
def silu(x):
    x = _f(x)
    return x * sigmoid(x)


@lowers(aten.mish.default)
def mish(x):
    x = _f(x)
    return x * jnp.tanh(jax.nn.softplus(x))


@lowers(aten.elu.default)
def elu(x, alpha=1, scale=1, input_scale=1):
    x = _f(x)
    return jnp.where(x > 0, x * scale, (jnp.expm1(x * input_scale)) * alpha * scale)


@lowers(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lowers(aten.hardtanh.default)
def hardtanh(x, min_val=-1, max_val=1):
    return jnp.clip(x, min_val, max_val) if x.dtype != jnp.bool_ else x


@lowers(aten.softplus.default)
def softplus(x, beta=1, threshold=20):
    x = _f(x)
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@lowers(aten.hardsigmoid.default)
def hardsigmoid(x):
    return jnp.clip(_f(x) / 6 + 0.5, 0, 1)


@lowers(aten.hardswish.default)
def hardswish(x):
    x = _f(x)
    return x * jnp.clip(x + 3, 0, 6) / 6


@lowers(aten.glu.default)
def glu(x, dim=-1):
    a, b = jnp.split(x, 2, axis=dim_of(dim, x.ndim))
    return upcast(a) * sigmoid(upcast(b))


@lowers(aten.threshold.default)
def threshold(x, threshold, value):
    return jnp.where(x <= threshold, jnp.asarray(value).astype(x.dtype), x)


@lowers(aten.threshold_backward.default)
def threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


@lowers(aten.sigmoid_backward.default)
def sigmoid_backward(grad, output):
    grad, output = upcast(grad), upcast(output)
    return grad * output * (1 - output)


@lowers(aten.tanh_backward.default)
def tanh_backward(grad, output):
    grad, output = upcast(grad), upcast(output)
    return grad * (1 - output * output)


def _vjp(forward, grad, x):
    x = _f(x)
    _, pullback = jax.vjp(forward, x)
    return pullback(upcast(grad).astype(x.dtype))[0]


@lowers(aten.silu_backward.default)
def silu_backward(grad, x):
    return _vjp(silu, grad, x)


@lowers(aten.gelu_backward.default)
def gelu_backward(grad, x, *, approximate="none"):
    return _vjp(lambda v: gelu(v, approximate=approximate), grad, x)


@lowers(aten.mish_backward.default)
def mish_backward(grad, x):
    return _vjp(mish, grad, x)


@lowers(aten.softplus_backward.default)
def softplus_backward(grad, x, beta, threshold):
    return _vjp(lambda v: softplus(v, beta, threshold), grad, x)


@lowers(aten.hardswish_backward.default)
def hardswish_backward(grad, x):
    x = _f(x)
    return upcast(grad) * jnp.where(x < -3, 0.0, jnp.where(x <= 3, x / 3 + 0.5, 1.0))


@lowers(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad, x):
    x = _f(x)
    return jnp.where((x > -3) & (x < 3), upcast(grad) / 6, 0.0)


@lowers(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@lowers(aten.hardtanh_backward.default)
def hardtanh_backward(grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros((), grad.dtype), grad)


@lowers(aten.elu_backward.default)
def elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result):
    g, y = upcast(grad), _f(self_or_result)
    if is_result:
        neg = g * input_scale * (y + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * jnp.exp(y * input_scale)
    return jnp.where(y > 0, g * scale, neg)


@lowers(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    return upcast(grad) * mask * scale


# -- softmax ---------------------------------------------------------------------------------------

@lowers(aten._softmax.default)
def softmax(x, dim, half_to_float=False):
    return jax.nn.softmax(upcast(x), axis=dim_of(dim, x.ndim)) if x.ndim else jnp.ones_like(upcast(x))


@lowers(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float=False):
    if not x.ndim:
        return jnp.zeros_like(upcast(x))
    if not x.size:  # nothing to normalise (the max below has no identity)
        return upcast(x)
    axis = dim_of(dim, x.ndim)
    if is_low_precision(x.dtype) and not half_to_float and axis == x.ndim - 1:
        # torch's CPU kernel along the last dim (LogSoftmaxKernelImpl.h serial_vec_log_softmax_lastdim_range)
        # keeps the sum of exponentials and its log in the input's dtype: x - max - bf16(log(bf16(sum))).
        # Without that rounding a third of the bf16 results were 1 ulp off, and so the loss's gradient.
        xf = upcast(x)
        shifted = xf - jnp.max(xf, axis=axis, keepdims=True)
        total = jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True).astype(x.dtype).astype(xf.dtype)
        return shifted - jnp.log(total).astype(x.dtype).astype(xf.dtype)
    return jax.nn.log_softmax(upcast(x), axis=axis)


@lowers(aten._softmax_backward_data.default)
def softmax_backward(grad_output, output, dim, input_dtype):
    g, y = upcast(grad_output), upcast(output)
    d = dim_of(dim, y.ndim) if y.ndim else None
    return y * (g - jnp.sum(g * y, axis=d, keepdims=True))


@lowers(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad_output, output, dim, input_dtype):
    g, y = upcast(grad_output), upcast(output)
    d = dim_of(dim, y.ndim) if y.ndim else None
    return g - jnp.exp(y) * jnp.sum(g, axis=d, keepdims=True)


# -- normalisation ---------------------------------------------------------------------------------

def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = upcast(x)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = (xf - mean) * rstd
    if weight is not None:
        out = out * upcast(weight)
    if bias is not None:
        out = out + upcast(bias)
    return out, mean, rstd


@lowers(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    return _layer_norm(x, normalized_shape, weight, bias, eps)


@lowers(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, n, c, hxw, group, eps):
    """torch's CPU kernel's formula: each group's mean and rstd in float32, then per channel
    ``x * scale + shift`` (scale = rstd * weight, shift = bias - mean * scale), rounded once. For
    bf16 this matched torch bit for bit over 32,000 random elements, where ``(x - mean) * rstd *
    weight + bias`` (torch's decomposition) left one element 13 ulps off: near zero the two
    formulas cancel differently."""
    xf = upcast(x)
    groups = xf.reshape(n, group, -1)
    mean = jnp.mean(groups, axis=-1)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(groups - mean[..., None]), axis=-1) + eps)
    per = c // group
    scale = jnp.repeat(rstd, per, axis=1)  # (n, c)
    if weight is not None:
        scale = scale * upcast(weight)
    shift = -scale * jnp.repeat(mean, per, axis=1)
    if bias is not None:
        shift = shift + upcast(bias)
    out = xf.reshape(n, c, -1) * scale[..., None] + shift[..., None]
    return out.reshape(x.shape), mean, rstd


@lowers(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, x, mean, rstd, weight, n, c, hxw, group, output_mask):
    """Gradients of :func:`native_group_norm` in float32 (torch's decomposition writes through an
    in-place ``unsqueeze_``, which the table cannot run)."""
    per = c // group
    g = upcast(grad_out).reshape(n, group, per, -1)
    r = upcast(rstd)[:, :, None, None]
    xhat = (upcast(x).reshape(n, group, per, -1) - upcast(mean)[:, :, None, None]) * r
    gw = g * upcast(weight).reshape(1, group, per, 1) if weight is not None else g
    axes = (2, 3)  # a group: its channels and their positions
    grad_x = r * (gw - jnp.mean(gw, axis=axes, keepdims=True) - xhat * jnp.mean(gw * xhat, axis=axes, keepdims=True))
    grad_w = jnp.sum(g * xhat, axis=(0, 3)).reshape(c) if weight is not None and output_mask[1] else None
    grad_b = jnp.sum(g, axis=(0, 3)).reshape(c) if output_mask[2] else None
    return grad_x.reshape(x.shape) if output_mask[0] else None, grad_w, grad_b


@lowers(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf, g = upcast(x), upcast(grad_out)
    xhat = (xf - upcast(mean)) * upcast(rstd)
    gw = g * upcast(weight) if weight is not None else g
    n = math.prod(normalized_shape)
    grad_x = upcast(rstd) / n * (n * gw - jnp.sum(gw, axis=axes, keepdims=True)
                                 - xhat * jnp.sum(gw * xhat, axis=axes, keepdims=True))
    outer = tuple(range(x.ndim - len(normalized_shape)))
    grad_w = jnp.sum(g * xhat, axis=outer) if weight is not None and output_mask[1] else None
    grad_b = jnp.sum(g, axis=outer) if bias is not None and output_mask[2] else None
    return grad_x if output_mask[0] else None, grad_w, grad_b


# -- batch norm ------------------------------------------------------------------------------------
# The correctly declared batch norm ops. native_batch_norm's schema hides its writes to running_mean/var,
# so the device routes it to these (as torch does for functionalization), and the functional twins
# return the new running statistics for the caller to write back. Statistics in float32, two passes
# (torch's CPU kernel accumulates in double), output as x * scale + shift per channel like torch's.
#
# Dtypes are torch's CPU kernel's (aten/src/ATen/native/Normalization.cpp), not its meta kernel's
# (CUDA's: float32 statistics for any low-precision input), so these ops are shapes_from_lowering:
# the saved mean and invstd are in the "parameter dtype", float32 when a bf16/f16 input comes with a
# float32 weight, bias or running statistic, else the input's dtype. In that low-precision dtype the
# CPU kernel also rounds the batch statistics before using them (for the output, the saved statistics
# and the running statistics), so a bf16 model's outputs, gradients and buffers depend on it. Measured
# bit for bit against torch 2.13's CPU kernel (tests/ops/test_ops_lowerings.py).

def _per_channel(x, v):
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def _bn_stats_dtype(x, *params):
    """torch's CPU ``param dtype`` (``is_mixed_type`` in Normalization.cpp)."""
    if is_low_precision(x.dtype) and any(p is not None and p.dtype == jnp.float32 for p in params):
        return jnp.dtype(jnp.float32)
    return x.dtype


def _round_to(v, dtype):
    return v.astype(dtype).astype(v.dtype) if is_low_precision(dtype) else v


def _bn_batch_stats(x, eps, dtype):
    """(mean, sum of squared deviations, rstd) per channel (dim 1) over every other dim, in float32,
    rounded through ``dtype`` where torch's CPU kernel stores them in it: the mean, the sum of squares,
    the variance (a bf16 sum divided by an int stays bf16) and rstd. Its channels-last kernel (also
    taken when each channel has one value per sample) sums the squares around the rounded mean."""
    xf = _f(x)
    axes = (0, *range(2, x.ndim))
    n = x.size // x.shape[1]
    mean = jnp.mean(xf, axis=axes)
    rounded_mean = _round_to(mean, dtype)
    center = rounded_mean if n == x.shape[0] else mean
    var_sum = _round_to(jnp.sum(jnp.square(xf - _per_channel(x, center)), axis=axes), dtype)
    rstd = _round_to(1 / jnp.sqrt(_round_to(var_sum / n, dtype) + eps), dtype)
    return rounded_mean, var_sum, rstd


def _bn_apply(x, mean, rstd, weight, bias):
    scale = rstd if weight is None else rstd * upcast(weight)
    shift = -mean * scale if bias is None else upcast(bias) - mean * scale
    return _f(x) * _per_channel(x, scale) + _per_channel(x, shift)


def _bn_update(x, var_sum, mean, running_mean, running_var, momentum, dtype):
    """New running statistics. In a low-precision ``dtype`` torch's CPU kernel runs this update in
    that dtype's arithmetic (momentum and 1 - momentum rounded to it, bf16 * bf16 products rounded),
    except that the unbiased variance is held in float32 (so its product with momentum is not rounded)."""
    n = x.size // x.shape[1]
    unbiased = var_sum / (n - 1) if n > 1 else var_sum * float("nan")  # torch: var_sum / (n - 1), 0/0 for one
    r = functools.partial(_round_to, dtype=dtype)
    keep, take = r(jnp.float32(1 - momentum)), r(jnp.float32(momentum))
    return (r(r(take * mean) + r(keep * upcast(running_mean))).astype(running_mean.dtype),
            r(take * r(unbiased) + r(keep * upcast(running_var))).astype(running_var.dtype))


def _bn_train(x, weight, bias, running_mean, running_var, eps):
    dtype = _bn_stats_dtype(x, weight, bias, running_mean, running_var)
    mean, var_sum, rstd = _bn_batch_stats(x, eps, dtype)
    out = _bn_apply(x, mean, rstd, weight, bias).astype(x.dtype)
    return out, mean.astype(dtype), rstd.astype(dtype), var_sum, mean, dtype


def _bn_eval(x, weight, bias, running_mean, running_var, eps):
    dtype = _bn_stats_dtype(x, weight, bias, running_mean, running_var)
    mean, rstd = upcast(running_mean), 1 / jnp.sqrt(upcast(running_var) + eps)
    return _bn_apply(x, mean, rstd, weight, bias).astype(x.dtype), mean.astype(dtype), rstd.astype(dtype)


@lowers(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return (*_bn_eval(x, weight, bias, running_mean, running_var, eps), running_mean, running_var)
    out, save_mean, save_rstd, var_sum, mean, dtype = _bn_train(x, weight, bias, running_mean, running_var, eps)
    return (out, save_mean, save_rstd, *_bn_update(x, var_sum, mean, running_mean, running_var, momentum, dtype))


@lowers(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_legit_no_stats(x, weight, bias, training, momentum, eps):
    if not training:  # torch 2.13's CPU kernel crashes here (segfault); nn modules never ask for it
        raise ValueError("_native_batch_norm_legit.no_stats with training=False has no statistics to normalize "
                         "with: pass running_mean/running_var, or training=True for batch statistics")
    return _bn_train(x, weight, bias, None, None, eps)[:3]


@lowers(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return _bn_eval(x, weight, bias, running_mean, running_var, eps)


@lowers(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, rstd, new_mean, new_var = native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, rstd, jnp.zeros((0,), jnp.uint8), new_mean, new_var  # reserve: cuDNN's, empty elsewhere


@lowers(aten._batch_norm_no_update.default)
def batch_norm_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    return (*_bn_eval(x, weight, bias, running_mean, running_var, eps), jnp.zeros((0,), jnp.uint8))


shapes_from_lowering(aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default,
                     aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
                     aten._batch_norm_with_update.default, aten._batch_norm_with_update_functional.default,
                     aten._batch_norm_no_update.default)


@lowers(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                               output_mask):
    """torch's CPU formula: in training the batch statistics' own gradients enter grad_input."""
    if train:
        mean, rstd = upcast(save_mean), upcast(save_invstd)
    else:
        mean, rstd = upcast(running_mean), 1 / jnp.sqrt(upcast(running_var) + eps)
    g, xc = upcast(grad_out), _f(x) - _per_channel(x, mean)
    axes = (0, *range(2, x.ndim))
    grad_sum = jnp.sum(g, axis=axes)
    dot = jnp.sum(g * xc, axis=axes)
    scale = rstd if weight is None else rstd * upcast(weight)
    if train:
        n = x.size // x.shape[1]
        k = dot * rstd * rstd / n
        grad_x = (g - xc * _per_channel(x, k) - _per_channel(x, grad_sum / n)) * _per_channel(x, scale)
    else:
        grad_x = g * _per_channel(x, scale)
    return (grad_x if output_mask[0] else None, dot * rstd if output_mask[1] else None,
            grad_sum if output_mask[2] else None)


# -- losses ----------------------------------------------------------------------------------------

def _nll_parts(x, target, weight, ignore_index):
    """Per-element (loss, weight) with the class dim of x at 1 (or 0 for an unbatched input)."""
    class_dim = 1 if x.ndim >= 2 else 0
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    picked = jnp.take_along_axis(upcast(x), jnp.expand_dims(safe, class_dim), axis=class_dim).squeeze(class_dim)
    w = jnp.ones(safe.shape, picked.dtype) if weight is None else upcast(weight)[safe]
    w = jnp.where(keep, w, 0)
    return -picked * w, w


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    loss, w = _nll_parts(x, target, weight, ignore_index)
    total = jnp.sum(w)
    if reduction == 0:
        return loss, jnp.zeros((), total.dtype)
    if reduction == 2:
        return jnp.sum(loss), total
    return jnp.sum(loss) / total, total


@lowers(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, x, target, weight, reduction, ignore_index, total_weight):
    class_dim = 1 if x.ndim >= 2 else 0
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    w = jnp.ones(safe.shape, jnp.float32) if weight is None else upcast(weight)[safe]
    w = jnp.where(keep, w, 0)
    g = upcast(grad_output)
    if reduction == 1:
        g = g / upcast(total_weight)
    scale = -w * g
    onehot = jax.nn.one_hot(safe, x.shape[class_dim], axis=class_dim, dtype=scale.dtype)
    return onehot * jnp.expand_dims(scale, class_dim)


# -- attention -------------------------------------------------------------------------------------

def _attention(q, k, v, attn_mask, is_causal, scale, dropout_p=0.0, key=None):
    """Math SDPA on (..., heads, seq, dim) in float32 at least; returns (out, logsumexp)."""
    dtype = jnp.promote_types(upcast(q).dtype, jnp.float32)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    if k.shape[-3] != q.shape[-3] and q.ndim >= 3:  # grouped-query attention
        rep = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, rep, axis=-3), jnp.repeat(v, rep, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("...qd,...kd->...qk", q, k) * scale
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        scores = jnp.where(jnp.tril(jnp.ones((L, S), jnp.bool_)), scores, -jnp.inf)
    if attn_mask is not None:
        scores = jnp.where(attn_mask, scores, -jnp.inf) if attn_mask.dtype == jnp.bool_ else scores + attn_mask
    # a row that hides every key: probabilities 0 (as torch's kernels) and a pullback of 0, not NaN (the
    # logsumexp of -infs has a 0/0 gradient, which a where after it does not stop), so its scores are replaced
    # before the logsumexp; other rows compute exactly what they did
    live = jnp.max(scores, axis=-1, keepdims=True) > -jnp.inf
    lse = jax.nn.logsumexp(jnp.where(live, scores, 0), axis=-1)
    probs = jnp.where(live, jnp.exp(scores - lse[..., None]), 0)
    probs = jnp.where(jnp.isnan(probs), 0, probs)
    lse = jnp.where(live[..., 0], lse, 0)  # torch's flash kernel: 0 there too
    if key is not None:
        keep = jax.random.bernoulli(key, 1 - dropout_p, probs.shape)
        probs = jnp.where(keep, probs / (1 - dropout_p), 0)
    return jnp.einsum("...qk,...kd->...qd", probs, v), lse


def _flash_blocks(q_len: int) -> tuple[int, int]:
    """(queries, keys) per block of torch's CPU flash attention (FlashAttentionKernel.cpp, torch 2.13)."""
    return (256 if q_len >= 768 else 64 if q_len >= 192 else 32), 512


def _bf16_product(spec, a, b):
    """``einsum(spec, a, b)`` of float32 operands holding bf16 values, as bf16 operands accumulated in
    float32: the same numbers (torch's CPU flash kernel multiplies them so), and one MXU pass on TPU
    at every float32 matmul precision, where float32 operands take six under "highest"."""
    return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _flash_scores(q, k, v, attn_mask, is_causal, scale):
    """float32 ``scale * q @ k.T (+ mask)`` with -inf where a key is hidden, and float32 q, k, v (k, v
    repeated for grouped-query attention) of bf16 ones."""
    q, k, v = upcast(q), upcast(k), upcast(v)
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, rep, axis=-3), jnp.repeat(v, rep, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = _bf16_product("...qd,...kd->...qk", q, k) * scale
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones(scores.shape[-2:], jnp.bool_)), scores, -jnp.inf)
    if attn_mask is not None:
        scores = (jnp.where(attn_mask, scores, -jnp.inf) if attn_mask.dtype == jnp.bool_
                  else scores + upcast(attn_mask))
    return scores, q, k, v, scale


def _flash_low_precision(q, k, v, attn_mask, is_causal, scale):
    """bf16 flash attention rounded where torch's CPU kernel rounds: it keeps scores, row maxima and
    sums in float32 but rounds the unnormalised probabilities ``exp(s - running max)`` to the input dtype
    before multiplying them with V, one block of 512 keys at a time (online softmax), and scales by the
    reciprocal of the sum at the end. Rounding once instead left 21-32% of bf16 outputs 1 ulp off. With larger
    scores 6-10% still differ: the kernel's exp is an approximation (exp_u20) whose error moves some roundings."""
    scores, _, _, v, _ = _flash_scores(q, k, v, attn_mask, is_causal, scale)
    rounded = rounding_to(q.dtype)
    row_max = jnp.full(scores.shape[:-1], -jnp.inf, jnp.float32)
    row_sum = jnp.zeros(scores.shape[:-1], jnp.float32)
    acc = jnp.zeros((*scores.shape[:-1], v.shape[-1]), jnp.float32)
    _, kv_block = _flash_blocks(scores.shape[-2])
    for n in range(0, scores.shape[-1], kv_block):
        block = scores[..., n:n + kv_block]
        new_max = jnp.maximum(row_max, jnp.max(block, axis=-1))
        live = new_max > -jnp.inf  # a row with every key so far hidden keeps max -inf, sum 0 (no NaN)
        shift = jnp.where(live, new_max, 0)
        p = jnp.where(live[..., None], jnp.exp(block - shift[..., None]), 0)
        rescale = jnp.where(live, jnp.exp(row_max - shift), 1)
        row_sum = jnp.sum(p, axis=-1) + rescale * row_sum
        acc = acc * rescale[..., None] + _bf16_product("...qk,...kd->...qd", rounded(p), v[..., n:n + kv_block, :])
        row_max = jnp.where(live, new_max, row_max)
    row_sum = jnp.where(row_sum == 0, 1, row_sum)  # fully masked rows give 0, as torch's kernel
    row_max = jnp.where(row_max == -jnp.inf, 0, row_max)
    return acc * (1 / row_sum)[..., None], row_max + jnp.log(row_sum)


def _flash_backward(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale):
    """The bf16 backward of torch's CPU kernel: ``p = exp(s - logsumexp)`` (0 where a key is hidden),
    ``dS = p * (dO @ V.T - rowsum(dO * O))``, with p and dS rounded to bf16 before their matmuls and the
    gradients accumulated in bf16 (dQ over key blocks; dK and dV over the query heads of a group, then over
    query blocks)."""
    scores, q32, k32, v32, scale = _flash_scores(q, k, v, attn_mask, is_causal, scale)
    rounded = rounding_to(q.dtype)
    g = upcast(grad_out)
    p = jnp.where(scores == -jnp.inf, 0, jnp.exp(scores - upcast(logsumexp)[..., None]))
    grad_scores = rounded(p * (_bf16_product("...qd,...kd->...qk", g, v32) - jnp.sum(g * upcast(out), -1)[..., None]))
    p = rounded(p)
    q_len, kv_len = scores.shape[-2:]
    q_block, kv_block = _flash_blocks(q_len)
    q_parts = range(0, q_len, q_block)
    kv_parts = range(0, kv_len, kv_block)

    def matmul(a, b, spec):  # every operand holds bf16 values: p and dS rounded, q, k, v and dO upcast
        return _bf16_product(spec, a, b)

    grad_q = []
    for m in q_parts:
        acc = 0.0
        for n in kv_parts:
            acc = rounded(acc + scale * matmul(grad_scores[..., m:m + q_block, n:n + kv_block],
                                               k32[..., n:n + kv_block, :], "...qk,...kd->...qd"))
        grad_q.append(acc)
    rep = q.shape[-3] // k.shape[-3]  # grouped-query attention: the group's query heads add up, one at a time

    def member(t, i):
        return t.reshape(*t.shape[:-3], k.shape[-3], rep, *t.shape[-2:])[..., i, :, :]

    grad_k, grad_v = [], []
    for n in kv_parts:
        acc_k = acc_v = 0.0
        for i in range(rep):
            for m in q_parts:
                acc_k = rounded(acc_k + scale * member(matmul(grad_scores[..., m:m + q_block, n:n + kv_block],
                                                              q32[..., m:m + q_block, :], "...qk,...qd->...kd"), i))
                acc_v = rounded(acc_v + member(matmul(p[..., m:m + q_block, n:n + kv_block], g[..., m:m + q_block, :],
                                                      "...qk,...qd->...kd"), i))
        grad_k.append(acc_k)
        grad_v.append(acc_v)
    grad_q, grad_k, grad_v = (jnp.concatenate(parts, axis=-2) for parts in (grad_q, grad_k, grad_v))
    return grad_q, grad_k, grad_v


@lowers(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    # float() of a traced dropout_p raises JAX's concretization error: the device then compiles the op
    # with its floats as constants, so p == 0 draws no key (as CPU's kernel draws none)
    key = None if float(dropout_p) == 0 else next_key()
    if key is None and (flash := tpu_sdpa.forward(q, k, v, attn_mask, is_causal, scale)) is not None:
        return flash  # on a TPU, where the Pallas kernels measured faster (tpudist/kernels/tpu_sdpa.py)
    if key is None and q.dtype == jnp.bfloat16:
        return _flash_low_precision(q, k, v, attn_mask, is_causal, scale)
    out, lse = _attention(q, k, v, attn_mask, is_causal, scale, dropout_p, key)
    return out, lse.astype(jnp.float32)


@lowers(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_flash_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                            scale=None):
    if float(dropout_p) != 0:  # float(): as in the forward
        raise NotImplementedError("the flash-attention backward with dropout_p > 0 cannot replay the forward's "
                                  "dropout mask; trace SDPA under the MATH backend "
                                  "(torch.nn.attention.sdpa_kernel(SDPBackend.MATH))")

    if (flash := tpu_sdpa.backward(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale)) is not None:
        return flash
    if q.dtype == jnp.bfloat16:
        return _flash_backward(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale)
    # float32/float16: the pullback of the forward. The closed form (the kernel's formula, as for bf16) is
    # further from the kernel's results when the softmax saturates: on ModuleInfo's TransformerEncoderLayer
    # inputs (uniform in [-9, 9], head dim 2) its largest gradient difference from CPU's, over 200 draws with
    # CPU's own out and logsumexp, was 8.0e-5 against the pullback's 4.6e-5 (medians 2.9e-6 / 2.7e-6)

    def forward(q, k, v):
        return _attention(q, k, v, attn_mask, is_causal, scale)[0]

    _, pullback = jax.vjp(forward, upcast(q), upcast(k), upcast(v))
    return pullback(upcast(grad_out).astype(jnp.promote_types(upcast(q).dtype, jnp.float32)))


# -- weight normalisation ----------------------------------------------------------------------------

def _weight_norm(v, g, dim):
    """``v * g / ||v||``, the norm over every dim but ``dim`` (all dims when ``dim`` is -1)."""
    axes = tuple(i for i in range(v.ndim) if i != dim)
    return v * (g / jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True)))


@lowers(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    # f32 math for bf16/f16, as torch's kernels accumulate; the gradients come back in v's and g's dtypes
    _, pullback = jax.vjp(lambda v, g: _weight_norm(v, g, dim), upcast(saved_v), upcast(saved_g))
    grad_v, grad_g = pullback(upcast(grad_w))
    return grad_v.astype(saved_v.dtype), grad_g.astype(saved_g.dtype)
