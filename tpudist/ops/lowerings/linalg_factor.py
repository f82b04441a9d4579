"""Matrix factorizations: LU, QR (and its Householder pieces), SVD, eigh, Cholesky; torch's error checks.

Each follows LAPACK's conventions as torch's CPU kernels return them: LU pivots are 1-based int32 row
swaps, ``info`` is the 1-based index of the first zero pivot (LU) or of the first leading minor that is
not positive-definite (Cholesky), 0 when the factorization succeeded. JAX's CPU backend calls the same
LAPACK routines, so factors match CPU torch there; on a TPU JAX uses its own algorithms (Householder QR,
QDWH SVD and eigh), whose singular and eigen vectors may differ from LAPACK's by a sign (a phase for
complex ones), as they may between CPU and CUDA torch. bf16/f16 are not linalg dtypes in torch.

Not lowered (JAX has no TPU algorithm): non-symmetric eig / eigvals, and LDL (``linalg_ldl_factor``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.lax import linalg as lax_linalg  # geqrf: not exported by jax.lax.linalg (JAX 0.10)

from tpudist.ops.host_checks import host_check
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def mH(x):
    """The conjugate transpose of the last two dims."""
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _empty(dtype):
    return jnp.zeros((0,), dtype)


# -- error checks -------------------------------------------------------------------------------------


def _raise_like_torch(info, api_name: str, is_matrix: bool) -> None:
    # torch's own check on the host gives its exact message and error type (torch.linalg.LinAlgError)
    torch._linalg_check_errors(torch.from_numpy(np.array(info, np.int32)), api_name, is_matrix=is_matrix)  # noqa: SLF001


def check_info(info, api_name: str, is_matrix: bool) -> None:
    """torch's ``_linalg_check_errors``: raise where ``info`` is nonzero, now (a concrete value) or when
    the program runs (a traced one: a host callback, as ``_assert_async`` does)."""
    if isinstance(info, jax.core.Tracer):
        host_check(functools.partial(_raise_like_torch, api_name=api_name, is_matrix=is_matrix), info)
    else:
        _raise_like_torch(info, api_name, is_matrix)


@lowers(aten._linalg_check_errors.default)
def linalg_check_errors(info, api_name, *, is_matrix):
    check_info(info, api_name, is_matrix)


# -- LU -----------------------------------------------------------------------------------------------


def _zero_pivot_info(lu):
    """LAPACK getrf's info: 1 + the index of the first exactly zero diagonal element of U, else 0."""
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    if diagonal.shape[-1] == 0:  # an empty matrix
        return jnp.zeros(diagonal.shape[:-1], jnp.int32)
    zero = diagonal == 0
    return jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)


def lu_factor(a):
    """(LU, 1-based int32 pivots, 0-based row permutation, info) of ``a`` (..., m, n), as getrf."""
    lu, pivots, permutation = jax.lax.linalg.lu(a)
    return lu, pivots.astype(jnp.int32) + 1, permutation, _zero_pivot_info(lu)


def _no_pivot(api_name: str, pivot: bool) -> None:
    if not pivot:
        raise RuntimeError(f"{api_name}: LU without pivoting is not implemented on the CPU")


