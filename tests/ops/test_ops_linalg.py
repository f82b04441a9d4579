"""The linalg lowerings against CPU torch beyond the OpInfo samples: float64 and complex64, every mode
and flag (QR modes, UPLO, upper, left/adjoint solves, pivots), torch's error checks and info values,
(det/slogdet's dependence on the input's strides: tests/device/test_device_linalg.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from tpudist.ops.opcheck import Recorder, compare, recording, run_on_jax

RECORDER = Recorder()


@pytest.fixture(autouse=True)
def _record():
    with recording(RECORDER):
        yield


def _matrices(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 4, 4, generator=g, dtype=dtype)
    spd = a @ a.mH + 4 * torch.eye(4, dtype=dtype)
    return a, spd, torch.randn(2, 4, 3, generator=g, dtype=dtype), torch.randn(5, 3, generator=g, dtype=dtype)


def _signs(vectors):
    pivot = vectors.gather(-2, vectors.abs().argmax(-2, keepdim=True))
    return (pivot / pivot.abs()).conj()


CASES = {
    "qr_reduced": lambda a, s, b, r: torch.linalg.qr(r),
    "qr_complete": lambda a, s, b, r: torch.linalg.qr(r, mode="complete"),
    "qr_r": lambda a, s, b, r: torch.linalg.qr(r.mT, mode="r"),
    "svdvals": lambda a, s, b, r: torch.linalg.svdvals(r),
    "svd_canonical": lambda a, s, b, r: (lambda u, sv, vh: (u * _signs(u), sv, vh * _signs(u).mT.conj()))(
        *torch.linalg.svd(r, full_matrices=False)),
    "eigh_upper": lambda a, s, b, r: (lambda w, v: (w, v * _signs(v)))(*torch.linalg.eigh(a, UPLO="U")),
    "eigvalsh": lambda a, s, b, r: torch.linalg.eigvalsh(a),
    "cholesky_upper": lambda a, s, b, r: torch.linalg.cholesky(s, upper=True),
    "cholesky_old": lambda a, s, b, r: torch.cholesky(s),
    "solve": lambda a, s, b, r: torch.linalg.solve(a, b),
    "solve_vector": lambda a, s, b, r: torch.linalg.solve(a[0], b[0, :, 0]),
    "solve_right": lambda a, s, b, r: torch.linalg.solve(a, b.mT, left=False),
    "solve_ex": lambda a, s, b, r: torch.linalg.solve_ex(a, b),
    "inv_ex": lambda a, s, b, r: torch.linalg.inv_ex(a),
    "det": lambda a, s, b, r: torch.ops.aten._linalg_det(a),
    "slogdet": lambda a, s, b, r: torch.ops.aten._linalg_slogdet(a),
    "lu_factor_ex": lambda a, s, b, r: torch.linalg.lu_factor_ex(a),
    "lu_tall": lambda a, s, b, r: torch.linalg.lu(r),
    "lu_wide": lambda a, s, b, r: torch.linalg.lu(r.mT),
    "lu_unpack": lambda a, s, b, r: torch.lu_unpack(*torch.linalg.lu_factor(a)),
    "lu_unpack_pivots_only": lambda a, s, b, r: torch.lu_unpack(*torch.linalg.lu_factor(a), unpack_data=False),
    "lu_solve_adjoint": lambda a, s, b, r: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True),
    "lu_solve_right": lambda a, s, b, r: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b.mT, left=False),
    "solve_triangular": lambda a, s, b, r: torch.linalg.solve_triangular(a, b, upper=True),
    "solve_triangular_right_unit": lambda a, s, b, r: torch.linalg.solve_triangular(
        a, b.mT, upper=False, left=False, unitriangular=True),
    "triangular_solve_broadcast": lambda a, s, b, r: torch.triangular_solve(b, a[0], transpose=True),
    "cholesky_solve_upper": lambda a, s, b, r: torch.cholesky_solve(b, torch.linalg.cholesky(s, upper=True),
                                                                    upper=True),
    "cholesky_inverse": lambda a, s, b, r: torch.cholesky_inverse(torch.linalg.cholesky(s[0])),
    "pinv_atol": lambda a, s, b, r: torch.linalg.pinv(r, atol=0.5),
    "pinv_hermitian": lambda a, s, b, r: torch.linalg.pinv(s, hermitian=True),
    "geqrf_householder": lambda a, s, b, r: torch.linalg.householder_product(*torch.geqrf(r)),
    "ormqr_transpose": lambda a, s, b, r: torch.ormqr(*torch.geqrf(r), r[:, :2], transpose=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
def test_linalg_matches_cpu(dtype):
    """One traced program per dtype runs every case (compiles shared); each case compared on its own."""
    inputs = _matrices(dtype)
    names = [n for n in CASES if not (dtype.is_complex and n in ("geqrf_householder", "ormqr_transpose"))]

    def everything(*xs):
        return [CASES[n](*xs) for n in names]

    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype != torch.float64 else {}
    actual = run_on_jax(everything, *inputs)
    bad = {n: why for n, e, a in zip(names, everything(*inputs), actual) if (why := compare(e, a, **tol))}
    assert not bad, bad


def _singular():
    a = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(1))
    a[1, 2] = a[1, 0]  # the second matrix is singular
    return a


@pytest.mark.parametrize("fn, text", [
    (torch.linalg.inv, "linalg.inv: (Batch element 1): The diagonal element 3 is zero"),
    (lambda a: torch.linalg.solve(a, a), "torch.linalg.solve: (Batch element 1): The solver failed"),
    (torch.linalg.cholesky, "linalg.cholesky: (Batch element 0): The factorization could not be completed"),
    (torch.linalg.lu_factor, "torch.linalg.lu_factor: (Batch element 1): U[3,3] is zero"),
], ids=["inv", "solve", "cholesky", "lu_factor"])
@pytest.mark.parametrize("jit", [False, True], ids=["concrete", "traced"])
def test_errors_raise_torch_s_message(fn, text, jit):
    a = _singular()
    with pytest.raises(RuntimeError, match="matrix is singular|not positive-definite|is zero") as cpu:
        fn(a)
    assert text in str(cpu.value)
    # concrete: torch's own LinAlgError; traced: the program fails with it in its message (a host callback)
    with pytest.raises((RuntimeError, jax.errors.JaxRuntimeError)) as ours:
        run_on_jax(fn, a, jit=jit)
    assert text in str(ours.value)


def test_info_values_match_cpu():
    a = _singular()
    not_pd = torch.diag_embed(torch.tensor([[1.0, 2.0, -1.0], [1.0, -2.0, 3.0]]))

    def infos(a, d):
        return (torch.linalg.lu_factor_ex(a).info, torch.linalg.inv_ex(a).info,
                torch.linalg.cholesky_ex(d).info, torch.linalg.cholesky_ex(d, upper=True).info)

    assert compare(infos(a, not_pd), run_on_jax(infos, a, not_pd)) is None


def test_bad_arguments_raise_as_cpu():
    a = torch.randn(3, 3)
    for fn in (lambda x: torch.linalg.lu_factor(x, pivot=False), lambda x: torch.linalg.svd(x, driver="gesvd"),
               lambda x: torch.linalg.qr(x, mode="full"), lambda x: torch.linalg.eigh(x, UPLO="X")):
        with pytest.raises(RuntimeError) as cpu:
            fn(a)
        with pytest.raises(RuntimeError) as ours:
            run_on_jax(fn, a, jit=False)
        assert str(ours.value).splitlines()[0] == str(cpu.value).splitlines()[0]


# -- 64-bit integer products on a TPU ------------------------------------------------------------------
# XLA:TPU refuses a 64-bit integer dot ("While rewriting computation to not contain X64 element types ...
# not implemented"): there mm/bmm/matmul/dot/addmm of int64 run as products and sums (linalg.int64_matmul).

_INT64_SHAPES = [((5,), (5,)), ((3, 5), (5,)), ((5,), (5, 4)), ((3, 5), (5, 4)), ((2, 3, 5), (2, 5, 4)),
                 ((2, 1, 3, 5), (4, 5, 6)), ((7, 300), (300, 9))]


@pytest.mark.parametrize("block", [1 << 22, 7, 1], ids=["whole", "blocks", "one"])
def test_int64_matmul_without_a_dot_wraps_like_torch(block, monkeypatch):
    from tpudist.ops.lowerings import linalg

    monkeypatch.setattr(linalg, "_INT64_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    with jax.enable_x64(True):
        for xs, ys in _INT64_SHAPES:  # values near 2**62: the products and sums wrap around
            x = torch.randint(-2**62, 2**62, xs, generator=g, dtype=torch.int64)
            y = torch.randint(-2**62, 2**62, ys, generator=g, dtype=torch.int64)
            got = jax.jit(linalg.int64_matmul)(x.numpy(), y.numpy())
            assert torch.equal(torch.from_numpy(np.asarray(got)), torch.matmul(x, y)), (xs, ys)


def test_int64_products_lower_for_tpu_without_a_64_bit_dot():
    import jax.numpy as jnp

    from tpudist.ops.lowerings import linalg

    def lowered(fn, platform, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    with jax.enable_x64(True):
        bias, x, y = jnp.ones((3, 4), jnp.int64), jnp.ones((2, 3, 5), jnp.int64), jnp.ones((2, 5, 4), jnp.int64)
        for fn, args in ((linalg.matmul, (x, y)), (lambda b, x, y: linalg.addmm(b, x, y, beta=2, alpha=3), (bias, x, y)),
                         (linalg.matmul, (x[0, 0], y[0, :, 0]))):
            assert "dot_general" in lowered(fn, "cpu", *args)  # CPU keeps XLA's integer dot
            tpu = lowered(fn, "tpu", *args)
            assert "dot_general" not in tpu, tpu[:2000]
