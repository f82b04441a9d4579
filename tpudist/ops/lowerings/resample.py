"""Resampling (F.interpolate / nn.Upsample): the upsample_* ops and their backwards.

Every mode is separable: along each spatial dim the output is a fixed linear map of the input, a
(out, in) weight matrix that depends only on the sizes, the scale and align_corners. The matrices are
built with numpy at trace time (the sizes are static), so no op needs a concrete value inside jit
(torch's decompositions compute indices with ``.item()``), and a backward is the same contraction
with the matrix transposed. Index arithmetic follows ATen's UpSample.h in float32 (its ``opmath``
for float and bfloat16), so nearest modes pick the same pixels as the CPU kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.ops.registry import lowers

aten = torch.ops.aten
_F32 = np.float32


def _scale(in_size, out_size, align_corners, scale):
    """ATen's area_pixel_compute_scale: the input step per output step."""
    if align_corners:
        return _F32((in_size - 1) / (out_size - 1)) if out_size > 1 else _F32(0)
    return _F32(1.0 / scale) if scale is not None and scale > 0 else _F32(in_size) / _F32(out_size)


def _nearest(in_size, out_size, scale, exact):
    # nearest_idx / nearest_neighbor_exact_compute_source_index: floor in float32, clamped
    step = _F32(1.0 / scale) if scale is not None and scale > 0 else _F32(in_size) / _F32(out_size)
    dst = np.arange(out_size, dtype=_F32) + (_F32(0.5) if exact else _F32(0))
    src = np.minimum(np.floor(dst * step).astype(np.int64), in_size - 1)
    w = np.zeros((out_size, in_size))
    w[np.arange(out_size), src] = 1
    return w


def _source(in_size, out_size, align_corners, scale, cubic):
    # area_pixel_compute_source_index: linear modes clamp below at 0, cubic does not
    step = _scale(in_size, out_size, align_corners, scale)
    dst = np.arange(out_size, dtype=_F32)
    if align_corners:
        return step * dst
    src = step * (dst + _F32(0.5)) - _F32(0.5)
    return src if cubic else np.maximum(src, _F32(0))


