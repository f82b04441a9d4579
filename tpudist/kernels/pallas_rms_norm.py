"""RMSNorm forward and backward as Pallas TPU kernels (pure JAX; interpret mode off TPU).

Semantics of ``tpudist/training/model.py``'s RMSNorm (and ``library.rms_norm_reference``)::

    n = x.astype(f32) * rsqrt(mean(x.astype(f32) ** 2, -1) + eps)
    y = n.astype(x.dtype) * weight                     # in result_type(x, weight)

Backward, with ``r = rsqrt(mean(xf ** 2) + eps)`` and ``g = (dy * weight)`` rounded as the forward
rounds ``n`` (to x's dtype, then float32)::

    dx = r * g - xf * r ** 3 * mean(g * xf)            # cast to x's dtype
    dweight = sum over rows of dy * n.astype(x.dtype)  # float32 partial sums per row block

Rows are tiled in blocks of about 1 MiB of float32 (a multiple of the dtype's sublanes, or all rows
when they fit one block); the last dim is whole. Each grid step is independent ("parallel"): the
weight gradient leaves one float32 partial row per block, summed outside the kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tpudist.kernels.tpu_blocks import block_spec, compiler_params, round_up, sublanes

# float32 bytes per row block: a grid step costs ~0.35 us, so blocks must be large, while the input,
# output and float32 temporaries, double-buffered, stay well inside the 16 MiB default scoped VMEM
BLOCK_BYTES = 1 << 20
KERNEL_DTYPES = ("bfloat16", "float32")  # Mosaic has no 64-bit floats; v5e computes f16 poorly


def row_block(rows: int, dim: int, dtype) -> tuple[int, int]:
    """(rows per block, rows after padding): all rows in one block if they fit, else a multiple of the
    dtype's sublanes that divides the rows, else rows padded to a multiple of the largest block."""
    sub = sublanes(dtype)
    target = max(sub, BLOCK_BYTES // (4 * dim) // sub * sub)
    if rows <= target:
        return rows, rows  # a block equal to the whole dim is legal at any size
    for block in range(target, target // 4 - 1, -sub):
        if rows % block == 0:
            return block, rows
    return target, round_up(rows, target)


def _as_rows(x, padded_rows: int):
    """x as (padded_rows, dim); pad rows are ones, so r stays finite even with eps=0 (the backward
    multiplies their zero gradient by n, which would be 0 * inf there)."""
    rows = x.reshape(-1, x.shape[-1])
    if padded_rows == rows.shape[0]:
        return rows
    return jnp.pad(rows, ((0, padded_rows - rows.shape[0]), (0, 0)), constant_values=1)


def _inverse_rms(xf, eps):
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm_forward(x, weight, *, eps: float = 1e-6):
    """RMSNorm of ``x`` (..., dim) times ``weight`` (dim,) as one Pallas kernel."""
    dim = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    out_dtype = jnp.result_type(x.dtype, weight.dtype)
    block, padded = row_block(rows, dim, x.dtype)

    def kernel(x_ref, w_ref, o_ref):
        xf = x_ref[...].astype(jnp.float32)
        normed = (xf * _inverse_rms(xf, eps)).astype(x.dtype)
        o_ref[...] = normed.astype(out_dtype) * w_ref[...].astype(out_dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, dim), out_dtype),
        grid=(padded // block,),
        in_specs=[block_spec((block, dim), lambda i: (i, 0)), block_spec((1, dim), lambda i: (0, 0))],
        out_specs=block_spec((block, dim), lambda i: (i, 0)),
        compiler_params=compiler_params("parallel"),
        name="tpudist_rms_norm",
    )(_as_rows(x, padded), weight.reshape(1, dim))
    return out[:rows].reshape(x.shape)


def rms_norm_backward(x, weight, grad, *, eps: float = 1e-6):
    """(dx, dweight) of :func:`rms_norm_forward` for the output gradient ``grad``, as one Pallas kernel."""
    dim = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    out_dtype = jnp.result_type(x.dtype, weight.dtype)
    block, padded = row_block(rows, dim, x.dtype)
    num_blocks = padded // block

    def kernel(x_ref, w_ref, g_ref, dx_ref, dw_ref):
        xf = x_ref[...].astype(jnp.float32)
        r = _inverse_rms(xf, eps)
        dy = g_ref[...].astype(out_dtype)
        normed = (xf * r).astype(x.dtype).astype(out_dtype)
        dw_ref[...] = jnp.sum((dy * normed).astype(jnp.float32), axis=0, keepdims=True)
        # the forward rounds n to x's dtype before the product: its gradient is rounded the same way
        g = (dy * w_ref[...].astype(out_dtype)).astype(x.dtype).astype(jnp.float32)
        dx = r * g - xf * (r * r * r) * jnp.mean(g * xf, axis=-1, keepdims=True)
        dx_ref[...] = dx.astype(dx_ref.dtype)

    row_spec = block_spec((block, dim), lambda i: (i, 0))
    dx, dw_parts = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((padded, dim), x.dtype),
                   jax.ShapeDtypeStruct((num_blocks, 1, dim), jnp.float32)),
        grid=(num_blocks,),
        in_specs=[row_spec, block_spec((1, dim), lambda i: (0, 0)), row_spec],
        out_specs=(row_spec, block_spec((None, 1, dim), lambda i: (i, 0, 0))),
        compiler_params=compiler_params("parallel"),
        name="tpudist_rms_norm_backward",
    )(_as_rows(x, padded), weight.reshape(1, dim), _pad_zeros(grad.reshape(-1, dim), padded))
    dweight = jnp.sum(dw_parts, axis=(0, 1)).astype(weight.dtype)
    return dx[:rows].reshape(x.shape), dweight


def _pad_zeros(rows_2d, padded_rows: int):
    """The output gradient as (padded_rows, dim): pad rows contribute nothing to the weight gradient."""
    if padded_rows == rows_2d.shape[0]:
        return rows_2d
    return jnp.pad(rows_2d, ((0, padded_rows - rows_2d.shape[0]), (0, 0)))


__all__ = ["BLOCK_BYTES", "KERNEL_DTYPES", "rms_norm_backward", "rms_norm_forward", "row_block"]
