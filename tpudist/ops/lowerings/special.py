"""Special functions (torch.special, the gamma family, Bessel functions) and float/integer helpers
(gcd, lcm, nextafter, frexp) that JAX has equivalents for.

Integer inputs compute in float32 and bf16/f16 in float32, as torch's CPU kernels do (``call`` rounds
to torch's result dtype). Not lowered (no JAX equivalent): the Bessel functions ``bessel_j0/j1`` (JAX's
``bessel_jn`` is NaN at 0 and for small arguments), those of the second kind (``bessel_y0/y1``,
``modified_bessel_k0/k1`` and their scaled forms), ``airy_ai``, ``zeta`` and ``polygamma`` (JAX's Hurwitz
zeta is wrong for negative q: trigamma(-8.5) gives 6.79, torch 9.76), and the orthogonal
polynomial families (``chebyshev_polynomial_*``, ``hermite_polynomial_*``, ``laguerre_polynomial_l``,
``legendre_polynomial_p``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import torch

from tpudist.ops.lowerings import asserts
from tpudist.ops.lowerings._util import promote, to_float, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _real(x):
    return upcast(to_float(x))


def _unary(fn):
    def lowering(x):
        return fn(_real(x))
    lowering.__name__ = fn.__name__
    return lowering


_UNARY = {
    (aten.special_i0e.default,): jsp.i0e,
    (aten.special_i1.default, aten.special_modified_bessel_i1.default): jsp.i1,
    (aten.special_modified_bessel_i0.default,): jsp.i0,
    (aten.special_i1e.default,): jsp.i1e,
    (aten.special_ndtri.default,): jsp.ndtri,
    (aten.special_erfcx.default,): jsp.erfcx,
    (aten.special_log_ndtr.default,): jsp.log_ndtr,
}
for _ops, _fn in _UNARY.items():
    lowers(*_ops)(_unary(_fn))


@lowers(aten.special_spherical_bessel_j0.default)
def spherical_bessel_j0(x):
    # torch's kernel: a Taylor series below |x| = 0.5 (sin(x)/x loses digits there), 0 at infinity
    x = _real(x)
    x2 = x * x
    series = 1 + x2 * (-1 / 6 + x2 * (1 / 120 + x2 * (-1 / 5040 + x2 * (1 / 362880 + x2 * (
        -1 / 39916800 + x2 * (1 / 6227020800))))))
    safe = jnp.where(jnp.abs(x) < 0.5, 1, x)
    return jnp.where(jnp.isinf(x), 0, jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(safe) / safe))


def _binary_real(x, y):
    x, y = promote(x, y)
    return _real(x), _real(y)


@lowers(aten.igamma.default)
def igamma(a, x):
    return jsp.gammainc(*_binary_real(a, x))


@lowers(aten.igammac.default)
def igammac(a, x):
    return jsp.gammaincc(*_binary_real(a, x))


@lowers(aten.mvlgamma.default)
def mvlgamma(x, p):
    if p < 1:
        raise RuntimeError("p has to be greater than or equal to 1")
    asserts.check(jnp.all(x > 0.5 * (p - 1)), "All elements must be greater than (p-1)/2")
    x = _real(x)
    offsets = jnp.arange(-p * 0.5 + 0.5, 0.5, 0.5, dtype=x.dtype)
    return jnp.sum(jsp.gammaln(x[..., None] + offsets), axis=-1) + p * (p - 1) * math.log(math.pi) / 4


# -- integer and floating-point helpers ---------------------------------------------------------------


@lowers(aten.gcd.default)
def gcd(x, y):
    return jnp.gcd(*promote(x, y))


@lowers(aten.lcm.default)
def lcm(x, y):
    return jnp.lcm(*promote(x, y))


@lowers(aten.nextafter.default)
def nextafter(x, y):
    return jnp.nextafter(*promote(x, y))


@lowers(aten.frexp.Tensor)
def frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(jnp.int32)


@lowers(aten.conj_physical.default, aten._conj_physical.default)
def conj_physical(x):
    return jnp.conj(x)
