"""Pointwise aten ops: unary math, arithmetic, integer division, comparisons, logic, bitwise, where/clamp.

Binary ops first cast their array operands to torch's result type (``_util.promote``): computing in
jnp's promoted type and casting afterwards would differ for integer overflow and for int / float mixes.
Transcendental functions of bf16/f16 compute in float32 (as torch's CPU kernels do) and ``call`` rounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch

from tpudist.ops.lowerings._number_pow import number_pow
from tpudist.ops.lowerings._util import (is_array, is_float, is_integral, is_low_precision, is_number, is_one,
                                         promote, result_type, sigmoid, to_float, upcast)
from tpudist.ops.registry import lowers

aten = torch.ops.aten
prims = torch.ops.prims


# -- unary math on floats (integers are promoted to float32 first, as torch does) -------------------

_FLOAT_UNARY = {
    aten.exp.default: jnp.exp, aten.exp2.default: jnp.exp2, aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log, aten.log2.default: jnp.log2, aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p, aten.sqrt.default: jnp.sqrt, aten.rsqrt.default: jax.lax.rsqrt,
    aten.sin.default: jnp.sin, aten.cos.default: jnp.cos, aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin, aten.acos.default: jnp.arccos, aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh, aten.cosh.default: jnp.cosh, aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh, aten.acosh.default: jnp.arccosh, aten.atanh.default: jnp.arctanh,
    aten.erf.default: jsp.erf, aten.erfc.default: jsp.erfc, aten.erfinv.default: jsp.erfinv,
    aten.sigmoid.default: sigmoid, aten.reciprocal.default: jnp.reciprocal,
    aten.lgamma.default: jsp.gammaln,
    aten.i0.default: jnp.i0, aten.sinc.default: jnp.sinc, aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
    prims.exp.default: jnp.exp, prims.log.default: jnp.log, prims.sqrt.default: jnp.sqrt,
    prims.rsqrt.default: jax.lax.rsqrt, prims.sin.default: jnp.sin, prims.cos.default: jnp.cos,
    prims.tanh.default: jnp.tanh, prims.erf.default: jsp.erf, prims.log1p.default: jnp.log1p,
    prims.expm1.default: jnp.expm1, prims.reciprocal.default: jnp.reciprocal,
}


def _float_unary(fn):
    def lowering(x):
        return fn(upcast(to_float(x)))
    lowering.__name__ = fn.__name__
    return lowering


for _op, _fn in _FLOAT_UNARY.items():
    lowers(_op)(_float_unary(_fn))


@lowers(aten.digamma.default)
def digamma(x):
    x = upcast(to_float(x))
    return jnp.where(x == 0, -jnp.inf, jsp.digamma(x))  # torch: digamma(0) = -inf


@lowers(aten.logit.default)
def logit(x, eps=None):
    x = upcast(to_float(x))
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


# -- unary ops that keep integer dtypes -------------------------------------------------------------

@lowers(aten.abs.default, prims.abs.default)
def abs_(x):
    return x if x.dtype == jnp.bool_ else jnp.abs(x)


@lowers(aten.neg.default, prims.neg.default)
def neg(x):
    return -x


@lowers(aten.sign.default, aten.sgn.default, prims.sign.default)
def sign(x):
    return x if x.dtype == jnp.bool_ else jnp.sign(x)


@lowers(aten.ceil.default, prims.ceil.default)
def ceil(x):
    return jnp.ceil(x) if is_float(x) else x


@lowers(aten.floor.default, prims.floor.default)
def floor(x):
    return jnp.floor(x) if is_float(x) else x


@lowers(aten.trunc.default, prims.trunc.default)
def trunc(x):
    return jnp.trunc(x) if is_float(x) else x


@lowers(aten.round.default, prims.round.default)
def round_(x):
    return jnp.round(x) if is_float(x) else x  # half to even, as torch


@lowers(aten.round.decimals)
def round_decimals(x, *, decimals=0):
    scale = 10.0 ** decimals
    return jnp.round(upcast(x) * scale) / scale


@lowers(aten.frac.default)
def frac(x):
    return x - jnp.trunc(x)


@lowers(aten.isnan.default)
def isnan(x):
    return jnp.isnan(x) if is_float(x) else jnp.zeros(x.shape, jnp.bool_)


@lowers(aten.isinf.default)
def isinf(x):
    return jnp.isinf(x) if is_float(x) else jnp.zeros(x.shape, jnp.bool_)


@lowers(aten.isposinf.default)
def isposinf(x):
    return jnp.isposinf(x) if is_float(x) else jnp.zeros(x.shape, jnp.bool_)


@lowers(aten.isneginf.default)
def isneginf(x):
    return jnp.isneginf(x) if is_float(x) else jnp.zeros(x.shape, jnp.bool_)


@lowers(aten.signbit.default)
def signbit(x):
    return jnp.signbit(x) if is_float(x) else x < 0


@lowers(aten.logical_not.default)
def logical_not(x):
    return jnp.logical_not(x)


@lowers(aten.bitwise_not.default, prims.bitwise_not.default)
def bitwise_not(x):
    return jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.bitwise_not(x)


@lowers(aten.nan_to_num.default)
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if not is_float(x):
        return x
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# -- arithmetic ------------------------------------------------------------------------------------

# 16-bit floats: torch's CPU kernels compute some ops in float32 and round once, where the same
# formula in bf16/f16 rounds every step (a third to a half of the elements 1 ulp off, measured).
# What each kernel does was found by matching candidate float32 formulas bit for bit against
# torch 2.13 over 40,000 random bf16 and f16 values each (tests/ops/test_ops_lowerings.py checks it):
# add/sub with alpha: x +- alpha * y, alpha first rounded to the dtype; mul and div by a Python
# scalar: the scalar unrounded; addcmul and addcdiv: value unrounded, left to right.

def _wide(x):
    """An array operand as float32 where it is 16-bit; Python scalars stay (float32 when combined)."""
    return upcast(x) if is_array(x) else x


def _in_dtype(alpha, dtype):
    """``alpha`` rounded to ``dtype`` (kept as float32), as torch's add and sub do first."""
    if is_array(alpha):
        return alpha.astype(dtype).astype(jnp.float32)
    return np.float32(np.asarray(alpha, dtype))


