"""Pooling, FFTs and pairwise distances: the Core ATen ops torch has no decomposition for.

Backward ops are the vjp of the forward lowering (``jax.vjp``), so the two cannot disagree.
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


def _tuple(v, n):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    """torch's avg_pool{2,3}d over the last ``nd`` dims (ATen/native/cpu/AvgPoolKernel.cpp)."""
    k = _tuple(kernel_size, nd)
    s = _tuple(stride, nd) if stride else k
    p = _tuple(padding, nd)
    sizes = x.shape[-nd:]
    outs, extra = [], []
    for size, kk, ss, pp in zip(sizes, k, s, p):
        span = size + 2 * pp - kk
        out = (-(-span // ss) if ceil_mode else span // ss) + 1
        if ceil_mode and (out - 1) * ss >= size + pp:  # the last window must start inside input + left pad
            out -= 1
        outs.append(out)
        extra.append(max(0, (out - 1) * ss + kk - (size + 2 * pp)))
    lead = x.ndim - nd
    pads = [(0, 0)] * lead + [(pp, pp + e) for pp, e in zip(p, extra)]
    xf = upcast(to_float(x))
    window, strides = (1,) * lead + tuple(k), (1,) * lead + tuple(s)
    total = jax.lax.reduce_window(xf, 0.0, jax.lax.add, window, strides, pads)
    if divisor_override:
        return total / divisor_override
    if count_include_pad:  # padding cells count (as ones), the extra ceil_mode cells do not
        ones = jnp.ones([size + 2 * pp for size, pp in zip(sizes, p)], xf.dtype)
        pads_ones = [(0, e) for e in extra]
    else:
        ones = jnp.ones(sizes, xf.dtype)
        pads_ones = [(pp, pp + e) for pp, e in zip(p, extra)]
    count = jax.lax.reduce_window(ones, 0.0, jax.lax.add, tuple(k), tuple(s), pads_ones)
    return total / count


@lowers(aten.avg_pool2d.default)
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@lowers(aten.avg_pool3d.default)
def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


def _pullback(forward, grad, x):
    xf = upcast(to_float(x))
    _, vjp = jax.vjp(forward, xf)
    return vjp(upcast(grad).astype(xf.dtype))[0]


@lowers(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _pullback(lambda v: _avg_pool(v, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                         divisor_override, 2), grad, x)


@lowers(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _pullback(lambda v: _avg_pool(v, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                         divisor_override, 3), grad, x)


def _adaptive_avg(x, output_size):
    """Adaptive average pooling over the last len(output_size) dims: window i of a dim of size L is
    [floor(i*L/out), ceil((i+1)*L/out)), summed with a cumulative sum."""
    y = upcast(to_float(x))
    nd = len(output_size)
    for d, out in zip(range(x.ndim - nd, x.ndim), output_size):
        size = y.shape[d]
        starts = np.array([(i * size) // out for i in range(out)])
        ends = np.array([-(-((i + 1) * size) // out) for i in range(out)])
        c = jnp.cumsum(y, axis=d)
        c = jnp.concatenate([jnp.zeros_like(jax.lax.slice_in_dim(c, 0, 1, axis=d)), c], axis=d)
        sums = jnp.take(c, ends, axis=d) - jnp.take(c, starts, axis=d)
        shape = [1] * y.ndim
        shape[d] = out
        y = sums / (ends - starts).reshape(shape)
    return y


@lowers(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(x, output_size):
    return _adaptive_avg(x, list(output_size))


@lowers(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad, x):
    return _pullback(lambda v: _adaptive_avg(v, list(grad.shape[-2:])), grad, x)


@lowers(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad, x):
    return _pullback(lambda v: _adaptive_avg(v, list(grad.shape[-3:])), grad, x)


# -- FFT --------------------------------------------------------------------------------------------

def _fft_norm(normalization, forward):
    # aten's value says how the *transform itself* scales: 0 none, 1 by 1/sqrt(n), 2 by 1/n
    if normalization == 1:
        return "ortho"
    if normalization == 0:
        return "backward" if forward else "forward"
    return "forward" if forward else "backward"


def _real_where_self_conjugate(out, dims):
    """The transform of a real input with an imaginary part of exactly +0 at every bin that is its own
    conjugate (each index 0 or n/2: the DC and Nyquist bins of an rfft), as torch's CPU kernels give.
    A complex FFT leaves rounding noise there (-2.4e-7), and ``angle()`` of a negative such bin is then
    -pi instead of pi: an STFT/rfft feature off by 2*pi."""
    self_conjugate = jnp.ones((), bool)
    for d in dims:
        shape = [1] * out.ndim
        shape[d] = out.shape[d]
        k = np.arange(out.shape[d]).reshape(shape)
        self_conjugate = self_conjugate & ((k == 0) | (2 * k == out.shape[d]))
    return jnp.where(self_conjugate, out.real.astype(out.dtype), out)


@lowers(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    dims = tuple(dim)
    out = _real_where_self_conjugate(jnp.fft.fftn(upcast(x), axes=dims, norm=_fft_norm(normalization, True)), dims)
    if onesided:
        last = dims[-1]
        out = jax.lax.slice_in_dim(out, 0, x.shape[last] // 2 + 1, axis=last)
    return out


@lowers(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    fn = jnp.fft.fftn if forward else jnp.fft.ifftn
    return fn(x, axes=tuple(dim), norm=_fft_norm(normalization, forward))


@lowers(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    dims = tuple(dim)
    lengths = [x.shape[d] for d in dims[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=lengths, axes=dims, norm=_fft_norm(normalization, False))


# -- distances --------------------------------------------------------------------------------------

def _pnorm(diff, p):
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=-1)
    if p == math.inf:
        return jnp.max(a, axis=-1) if a.shape[-1] else jnp.zeros(a.shape[:-1], a.dtype)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a ** p, axis=-1) ** (1.0 / p)


@lowers(aten._cdist_forward.default)
def cdist_forward(x1, x2, p, compute_mode=None):
    diff = upcast(x1)[..., :, None, :] - upcast(x2)[..., None, :, :]
    return _pnorm(diff, p)


@lowers(aten._pdist_forward.default)
def pdist_forward(x, p=2):
    n = x.shape[0]
    rows, cols = np.triu_indices(n, k=1)
    return _pnorm(upcast(x)[rows] - upcast(x)[cols], p)


def _pnorm_backward(diff, grad, dist, p):
    """d||diff||_p / d diff times ``grad``, per pair, as torch's CPU kernels define it
    (aten/src/ATen/native/cpu/DistanceOpsKernel.cpp): 0 where the distance is 0. The vjp of the forward
    gives NaN there (x / 0 for p = 2), which every ``cdist(x, x)`` has on its diagonal."""
    grad, dist = grad[..., None], dist[..., None]
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return jnp.sign(diff) * grad
    if p == math.inf:
        return jnp.where(jnp.abs(diff) == dist, jnp.sign(diff) * grad, 0)
    if p == 2:
        return jnp.where(dist == 0, 0, grad * diff / dist)
    if p < 2:
        out = jnp.where(dist == 0, 0, jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * grad / dist ** (p - 1))
        return jnp.where((diff == 0) & (p < 1), 0, out)
    return jnp.where(dist == 0, 0, diff * jnp.abs(diff) ** (p - 2) * grad / dist ** (p - 1))


@lowers(aten._cdist_backward.default)
def cdist_backward(grad, x1, x2, p, cdist):
    diff = upcast(x1)[..., :, None, :] - upcast(x2)[..., None, :, :]
    return jnp.sum(_pnorm_backward(diff, upcast(grad), upcast(cdist), p), axis=-2)


@lowers(aten._pdist_backward.default)
def pdist_backward(grad, x, p, pdist):
    rows, cols = np.triu_indices(x.shape[0], k=1)
    x = upcast(x)
    pair = _pnorm_backward(x[rows] - x[cols], upcast(grad), upcast(pdist), p)
    return jnp.zeros_like(x).at[rows].add(pair).at[cols].add(-pair)


# -- padding backwards: the vjp of the forward, which runs through the table (its decomposition) ------

def _replication_pad_backward(forward):
    def lowering(grad, x, padding):
        from tpudist.ops.interpret import call

        xf = upcast(to_float(x))
        _, vjp = jax.vjp(lambda v: call(forward, v, padding), xf)
        return vjp(upcast(grad).astype(xf.dtype))[0]
    return lowering


for _n in (1, 2, 3):
    lowers(getattr(aten, f"replication_pad{_n}d_backward").default)(
        _replication_pad_backward(getattr(aten, f"replication_pad{_n}d").default))
