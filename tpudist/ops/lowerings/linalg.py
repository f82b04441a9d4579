"""Matrix products and convolutions.

bf16/f16 products accumulate in float32 (``preferred_element_type``), as torch's CPU kernels do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from tpudist.ops.lowerings._util import LOW_PRECISION, is_array, is_one, is_zero, promote, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _matmul(x, y):
    x, y = promote(x, y)
    if x.dtype in LOW_PRECISION:
        return jnp.matmul(x, y, preferred_element_type=jnp.float32)
    if x.dtype in (jnp.int64, jnp.uint64):  # XLA:TPU has no 64-bit integer dot (it refuses to compile one)
        return jax.lax.platform_dependent(x, y, tpu=int64_matmul, default=jnp.matmul)
    return jnp.matmul(x, y)


_INT64_BLOCK = 1 << 22  # elements of one block's products


def int64_matmul(x, y):
    """``jnp.matmul`` of 64-bit integers without a dot: products and sums, which XLA:TPU splits into
    32-bit halves as it does any 64-bit integer arithmetic (wrapping like torch's). The contraction
    runs in blocks of at most ``_INT64_BLOCK`` products (a loop when there are several)."""
    xv = x[None, :] if x.ndim == 1 else x
    yv = y[:, None] if y.ndim == 1 else y
    k = xv.shape[-1]
    if k != yv.shape[-2]:
        return jnp.matmul(x, y)  # jnp's own shape error
    batch = jnp.broadcast_shapes(xv.shape[:-2], yv.shape[:-2])
    m, n = xv.shape[-2], yv.shape[-1]
    xv = jnp.broadcast_to(xv, batch + xv.shape[-2:])
    yv = jnp.broadcast_to(yv, batch + yv.shape[-2:])
    block = max(1, min(k, _INT64_BLOCK // max(1, math.prod(batch) * m * n)))

    def products(xs, ys):
        return jnp.sum(xs[..., :, :, None] * ys[..., None, :, :], axis=-2)

    if block >= k:
        out = products(xv, yv)
    else:
        steps = -(-k // block)
        pad = steps * block - k  # zeros add nothing
        xv = jnp.pad(xv, [(0, 0)] * (xv.ndim - 1) + [(0, pad)])
        yv = jnp.pad(yv, [(0, 0)] * (yv.ndim - 2) + [(0, pad), (0, 0)])

        def step(i, acc):
            xs = jax.lax.dynamic_slice_in_dim(xv, i * block, block, axis=xv.ndim - 1)
            ys = jax.lax.dynamic_slice_in_dim(yv, i * block, block, axis=yv.ndim - 2)
            return acc + products(xs, ys)

        out = jax.lax.fori_loop(0, steps, step, jnp.zeros(batch + (m, n), x.dtype))
    drop = ((out.ndim - 2,) if x.ndim == 1 else ()) + ((out.ndim - 1,) if y.ndim == 1 else ())
    return jnp.squeeze(out, drop) if drop else out


@lowers(aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default, aten.vdot.default)
def matmul(x, y):
    return _matmul(x, y)


def _scaled_sum(bias, prod, beta, alpha):
    """``beta * bias + alpha * prod`` as torch's addmm family computes it: beta=0 ignores the bias (nan
    and inf included), also when beta comes traced (the device passes a float scalar as a value); an
    integer result takes beta and alpha converted to its dtype first (0.6 -> 0, as torch's kernels)."""
    if jnp.issubdtype(prod.dtype, jnp.integer):
        alpha, beta = (v.astype(prod.dtype) if is_array(v) else int(v) for v in (alpha, beta))
    if not is_one(alpha):
        prod = prod * alpha
    shape = jnp.broadcast_shapes(prod.shape, bias.shape)
    if is_zero(beta):
        return jnp.broadcast_to(prod, shape)
    total = (bias if is_one(beta) else bias * beta) + prod
    if is_array(beta):
        return jnp.where(beta == 0, jnp.broadcast_to(prod, shape).astype(total.dtype), total)
    return total


@lowers(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def addmm(bias, x, y, *, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(x, y), beta, alpha)


@lowers(aten.addbmm.default)
def addbmm(bias, x, y, *, beta=1, alpha=1):
    products = _matmul(x, y)
    if x.dtype in LOW_PRECISION:  # torch starts from beta * bias and adds one rounded product per batch
        total = jnp.broadcast_to(_scaled_sum(bias, jnp.zeros(products.shape[1:], x.dtype), beta, 1), products.shape[1:])
        for b in range(products.shape[0]):
            total = (total.astype(jnp.float32) + products[b] * alpha).astype(x.dtype)
        return total
    return _scaled_sum(bias, jnp.sum(products, axis=0), beta, alpha)


@lowers(aten.addr.default)
def addr(bias, x, y, *, beta=1, alpha=1):
    return _scaled_sum(bias, jnp.outer(*promote(x, y)), beta, alpha)


def _conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    stride, dilation = list(stride) * (nd // len(stride)), list(dilation) * (nd // len(dilation))
    padding = list(padding) * (nd // len(padding))
    spatial = "DHW"[-nd:] if nd <= 3 else None
    dn = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    x, weight = promote(x, weight)
    pref = jnp.float32 if x.dtype in LOW_PRECISION else None
    if not transposed:
        out = jax.lax.conv_general_dilated(x, weight, window_strides=stride,
                                           padding=[(p, p) for p in padding], rhs_dilation=dilation,
                                           dimension_numbers=dn, feature_group_count=groups,
                                           preferred_element_type=pref)
    else:
        output_padding = list(output_padding) * (nd // max(len(output_padding), 1)) if output_padding else [0] * nd
        # weight is (in, out/groups, k...): flip spatially, swap in/out per group
        cin = weight.shape[0]
        w = weight.reshape(groups, cin // groups, *weight.shape[1:])
        w = jnp.swapaxes(w, 1, 2).reshape(groups * weight.shape[1], cin // groups, *weight.shape[2:])
        w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
        k = weight.shape[2:]
        pads = [(dilation[i] * (k[i] - 1) - padding[i], dilation[i] * (k[i] - 1) - padding[i] + output_padding[i])
                for i in range(nd)]
        out = jax.lax.conv_general_dilated(x, w, window_strides=[1] * nd, padding=pads, lhs_dilation=stride,
                                           rhs_dilation=dilation, dimension_numbers=dn,
                                           feature_group_count=groups, preferred_element_type=pref)
    if bias is not None:
        out = out + bias.reshape(1, -1, *([1] * nd))
    return out


@lowers(aten.convolution.default)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if x.ndim == weight.ndim - 1:  # unbatched input
        return _conv(x[None], weight, bias, stride, padding, dilation, transposed, output_padding, groups)[0]
    return _conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@lowers(aten.convolution_backward.default)
def convolution_backward(grad_output, x, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def forward(x, weight):
        return _conv(x, weight, None, stride, padding, dilation, transposed, output_padding, groups)

    out, vjp = jax.vjp(forward, x, weight)
    # bf16/fp16 convolutions accumulate in float32 (_conv's preferred_element_type): the cotangent takes
    # the forward's result dtype, the gradients come back in the inputs' dtypes
    grad_x, grad_w = vjp(grad_output.astype(out.dtype))
    nd = x.ndim - 2
    grad_b = jnp.sum(grad_output, axis=(0, *range(2, 2 + nd))) if output_mask[2] else None
    return (grad_x if output_mask[0] else None, grad_w if output_mask[1] else None, grad_b)


@lowers(aten.matmul_backward.default)
def matmul_backward(grad, x, y, mask):
    # jnp.matmul broadcasts exactly like torch.matmul, so its VJP is matmul's backward (1-D cases too)
    _, vjp = jax.vjp(jnp.matmul, x, y)
    gx, gy = vjp(grad.astype(jnp.result_type(x, y)))
    return gx, gy


@lowers(aten.linalg_matrix_exp.default)
def matrix_exp(x):
    # batched (..., n, n), real and complex; bf16/f16 in float32 (JAX's expm takes neither). Its backward is
    # torch's composite: a matrix_exp of a (2n, 2n) block matrix
    return jax.scipy.linalg.expm(upcast(x)).astype(x.dtype)
