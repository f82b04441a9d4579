"""The batch-norm pieces ``nn.SyncBatchNorm`` calls between its collectives (torch has them for CUDA only).

SyncBatchNorm computes per-rank statistics (``batch_norm_stats``), all-gathers them with the counts,
combines them (``batch_norm_gather_stats_with_counts``), normalizes (``batch_norm_elemt``), and in
backward reduces per rank (``batch_norm_backward_reduce``), all-reduces, and finishes per element
(``batch_norm_backward_elemt``). The formulas are CUDA's (aten/src/ATen/native/cuda/Normalization.cuh):
statistics in float32 (the accumulation type) whatever the input's dtype, the elementwise results in
the input's dtype. ``batch_norm_gather_stats_with_counts`` also updates the running statistics in
place, which its schema does not declare: the lowering here is the pure part, and the "tpu" device
writes the running statistics (``tpudist.device._kernels``).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpudist.ops.lowerings._util import to_float, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _channels(x, v):
    """A per-channel vector ``v`` shaped to broadcast against ``x`` (channels at dim 1)."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def _reduce_axes(x):
    return (0, *range(2, x.ndim))


def _acc(x):
    return upcast(to_float(x))


@lowers(aten.batch_norm_stats.default)
def batch_norm_stats(x, eps):
    """(mean, invstd) per channel of this rank's input: biased variance, two passes."""
    xf = _acc(x)
    mean = jnp.mean(xf, axis=_reduce_axes(x))
    var = jnp.mean(jnp.square(xf - _channels(x, mean)), axis=_reduce_axes(x))
    return mean, 1 / jnp.sqrt(var + eps)


def combine_stats(mean_all, invstd_all, counts, eps):
    """(mean, biased var, total count) of the union of the ranks' batches from their (mean, invstd,
    count): each rank's variance is recovered as ``1 / invstd**2 - eps``, as CUDA does."""
    n = _acc(counts).reshape(-1, 1)
    means, var = upcast(mean_all), 1 / jnp.square(upcast(invstd_all)) - eps
    total = jnp.sum(n, axis=0)
    mean = jnp.sum(n * means, axis=0) / total
    m2 = jnp.sum(n * (var + jnp.square(means - mean)), axis=0)
    return mean, m2 / total, total


@lowers(aten.batch_norm_gather_stats_with_counts.default)
def batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps,
                                        counts):
    """The global (mean, invstd) from every rank's; the running statistics are the device's to write."""
    mean, var, _ = combine_stats(mean_all, invstd_all, counts, eps)
    return mean.astype(mean_all.dtype), (1 / jnp.sqrt(var + eps)).astype(mean_all.dtype)


@lowers(aten.batch_norm_gather_stats.default)
def batch_norm_gather_stats(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, count):
    counts = jnp.full((mean_all.shape[0],), count, jnp.float32)
    return batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum,
                                               eps, counts)


@lowers(aten.batch_norm_elemt.default)
def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    scale = upcast(invstd) if weight is None else upcast(invstd) * upcast(weight)
    shift = -upcast(mean) * scale if bias is None else upcast(bias) - upcast(mean) * scale
    return (_acc(x) * _channels(x, scale) + _channels(x, shift)).astype(x.dtype)


@lowers(aten.batch_norm_backward_reduce.default)
def batch_norm_backward_reduce(grad_out, x, mean, invstd, weight, input_g, weight_g, bias_g):
    """(sum_dy, sum_dy_xmu, grad_weight, grad_bias) of this rank's part of the batch."""
    g, xc = _acc(grad_out), _acc(x) - _channels(x, upcast(mean))
    sum_dy = jnp.sum(g, axis=_reduce_axes(x))
    sum_dy_xmu = jnp.sum(g * xc, axis=_reduce_axes(x))
    param_dtype = x.dtype if weight is None else weight.dtype
    grad_weight = (sum_dy_xmu * upcast(invstd)).astype(param_dtype)
    return sum_dy, sum_dy_xmu, grad_weight, sum_dy.astype(param_dtype)


@lowers(aten.batch_norm_backward_elemt.default)
def batch_norm_backward_elemt(grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """grad_input from the all-reduced sums; ``count`` holds every rank's element count per channel."""
    total = jnp.sum(_acc(count))
    mean_dy, mean_dy_xmu = upcast(sum_dy) / total, upcast(sum_dy_xmu) / total
    rstd = upcast(invstd)
    scale = rstd if weight is None else rstd * upcast(weight)
    xc = _acc(x) - _channels(x, upcast(mean))
    grad = (_acc(grad_out) - _channels(x, mean_dy) - xc * _channels(x, rstd * rstd * mean_dy_xmu)) \
        * _channels(x, scale)
    return grad.astype(x.dtype)