def _linear(in_size, out_size, align_corners, scale):
    src = _source(in_size, out_size, align_corners, scale, cubic=False)
    lo = np.minimum(src.astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = np.clip(src - lo, 0, 1)
    w = np.zeros((out_size, in_size))
    rows = np.arange(out_size)
    np.add.at(w, (rows, lo), 1 - frac)
    np.add.at(w, (rows, hi), frac)
    return w


def _cubic_weights(t, a=-0.75):
    # get_cubic_upsample_coefficients: Keys' convolution at distances 1+t, t, 1-t, 2-t
    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _cubic(in_size, out_size, align_corners, scale):
    src = _source(in_size, out_size, align_corners, scale, cubic=True)
    base = np.floor(src).astype(np.int64)
    w = np.zeros((out_size, in_size))
    rows = np.arange(out_size)
    for k, coeff in enumerate(_cubic_weights(src - base)):
        np.add.at(w, (rows, np.clip(base - 1 + k, 0, in_size - 1)), coeff)
    return w


def _aa_filter(cubic):
    def linear(x):
        return np.maximum(0.0, 1.0 - np.abs(x))

    def bicubic(x, a=-0.5):
        x = np.abs(x)
        near = ((a + 2) * x - (a + 3)) * x * x + 1
        far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
        return np.where(x < 1, near, np.where(x < 2, far, 0.0))

    return bicubic if cubic else linear


def _antialiased(in_size, out_size, align_corners, scale, cubic):
    """_compute_indices_min_size_weights_aa: a filter widened by the downscale factor, normalised."""
    step = float(_scale(in_size, out_size, align_corners, scale))
    support = (2.0 if cubic else 1.0) * (step if step >= 1.0 else 1.0)
    invscale = 1.0 / step if step >= 1.0 else 1.0
    filt = _aa_filter(cubic)
    w = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = step * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        taps = filt((np.arange(lo, hi) - center + 0.5) * invscale)
        total = taps.sum()
        w[i, lo:hi] = taps / total if total != 0 else taps
    return w


def _matrices(kind, in_sizes, out_sizes, align_corners, scales):
    build = {
        "nearest": lambda i, o, s: _nearest(i, o, s, exact=False),
        "nearest_exact": lambda i, o, s: _nearest(i, o, s, exact=True),
        "linear": lambda i, o, s: _linear(i, o, align_corners, s),
        "cubic": lambda i, o, s: _cubic(i, o, align_corners, s),
        "linear_aa": lambda i, o, s: _antialiased(i, o, align_corners, s, cubic=False),
        "cubic_aa": lambda i, o, s: _antialiased(i, o, align_corners, s, cubic=True),
    }[kind]
    scales = list(scales) if scales is not None else [None] * len(in_sizes)
    return [build(i, o, s) for i, o, s in zip(in_sizes, out_sizes, scales)]


def _apply(x, matrices, transpose):
    """Contract each of the last len(matrices) dims of x with its matrix (in float32 at least)."""
    dtype = x.dtype
    y = x.astype(jnp.promote_types(dtype, jnp.float32))
    first = x.ndim - len(matrices)
    for k, w in enumerate(matrices):
        w = jnp.asarray(w.T if transpose else w, y.dtype)  # (in, out) for backward: contract over out
        # HIGHEST: torch interpolates in float32 whatever its float32 matmul precision (a matmul here only
        # by construction); at XLA's TPU default the values would be rounded to bf16 first
        y = jnp.moveaxis(jnp.tensordot(y, w, axes=[[first + k], [1]], precision=jax.lax.Precision.HIGHEST),
                         -1, first + k)
    return y.astype(dtype)


def _forward(kind, x, output_size, align_corners, scales):
    n = len(output_size)
    return _apply(x, _matrices(kind, x.shape[-n:], list(output_size), align_corners, scales), transpose=False)


def _backward(kind, grad, output_size, input_size, align_corners, scales):
    n = len(output_size)
    return _apply(grad, _matrices(kind, list(input_size)[-n:], list(output_size), align_corners, scales),
                  transpose=True)


def _vec_size(x, output_size, scale_factors):
    """The .vec overloads' output size: given, or floor(in * scale) (upsample::compute_output_size)."""
    if output_size is not None:
        return list(output_size)
    n = len(scale_factors)
    return [int(np.floor(float(s) * float(i))) for s, i in zip(scale_factors, x.shape[-n:])]


def _scales(*scales):
    return None if all(s is None for s in scales) else list(scales)


# -- nearest ---------------------------------------------------------------------------------------

@lowers(aten.upsample_nearest1d.default, aten.upsample_nearest2d.default, aten.upsample_nearest3d.default)
def upsample_nearest(x, output_size, *scales):
    return _forward("nearest", x, output_size, False, _scales(*scales))


@lowers(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec)
def upsample_nearest_vec(x, output_size, scale_factors):
    return _forward("nearest", x, _vec_size(x, output_size, scale_factors), False, scale_factors)


@lowers(aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
        aten.upsample_nearest3d_backward.default)
def upsample_nearest_backward(grad, output_size, input_size, *scales):
    return _backward("nearest", grad, output_size, input_size, False, _scales(*scales))


@lowers(aten._upsample_nearest_exact1d.default, aten._upsample_nearest_exact2d.default,
        aten._upsample_nearest_exact3d.default)
def upsample_nearest_exact(x, output_size, *scales):
    return _forward("nearest_exact", x, output_size, False, _scales(*scales))


@lowers(aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact3d.vec)
def upsample_nearest_exact_vec(x, output_size, scale_factors):
    return _forward("nearest_exact", x, _vec_size(x, output_size, scale_factors), False, scale_factors)


@lowers(aten._upsample_nearest_exact1d_backward.default, aten._upsample_nearest_exact2d_backward.default,
        aten._upsample_nearest_exact3d_backward.default)
def upsample_nearest_exact_backward(grad, output_size, input_size, *scales):
    return _backward("nearest_exact", grad, output_size, input_size, False, _scales(*scales))


# -- linear, bilinear, trilinear, bicubic (align_corners) -------------------------------------------

@lowers(aten.upsample_linear1d.default, aten.upsample_bilinear2d.default, aten.upsample_trilinear3d.default)
def upsample_linear(x, output_size, align_corners, *scales):
    return _forward("linear", x, output_size, align_corners, _scales(*scales))


@lowers(aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec)
def upsample_linear_vec(x, output_size, align_corners, scale_factors):
    return _forward("linear", x, _vec_size(x, output_size, scale_factors), align_corners, scale_factors)


@lowers(aten.upsample_linear1d_backward.default, aten.upsample_bilinear2d_backward.default,
        aten.upsample_trilinear3d_backward.default)
def upsample_linear_backward(grad, output_size, input_size, align_corners, *scales):
    return _backward("linear", grad, output_size, input_size, align_corners, _scales(*scales))


@lowers(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _forward("cubic", x, output_size, align_corners, _scales(scales_h, scales_w))


@lowers(aten.upsample_bicubic2d.vec)
def upsample_bicubic2d_vec(x, output_size, align_corners, scale_factors):
    return _forward("cubic", x, _vec_size(x, output_size, scale_factors), align_corners, scale_factors)


@lowers(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _backward("cubic", grad, output_size, input_size, align_corners, _scales(scales_h, scales_w))


# -- antialiased (antialias=True): a filter as wide as the downscale factor --------------------------

@lowers(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _forward("linear_aa", x, output_size, align_corners, _scales(scales_h, scales_w))


@lowers(aten._upsample_bilinear2d_aa.vec)
def upsample_bilinear2d_aa_vec(x, output_size, align_corners, scale_factors):
    return _forward("linear_aa", x, _vec_size(x, output_size, scale_factors), align_corners, scale_factors)


@lowers(aten._upsample_bilinear2d_aa_backward.default)
def upsample_bilinear2d_aa_backward(grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _backward("linear_aa", grad, output_size, input_size, align_corners, _scales(scales_h, scales_w))


@lowers(aten._upsample_bicubic2d_aa.default)
def upsample_bicubic2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _forward("cubic_aa", x, output_size, align_corners, _scales(scales_h, scales_w))


@lowers(aten._upsample_bicubic2d_aa.vec)
def upsample_bicubic2d_aa_vec(x, output_size, align_corners, scale_factors):
    return _forward("cubic_aa", x, _vec_size(x, output_size, scale_factors), align_corners, scale_factors)


@lowers(aten._upsample_bicubic2d_aa_backward.default)
def upsample_bicubic2d_aa_backward(grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _backward("cubic_aa", grad, output_size, input_size, align_corners, _scales(scales_h, scales_w))


# -- grid sampling (F.grid_sample): the forward is torch's decomposition -------------------------------
# Its backward is a vjp. For bilinear sampling that vjp runs through the lowering below, not through the
# decomposition: the decomposition clamps border/reflection coordinates with torch.clamp, whose JAX
# derivative at the clamp's bounds is 1/2 (max/min ties), while ATen's CPU kernel passes 0 there ("borders
# are considered out of bounds"). An identity affine grid with align_corners=True puts the image's
# corners exactly on those bounds (measured: grid gradient 33% of its largest entry off there).

def _unnormalize(coord, size, align_corners):
    """ATen's vectorized CPU unnormalize (GridSamplerKernel.cpp ComputeLocationBase)."""
    if align_corners:
        return (coord + 1) * _F32((size - 1) / 2)
    return (coord + 1) * _F32(size / 2) - _F32(0.5)


def _clip_coordinates(v, size):
    """clamp to [0, size - 1] with the gradient of ATen's vectorized CPU kernel (GridSamplerKernel.cpp
    clip_coordinates_get_grad): 1 strictly inside, 0 outside and on the bounds."""
    import jax

    inside = (v > 0) & (v < size - 1)
    return jnp.where(inside, v, jax.lax.stop_gradient(jnp.clip(v, 0, size - 1)))


def _reflect_coordinates(v, twice_low, twice_high):
    """ATen's reflect_coordinates_set_grad: the gradient is +-1 by the number of reflections."""
    if twice_low == twice_high:
        return jnp.zeros_like(v)
    low, span = _F32(twice_low / 2), _F32((twice_high - twice_low) / 2)
    d = v - low
    d = jnp.where(d < 0, -d, d)  # |d| with gradient +1 at 0, as ATen
    import jax

    extra = d - jax.lax.stop_gradient(d - jnp.fmod(d, span))
    even = jnp.floor(d / span).astype(jnp.int32) % 2 == 0
    return jnp.where(even, extra + low, span - extra + low)


def _source_index(coord, size, padding_mode, align_corners):
    v = _unnormalize(coord, size, align_corners)
    if padding_mode == 1:  # border
        return _clip_coordinates(v, size)
    if padding_mode == 2:  # reflection
        bounds = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        return _clip_coordinates(_reflect_coordinates(v, *bounds), size)
    return v


def _bilinear_grid_sample(x, grid, padding_mode, align_corners):
    """grid_sampler_2d's bilinear mode, (N, C, H, W) sampled at (N, oH, oW, 2) -> (N, C, oH, oW)."""
    n, _, h, w = x.shape
    ix = _source_index(grid[..., 0], w, padding_mode, align_corners)
    iy = _source_index(grid[..., 1], h, padding_mode, align_corners)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    batch = jnp.arange(n)[:, None, None]
    out = 0
    for tx, ty, weight in ((x0, y0, (x0 + 1 - ix) * (y0 + 1 - iy)), (x0 + 1, y0, (ix - x0) * (y0 + 1 - iy)),
                           (x0, y0 + 1, (x0 + 1 - ix) * (iy - y0)), (x0 + 1, y0 + 1, (ix - x0) * (iy - y0))):
        valid = (tx >= 0) & (tx < w) & (ty >= 0) & (ty < h)
        xi = jnp.clip(tx, 0, w - 1).astype(jnp.int32)
        yi = jnp.clip(ty, 0, h - 1).astype(jnp.int32)
        out = out + x[batch, :, yi, xi] * jnp.where(valid, weight, 0)[..., None]  # (N, oH, oW, C)
    return jnp.moveaxis(out, -1, 1)


@lowers(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad_output, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """Gradients of ``grid_sampler_2d`` w.r.t. the input and the grid, in float32: the vjp of the
    forward (bilinear: the lowering above; nearest and bicubic: torch's decomposition, whose clamps
    act on integer tap positions only). Nearest sampling gives the grid no gradient, as ATen."""
    import jax

    from tpudist.ops.interpret import call

    def forward(x, grid):
        if interpolation_mode == 0:
            return _bilinear_grid_sample(x, grid, padding_mode, align_corners)
        return call(aten.grid_sampler_2d.default, x, grid, interpolation_mode, padding_mode, align_corners)

    out, pullback = jax.vjp(forward, x.astype(jnp.float32), grid.astype(jnp.float32))
    grad_x, grad_grid = pullback(grad_output.astype(out.dtype))
    return grad_x.astype(x.dtype) if output_mask[0] else None, grad_grid.astype(grid.dtype)