@lowers(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    _no_pivot("linalg.lu_factor", pivot)
    lu, pivots, _, info = lu_factor(a)
    if check_errors:
        check_info(info, "torch.linalg.lu_factor_ex", a.ndim == 2)
    return lu, pivots, info


def _unpack(lu, permutation):
    """(P, L, U) with A = P @ L @ U from a packed LU and its row permutation (A[permutation] = L @ U)."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    p = jnp.swapaxes(jax.nn.one_hot(permutation, m, dtype=lu.dtype), -1, -2)
    return p, lower, upper


@lowers(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    _no_pivot("linalg.lu", pivot)
    lu, _, permutation = jax.lax.linalg.lu(a)
    return _unpack(lu, permutation)


def permutation_of(pivots, m: int):
    """The 0-based row permutation of 1-based LAPACK pivots (sequential row swaps)."""
    return jax.lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


@lowers(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m = lu.shape[-2]
    p, lower, upper = _unpack(lu, permutation_of(pivots, m))
    if not unpack_data:
        lower, upper = _empty(lu.dtype), _empty(lu.dtype)
    if not unpack_pivots:
        p = _empty(lu.dtype)
    return p, lower, upper


# -- QR and Householder reflectors -------------------------------------------------------------------


@lowers(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), "
                           "'r', or 'complete'")
    q, r = jax.lax.linalg.qr(a, full_matrices=mode == "complete")
    return (_empty(a.dtype) if mode == "r" else q), r


@lowers(aten.geqrf.default)
def geqrf(a):
    return tuple(lax_linalg.geqrf(a))


@lowers(aten.linalg_householder_product.default)
def linalg_householder_product(a, tau):
    return jax.lax.linalg.householder_product(a, tau)


@lowers(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    return jax.lax.linalg.ormqr(a, tau, c, left=left, transpose=transpose)


# -- SVD and the Hermitian eigendecomposition ---------------------------------------------------------


@lowers(aten._linalg_svd.default)
def linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    if driver is not None:
        raise RuntimeError("torch.linalg.svd: keyword argument `driver=` is only supported on CUDA inputs with "
                           "cuSOLVER backend.")
    if not compute_uv:
        return _empty(a.dtype), jax.lax.linalg.svd(a, full_matrices=False, compute_uv=False), _empty(a.dtype)
    u, s, vh = jax.lax.linalg.svd(a, full_matrices=full_matrices, compute_uv=True)
    return u, s, vh


def hermitian_from(a, uplo: str):
    """The Hermitian matrix torch's eigh reads from ``a``: its lower (``"L"``) or upper triangle, the
    imaginary part of the diagonal ignored; the other triangle is never read."""
    if uplo.upper() not in ("L", "U"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {uplo}")
    part = jnp.tril(a, -1) if uplo.upper() == "L" else jnp.triu(a, 1)
    diagonal = jnp.real(jnp.diagonal(a, axis1=-2, axis2=-1)).astype(a.dtype)
    return part + mH(part) + diagonal[..., None] * jnp.eye(a.shape[-1], dtype=a.dtype)


@lowers(aten._linalg_eigh.default)
def linalg_eigh(a, UPLO="L", compute_v=True):  # noqa: N803 (the schema's name)
    vectors, values = jax.lax.linalg.eigh(hermitian_from(a, UPLO), symmetrize_input=False)
    return values, (vectors if compute_v else _empty(a.dtype))


@lowers(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    # torch's formula (BatchLinearAlgebra.cpp): singular values at or below max(atol, rtol * the largest)
    # count as zero; rtol defaults to eps * max(m, n) unless a positive atol is given
    real = jnp.finfo(a.dtype).dtype
    atol_ = jnp.zeros((), real) if atol is None else atol
    if rtol is None:
        default = jnp.finfo(real).eps * max(a.shape[-2:])
        rtol = default if atol is None else jnp.where(atol > 0, 0, default)
    if not hermitian:
        u, s, vh = jax.lax.linalg.svd(a, full_matrices=False)
        tol = jnp.maximum(jnp.asarray(atol_)[..., None], jnp.asarray(rtol)[..., None] * s[..., :1])
        inverse = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
        return jnp.matmul(mH(vh) * inverse[..., None, :], mH(u))
    vectors, values = jax.lax.linalg.eigh(hermitian_from(a, "L"), symmetrize_input=False)
    magnitude = jnp.abs(values)
    largest = jnp.max(magnitude, -1, keepdims=True, initial=0)  # 0 for 0x0 matrices
    tol = jnp.maximum(jnp.asarray(atol_)[..., None], jnp.asarray(rtol)[..., None] * largest)
    inverse = jnp.where(magnitude > tol, 1 / values, 0).astype(a.dtype)
    return jnp.matmul(vectors * inverse[..., None, :], mH(vectors))


# -- Cholesky -----------------------------------------------------------------------------------------


def _cholesky_info(a):
    """LAPACK potrf's info for a failed factorization: 1 + the first k whose pivot a_kk - |L_k,:k|^2 is
    not positive (JAX returns NaNs for the whole matrix and no index). An unblocked Cholesky, n steps."""
    n = a.shape[-1]

    def step(k, carry):
        lower, info = carry
        row = jnp.where(jnp.arange(n) < k, lower[..., k, :], 0)
        pivot = jnp.real(a[..., k, k]) - jnp.sum(jnp.abs(row) ** 2, axis=-1)
        bad = ~(pivot > 0)
        info = jnp.where((info == 0) & bad, k + 1, info)
        root = jnp.sqrt(jnp.where(bad, 1, pivot))
        column = (a[..., :, k] - jnp.einsum("...ij,...j->...i", lower, jnp.conj(row))) / root[..., None]
        column = jnp.where(jnp.arange(n) > k, column, 0).at[..., k].set(root)
        return lower.at[..., :, k].set(column.astype(lower.dtype)), info

    start = (jnp.zeros_like(a), jnp.zeros(a.shape[:-2], jnp.int32))
    return jax.lax.fori_loop(0, n, step, start)[1]


def cholesky_with_info(a, upper: bool):
    """(factor, info) of the Hermitian matrix in ``a``'s lower (or upper) triangle, as potrf."""
    if a.shape[-1] == 0:  # 0x0 matrices: nothing to factor (JAX's cholesky indexes into them)
        return a, jnp.zeros(a.shape[:-2], jnp.int32)
    source = mH(a) if upper else a  # the upper triangle of a is the lower one of a^H
    lower = jax.lax.linalg.cholesky(hermitian_from(source, "L"), symmetrize_input=False)
    failed = jnp.any(~jnp.isfinite(lower), axis=(-2, -1))
    info = jax.lax.cond(jnp.any(failed), lambda: jnp.where(failed, _cholesky_info(source), 0),
                        lambda: jnp.zeros(a.shape[:-2], jnp.int32))
    return (mH(lower) if upper else lower), info


@lowers(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    factor, info = cholesky_with_info(a, upper)
    if check_errors:
        check_info(info, "linalg.cholesky_ex", a.ndim == 2)
    return factor, info


@lowers(aten.cholesky.default)
def cholesky(a, upper=False):
    factor, info = cholesky_with_info(a, upper)
    check_info(info, "cholesky", a.ndim == 2)
    return factor
