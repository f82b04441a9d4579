"""Solves, inverses and determinants through LU and Cholesky factors, and triangular solves.

torch's CPU kernels of ``det`` and ``slogdet`` factor A^T instead of A when A is a contiguous real
matrix (LAPACK wants column-major input; det(A^T) = det(A)), and return that LU and its pivots; their
backward formulas read A's strides again to know which one they got. The lowerings do the same, told
A's contiguity by the caller (``registry.contiguous_input``). ``solve`` factors A itself (torch 2.13).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.ops.lowerings.linalg_factor import check_info, lu_factor, mH, permutation_of
from tpudist.ops.registry import contiguous_input, lowers

aten = torch.ops.aten


def _batch_broadcast(a, b):
    """``a`` (..., m, m) and ``b`` (..., m, k) with their batch dims broadcast together."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, (*batch, *a.shape[-2:])), jnp.broadcast_to(b, (*batch, *b.shape[-2:]))


def _triangular(a, b, *, lower: bool, left: bool = True, adjoint: bool = False, unit: bool = False):
    a, b = _batch_broadcast(a, b)
    return jax.lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=adjoint,
                                           conjugate_a=adjoint, unit_diagonal=unit)


def _rows(x, index):
    index = jnp.broadcast_to(index[..., :, None], (*jnp.broadcast_shapes(index.shape[:-1], x.shape[:-2]),
                                                   index.shape[-1], x.shape[-1]))
    return jnp.take_along_axis(jnp.broadcast_to(x, (*index.shape[:-2], *x.shape[-2:])), index, axis=-2)


def lu_solve(lu, permutation, b, *, left: bool = True, adjoint: bool = False):
    """X with op(A) X = B (``left``) or X op(A) = B, where A[permutation] = L U and op is the conjugate
    transpose when ``adjoint``."""
    if not left:  # X op(A) = B  <=>  op(A)^H X^H = B^H
        return mH(lu_solve(lu, permutation, mH(b), adjoint=not adjoint))
    if not adjoint:  # L U X = B[permutation]
        y = _triangular(lu, _rows(b, permutation), lower=True, unit=True)
        return _triangular(lu, y, lower=False)
    y = _triangular(lu, b, lower=False, adjoint=True)  # U^H L^H (P^T X) = B
    y = _triangular(lu, y, lower=True, adjoint=True, unit=True)
    return _rows(y, jnp.argsort(permutation, axis=-1))


def _transposed(a, contiguous: bool) -> bool:
    """torch's choice: factor A^T (a contiguous real A) rather than A."""
    return contiguous and not jnp.iscomplexobj(a)


@lowers(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    return lu_solve(lu, permutation_of(pivots, lu.shape[-1]), b, left=left, adjoint=adjoint)


@lowers(aten._linalg_solve_ex.default)
def linalg_solve_ex(a, b, *, left=True, check_errors=False):
    lu, pivots, permutation, info = lu_factor(a)
    if check_errors:
        check_info(info, "torch.linalg.solve_ex", a.ndim == 2)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])  # numpy's vector right side
    x = lu_solve(lu, permutation, b[..., None] if vector else b, left=left)
    return (x[..., 0] if vector else x), lu, pivots, info


@lowers(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    lu, _, permutation, info = lu_factor(a)
    if check_errors:
        check_info(info, "linalg.inv_ex", a.ndim == 2)
    return lu_solve(lu, permutation, jnp.eye(a.shape[-1], dtype=a.dtype)), info


def _permutation_sign(pivots):
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), axis=-1)
    return jnp.where(swaps % 2 == 0, 1, -1)


@lowers(aten._linalg_det.default)
def linalg_det(a, *, input_contiguous=True):
    lu, pivots, _, _ = lu_factor(mH(a) if _transposed(a, input_contiguous) else a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _permutation_sign(pivots).astype(a.dtype) * jnp.prod(diagonal, axis=-1), lu, pivots


@lowers(aten._linalg_slogdet.default)
def linalg_slogdet(a, *, input_contiguous=True):
    lu, pivots, _, _ = lu_factor(mH(a) if _transposed(a, input_contiguous) else a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    magnitude = jnp.abs(diagonal)
    unit = jnp.where(magnitude == 0, 0, diagonal / jnp.where(magnitude == 0, 1, magnitude))  # torch's sgn
    sign = _permutation_sign(pivots).astype(a.dtype) * jnp.prod(unit, axis=-1)
    return sign, jnp.sum(jnp.log(magnitude), axis=-1), lu, pivots


contiguous_input(aten._linalg_det.default, aten._linalg_slogdet.default)


# -- triangular and Cholesky solves --------------------------------------------------------------------


@lowers(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    return _triangular(a, b, lower=not upper, left=left, unit=unitriangular)


@lowers(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    a, b = _batch_broadcast(a, b)
    x = jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                                        unit_diagonal=unitriangular)
    return x, a


def cholesky_solve(b, factor, upper: bool):
    """X with A X = B, A = L L^H (``factor`` = L) or U^H U (``upper``: ``factor`` = U)."""
    if upper:
        return _triangular(factor, _triangular(factor, b, lower=False, adjoint=True), lower=False)
    return _triangular(factor, _triangular(factor, b, lower=True), lower=True, adjoint=True)


@lowers(aten.cholesky_solve.default)
def cholesky_solve_op(b, factor, upper=False):
    return cholesky_solve(b, factor, upper)


@lowers(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper=False):
    return cholesky_solve(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor, upper)