@lowers(aten.add.Tensor, aten.add.Scalar, prims.add.default)
def add(x, y, *, alpha=1):
    x, y = promote(x, y)
    if not is_one(alpha):
        dtype = result_type(x, y)
        if is_low_precision(dtype):
            return (_wide(x) + _in_dtype(alpha, dtype) * _wide(y)).astype(dtype)
        y = y * alpha
    if is_array(x) and x.dtype == jnp.bool_:
        return jnp.logical_or(x, y)
    return x + y


@lowers(aten.sub.Tensor, aten.sub.Scalar, prims.sub.default)
def sub(x, y, *, alpha=1):
    x, y = promote(x, y)
    if is_one(alpha):
        return x - y
    dtype = result_type(x, y)
    if is_low_precision(dtype):
        return (_wide(x) - _in_dtype(alpha, dtype) * _wide(y)).astype(dtype)
    return x - y * alpha


@lowers(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(x, y, *, alpha=1):
    return sub(y, x, alpha=alpha)


def _low_by_number(x, y) -> bool:
    """``x`` a 16-bit float array and ``y`` a Python number: torch's kernel then computes in float32
    with the number unrounded (before promotion, which would round it to ``x``'s dtype)."""
    return is_array(x) and not is_number(x) and is_low_precision(x.dtype) and is_number(y)


@lowers(aten.mul.Tensor, aten.mul.Scalar, prims.mul.default)
def mul(x, y):
    if _low_by_number(y, x):
        x, y = y, x
    if _low_by_number(x, y):
        return (upcast(x) * y).astype(x.dtype)
    x, y = promote(x, y)
    if is_array(x) and x.dtype == jnp.bool_:
        return jnp.logical_and(x, y)
    return x * y


@lowers(aten.div.Tensor, aten.div.Scalar)
def div(x, y):
    if _low_by_number(x, y):
        return (upcast(x) / y).astype(x.dtype)
    x, y = promote(x, y)
    dtype = result_type(x, y)
    if not jnp.issubdtype(dtype, jnp.inexact):
        x, y = to_float(jnp.asarray(x)), (y.astype(jnp.float32) if is_array(y) else y)
    return x / y


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(x, y, *, rounding_mode=None):
    if rounding_mode is None:
        return div(x, y)
    x, y = promote(x, y)
    x = jnp.asarray(x)
    if rounding_mode == "trunc":
        if is_integral(x):
            return jax.lax.div(*jnp.broadcast_arrays(x, jnp.asarray(y, x.dtype)))  # C's: toward zero
        return jnp.trunc(x / y)
    if rounding_mode == "floor":
        return floor_divide(x, y)
    raise ValueError(f"rounding_mode={rounding_mode!r}: div takes None, 'trunc' or 'floor'")


@lowers(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(x, y):
    x, y = promote(x, y)
    if is_integral(jnp.asarray(x)):
        return jnp.floor_divide(x, y)
    # torch's div_floor_floating: x / y where y == 0 (inf/nan), else floor(x / y) computed via fmod
    return jnp.where(jnp.asarray(y) == 0, x / y, jnp.floor_divide(x, y))


@lowers(aten.remainder.Tensor, aten.remainder.Scalar)
def remainder(x, y):
    x, y = promote(x, y)
    return jnp.remainder(x, y)  # the divisor's sign, as Python and torch


@lowers(aten.remainder.Scalar_Tensor)
def remainder_scalar_tensor(x, y):
    return remainder(x, y)


@lowers(aten.fmod.Tensor, aten.fmod.Scalar, prims.fmod.default)
def fmod(x, y):
    x, y = promote(x, y)
    return jnp.fmod(x, y)  # the dividend's sign, as C


@lowers(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(x, exponent):
    if isinstance(exponent, bool):
        exponent = int(exponent)
    if isinstance(exponent, int) and not isinstance(exponent, bool):
        if is_integral(x) and exponent < 0:
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int64)
        return jax.lax.integer_pow(upcast(x), exponent) if 0 <= exponent <= 64 else jnp.power(upcast(x), exponent)
    x, exponent = promote(x, exponent)
    return jnp.power(upcast(x), exponent)


def _integer_power(base, exponent):
    """Integer ** integer as torch computes it: a negative exponent gives 0, except for base 1
    (1) and base -1 (+-1 by the exponent's parity); jnp.power leaves those to the hardware."""
    out = jnp.power(base, jnp.maximum(exponent, 0))
    one = jnp.ones_like(out)
    negative = jnp.where(base == 1, one, jnp.where(base == -1, jnp.where(exponent % 2 == 0, one, -one),
                                                  jnp.zeros_like(out)))
    return jnp.where(exponent < 0, negative, out)


def _power(base, exponent):
    if is_integral(base) and is_array(exponent) and is_integral(exponent):
        return _integer_power(base, exponent)
    return jnp.power(base, exponent)


@lowers(aten.pow.Tensor_Tensor, prims.pow.default)
def pow_tensor_tensor(x, y):
    x, y = promote(x, y)
    if is_array(x) and x.dtype == jnp.bool_:
        x, y = x.astype(jnp.int64), jnp.asarray(y).astype(jnp.int64)
    return _power(upcast(jnp.asarray(x)), upcast(jnp.asarray(y)) if is_array(y) else y)


@lowers(aten.pow.Scalar)
def pow_scalar(base, exponent):
    if not is_array(exponent):  # reached with a tensor base (e.g. a 0-d one) and a number exponent
        return pow_tensor_scalar(jnp.asarray(base), exponent)
    base, exponent = promote(base, exponent)
    if exponent.dtype == jnp.bool_:
        exponent = exponent.astype(jnp.int64)
    if isinstance(base, (int, float)) and not isinstance(base, bool) and exponent.dtype == jnp.float32:
        return number_pow(base, exponent)  # optimizers' bias corrections, 1 - beta ** step: see _number_pow
    return _power(jnp.asarray(base, exponent.dtype), upcast(exponent))


@lowers(aten.maximum.default, prims.maximum.default)
def maximum(x, y):
    x, y = promote(x, y)
    return jnp.logical_or(x, y) if x.dtype == jnp.bool_ else jnp.maximum(x, y)


@lowers(aten.minimum.default, prims.minimum.default)
def minimum(x, y):
    x, y = promote(x, y)
    return jnp.logical_and(x, y) if x.dtype == jnp.bool_ else jnp.minimum(x, y)


@lowers(aten.fmax.default)
def fmax(x, y):
    x, y = promote(x, y)
    return jnp.fmax(x, y)


@lowers(aten.fmin.default)
def fmin(x, y):
    x, y = promote(x, y)
    return jnp.fmin(x, y)


@lowers(aten.atan2.default, prims.atan2.default)
def atan2(x, y):
    x, y = promote(to_float(x), to_float(y))
    return jnp.arctan2(upcast(x), upcast(y))


@lowers(aten.hypot.default)
def hypot(x, y):
    x, y = promote(x, y)
    return jnp.hypot(upcast(x), upcast(y))


@lowers(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(x, y):
    x, y = promote(to_float(x), y if not is_array(y) else to_float(y))
    return jnp.copysign(x, y)


@lowers(aten.logaddexp.default)
def logaddexp(x, y):
    x, y = promote(x, y)
    return jnp.logaddexp(upcast(x), upcast(y))


@lowers(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other)
def xlogy(x, y):
    x, y = promote(x, y)
    x, y = to_float(jnp.asarray(x)), to_float(jnp.asarray(y))
    return jnp.where(jnp.isnan(y), jnp.nan, jsp.xlogy(upcast(x), upcast(y)))


@lowers(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(start, end, weight):
    start, end = promote(start, end)
    s, e = upcast(start), upcast(end)
    w = upcast(weight) if is_array(weight) else weight
    # torch's lerp_kernel: start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w)
    return jnp.where(jnp.abs(w) < 0.5, s + w * (e - s), e - (e - s) * (1 - w))


@lowers(aten.addcmul.default)
def addcmul(x, t1, t2, *, value=1):
    x, t1, t2 = promote(x, t1, t2)
    dtype = result_type(x, t1, t2)
    if is_low_precision(dtype):
        return (_wide(x) + _wide(value) * _wide(t1) * _wide(t2)).astype(dtype)
    return x + value * t1 * t2


@lowers(aten.addcdiv.default)
def addcdiv(x, t1, t2, *, value=1):
    x, t1, t2 = promote(x, t1, t2)
    dtype = result_type(x, t1, t2)
    if is_low_precision(dtype):
        return (_wide(x) + _wide(value) * _wide(t1) / _wide(t2)).astype(dtype)
    return x + value * t1 / t2  # left to right, as torch's kernel


# -- comparisons and logic -------------------------------------------------------------------------

def _compare(fn):
    def lowering(x, y):
        x, y = promote(x, y)
        return fn(x, y)
    lowering.__name__ = fn.__name__
    return lowering


for _ops, _fn in [((aten.eq.Tensor, aten.eq.Scalar, prims.eq.default), jnp.equal),
                  ((aten.ne.Tensor, aten.ne.Scalar, prims.ne.default), jnp.not_equal),
                  ((aten.lt.Tensor, aten.lt.Scalar, prims.lt.default), jnp.less),
                  ((aten.le.Tensor, aten.le.Scalar, prims.le.default), jnp.less_equal),
                  ((aten.gt.Tensor, aten.gt.Scalar, prims.gt.default), jnp.greater),
                  ((aten.ge.Tensor, aten.ge.Scalar, prims.ge.default), jnp.greater_equal)]:
    lowers(*_ops)(_compare(_fn))


def _truth(x):
    return x if not is_array(x) or x.dtype == jnp.bool_ else x != 0


@lowers(aten.logical_and.default)
def logical_and(x, y):
    return jnp.logical_and(_truth(x), _truth(y))


@lowers(aten.logical_or.default)
def logical_or(x, y):
    return jnp.logical_or(_truth(x), _truth(y))


@lowers(aten.logical_xor.default)
def logical_xor(x, y):
    return jnp.logical_xor(_truth(x), _truth(y))


def _bitwise(fn):
    def lowering(x, y):
        x, y = promote(x, y)
        return fn(x, y)
    lowering.__name__ = fn.__name__
    return lowering


for _ops, _fn in [((aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, prims.bitwise_and.default), jnp.bitwise_and),
                  ((aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, prims.bitwise_or.default), jnp.bitwise_or),
                  ((aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, prims.bitwise_xor.default), jnp.bitwise_xor),
                  ((aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
                    aten.__lshift__.Tensor, aten.__lshift__.Scalar), jnp.left_shift),
                  ((aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
                    aten.__rshift__.Tensor, aten.__rshift__.Scalar), jnp.right_shift)]:
    lowers(*_ops)(_bitwise(_fn))


@lowers(aten.where.self, prims.where.default)
def where(condition, x, y):
    x, y = promote(x, y)
    return jnp.where(condition, x, y)


@lowers(aten.clamp.default, aten.clamp.Tensor)
def clamp(x, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    x, lo, hi = promote(x, min, max)
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@lowers(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(x, min):
    return clamp(x, min, None)


@lowers(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(x, max):
    return clamp(x, None, max)


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


# -- complex ---------------------------------------------------------------------------------------

@lowers(aten._conj.default)
def conj(x):
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


@lowers(aten.view_as_real.default)
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@lowers(aten.view_as_complex.default)
def view_as_complex(x):
    return jax.lax.complex(x[..., 0], x[..., 1])


@lowers(aten.angle.default)
def angle(x):
    return jnp.angle(x) if jnp.iscomplexobj(x) else jnp.where(x < 0, jnp.pi, 0.0) * (x == x) + jnp.where(
        jnp.isnan(to_float(x)), jnp.nan, 0.0)
