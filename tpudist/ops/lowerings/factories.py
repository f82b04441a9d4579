"""Tensor factories: full/empty/zeros/ones/arange/eye/..., their ``*_like`` and ``new_*`` forms, scalars.

Device, layout, pin_memory and memory_format arguments are ignored (the caller places arrays);
``dtype`` is honoured (``call`` casts to torch's inferred dtype when it is None). ``empty*`` returns
zeros: deterministic, and XLA has no uninitialised buffers anyway.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.bridge import numpy_view
from tpudist.bridge import to_jax_dtype
from tpudist.ops.lowerings._util import is_array, is_low_precision, rounding_to
from tpudist.ops.registry import lowers, shapes_from_lowering

aten = torch.ops.aten
prims = torch.ops.prims


def _dtype(dtype, fill=None, like=None):
    if dtype is not None:
        return to_jax_dtype(dtype)
    if like is not None:
        return like.dtype
    if fill is None or isinstance(fill, float):
        return to_jax_dtype(torch.get_default_dtype())
    if isinstance(fill, bool):
        return jnp.bool_
    if isinstance(fill, int):
        return jnp.int64
    if is_array(fill):
        return fill.dtype
    return jnp.complex64


@lowers(aten.full.default, prims.full.default)
def full(size, fill_value, *, dtype=None, **_placement):
    return jnp.full(tuple(size), fill_value, _dtype(dtype, fill_value))


@lowers(aten.full_like.default)
def full_like(x, fill_value, *, dtype=None, **_placement):
    return jnp.full(x.shape, fill_value, _dtype(dtype, like=x))


@lowers(aten.new_full.default)
def new_full(x, size, fill_value, *, dtype=None, **_placement):
    return jnp.full(tuple(size), fill_value, _dtype(dtype, like=x))


@lowers(aten.empty.memory_format, aten.zeros.default, aten._efficientzerotensor.default)
def zeros(size, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.empty_strided.default, prims.empty_strided.default)
def empty_strided(size, stride, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, *, dtype=None, **_placement):
    # the layout is an order of strides, which values in a jax.Array do not show (silu_backward's
    # decomposition makes its result this way)
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.ones.default)
def ones(size, *, dtype=None, **_placement):
    return jnp.ones(tuple(size), _dtype(dtype))


@lowers(aten.empty_like.default, aten.zeros_like.default, aten.zero.default)
def zeros_like(x, *, dtype=None, **_placement):
    return jnp.zeros(x.shape, _dtype(dtype, like=x))


@lowers(aten.ones_like.default)
def ones_like(x, *, dtype=None, **_placement):
    return jnp.ones(x.shape, _dtype(dtype, like=x))


@lowers(aten.new_empty.default, aten.new_zeros.default)
def new_zeros(x, size, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype, like=x))


@lowers(aten.new_empty_strided.default)
def new_empty_strided(x, size, stride, *, dtype=None, **_placement):
    return jnp.zeros(tuple(size), _dtype(dtype, like=x))


@lowers(aten.new_ones.default)
def new_ones(x, size, *, dtype=None, **_placement):
    return jnp.ones(tuple(size), _dtype(dtype, like=x))


@lowers(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, jnp.asarray(value).astype(x.dtype) if is_array(value) else value, x.dtype)


@lowers(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, **_placement):
    return jnp.asarray(s, _dtype(dtype if dtype is not None else torch.get_default_dtype()))


@lowers(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(*args, dtype=None, **_placement):
    """torch's CPU kernel, its checks included: the device reads arange's result shape off this lowering,
    because torch's meta kernel refuses what the CPU kernel takes (an integer result whose float step
    truncates to 0: ``torch.arange(0.0, 1.0, 0.1, dtype=torch.int32)`` is ten zeros on CPU)."""
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3] if len(args) == 2 else args
    if dtype is None:
        dtype = torch.int64 if all(isinstance(v, int) for v in (start, end, step)) else torch.get_default_dtype()
    if step == 0:
        raise RuntimeError("step must be nonzero")
    checked = (math.trunc(start), math.trunc(end), math.trunc(step)) if dtype == torch.int64 else (start, end, step)
    if checked[2] == 0:
        raise ValueError("step must be nonzero")  # torch's error for an int64 step that truncates to 0
    if not (math.isfinite(start) and math.isfinite(end)):
        raise RuntimeError(f"unsupported range: {start} -> {end}")
    if not ((checked[2] > 0 and checked[1] >= checked[0]) or (checked[2] < 0 and checked[1] <= checked[0])):
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")
    n = max(0, math.ceil((end - start) / step))
    if dtype.is_floating_point:
        # torch computes start + i * step in double, then casts
        return jnp.asarray((start + np.arange(n, dtype=np.float64) * step).astype(to_jax_dtype(dtype)))
    # integers (torch's CPU kernel, torch 2.13): start and step truncated to int64, the values start + i * step
    # wrapped to the dtype; the length from the float arguments, except for int64, whose length comes from
    # the truncated start, end and step (a step that truncates to 0 is then an error)
    first, stride = math.trunc(start), math.trunc(step)
    if dtype == torch.int64:
        last, sign = math.trunc(end), 1 if stride > 0 else -1
        span = last - first + stride - sign
        n = max(0, abs(span) // abs(stride) * (1 if (span >= 0) == (stride > 0) else -1))  # C's truncating division
    values = first + np.arange(n, dtype=np.int64) * stride
    return jnp.asarray(values.astype(np.dtype(to_jax_dtype(dtype))))


shapes_from_lowering(aten.arange.default, aten.arange.start, aten.arange.start_step)


@lowers(prims.iota.default)
def iota(length, *, start, step, dtype, device=None, requires_grad=False):
    return start + jnp.arange(length, dtype=to_jax_dtype(dtype)) * step


@lowers(aten.linspace.default)
def linspace(start, end, steps, *, dtype=None, **_placement):
    """torch's CPU kernel: start and end cast to the result's dtype, the step computed in that dtype (in
    float64 for integer results, then truncated), the first half counted up from start and the second half
    down from end, every operation rounded to the dtype (16-bit floats too). start and end may be traced:
    the device passes Python floats as program inputs. Measured against CPU (7 dtypes, 7 lengths up to 1001,
    7 ranges, strict and fused): equal, except complex64 within an ulp. On a TPU (``LINSPACE_ON_HOST``)
    real results are CPU torch's, computed on the host."""
    dtype = dtype or torch.get_default_dtype()
    if jax.default_backend() in LINSPACE_ON_HOST and not dtype.is_complex:
        return _linspace_on_host(start, end, steps, dtype)
    dtype = to_jax_dtype(dtype)
    if steps <= 1:
        return jnp.full((steps,), start).astype(dtype)
    i = np.arange(steps)
    upper = i >= steps // 2
    if jnp.issubdtype(dtype, jnp.integer):
        s, e = (jnp.trunc(jnp.real(jnp.asarray(x, jnp.float64))) for x in (start, end))
        step = (e - s) / jax.lax.optimization_barrier(jnp.asarray(steps - 1, jnp.float64))
        return jnp.trunc(jnp.where(upper, e - step * (steps - 1 - i), s + step * i)).astype(dtype)
    low = is_low_precision(dtype)
    compute = jnp.float32 if low else dtype
    r = rounding_to(dtype) if low else (lambda x: x)  # each operation on c10::Half / BFloat16 rounds
    s, e = (r(jnp.asarray(x).astype(compute)) for x in (start, end))
    # a barrier: XLA turns a division by a constant into a multiplication by its rounded reciprocal
    step = r(r(e - s) / jax.lax.optimization_barrier(r(jnp.asarray(steps - 1, compute))))
    if dtype == jnp.float32:
        # torch's float kernel is compiled with fused multiply-adds: start + step * i rounded once. In
        # float64 the product of two floats is exact, so one rounding to float32 is that FMA's
        s, e, step = (x.astype(jnp.float64) for x in (s, e, step))
        up = s + step * i.astype(np.float64)
        down = e - step * (steps - 1 - i).astype(np.float64)
    else:
        up = r(s + r(step * r(jnp.asarray(i, compute))))
        down = r(e - r(step * r(jnp.asarray(steps - 1 - i, compute))))
    return jnp.where(upper, down, up).astype(dtype)


# Platforms where linspace's real values are CPU torch's own, computed on the host: a TPU divides float32
# within an ulp, not correctly rounded, and holds float64 as pairs of float32 (the program above is not
# CPU's bit for bit there: 34 of 252 (dtype, length, range) cases differed on a TPU v5e, 2026-12-07).
LINSPACE_ON_HOST = ("tpu",)


def _linspace_on_host(start, end, steps, dtype: torch.dtype):
    """``torch.linspace`` on the CPU, as a constant. Its endpoints must be Python numbers: a traced float
    raises JAX's concretization error, and the device then builds the op with its floats as constants (as
    for ``logspace``), so each distinct (start, end, steps, dtype) is a kernel of its own."""
    start, end = (x if isinstance(x, (int, float)) else float(x) for x in (start, end))
    return jnp.asarray(numpy_view(torch.linspace(start, end, operator.index(steps), dtype=dtype))[0])


@lowers(aten.logspace.default)
def logspace(start, end, steps, base=10.0, *, dtype=None, **_placement):
    """torch's CPU kernel (``logspace_out``, torch 2.13), its checks included, computed on the host: the
    program holds the values as a constant. XLA's pow is not glibc's (a TPU's float32 pow is not correctly
    rounded, and its float64 is emulated), so a pow in the program is not torch's bit for bit.

    Real dtypes: start and end cast to the dtype (c10's checked conversion: truncated for integers, an
    error where they overflow it), their difference taken in that dtype (in ``int`` for narrower integers,
    in float and rounded for 16-bit floats), the step ``difference / (steps - 1)`` in float64, the exponent
    counted up from start for the first half and down from end for the second (each product rounded before
    its sum: torch's kernel has no fused multiply-add), then glibc's ``pow(base, exponent)`` (``math.pow``,
    what ``std::pow`` calls) cast to the dtype as C++ does (through float32 for 16-bit floats, as c10's
    Half/BFloat16 convert). One step is ``fill_(pow(base, start))``, with fill_'s checks. Measured bit for
    bit against CPU over 7 real dtypes, lengths up to 50, 2 bases and 3 ranges on the device, and on 1500
    draws of edge and ordinary arguments, NaN bits and errors included (tests/device/test_device_factories.py).

    The values need start, end and base as Python numbers: a traced float raises JAX's concretization
    error, and the device then builds the op with its floats as constants, so each distinct (start, end,
    steps, base, dtype) is a kernel of its own (a call with the same arguments reuses it). torch.compile's
    programs reach this lowering too (``tpudist.compile.decompositions`` keeps the op whole; Dynamo
    specializes its floats). Complex results take their exponents in their dtype, as torch does, and the
    powers in complex128 on the host, rounded to the dtype: within torch's rounding, not bit for bit.

    Example: ``torch.logspace(0, 2, 3, device="tpu")`` is a program returning the constant [1., 10., 100.].
    """
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    dtype = to_jax_dtype(dtype or torch.get_default_dtype())
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _complex_logspace(start, end, steps, base, dtype)
    # float() of a traced value raises the concretization error
    start, end = (x if isinstance(x, (int, float)) else float(x) for x in (start, end))
    with np.errstate(all="ignore"):  # C's infinities, NaNs and out-of-range casts are values, not warnings
        values = _logspace_on_host(start, end, operator.index(steps), float(base), np.dtype(dtype))
    return jnp.asarray(values)


def _complex_logspace(start, end, steps, base, dtype):
    """Start, end, step and exponents in the complex dtype as torch's kernel has them, the powers on the host
    in complex128 then rounded to the dtype: a program's complex pow is exp(y * log(x)) in the chip's
    transcendentals (about 12 ulp from CPU on a TPU v5e), the host's is within CPU's own rounding of it."""
    if steps == 0:
        return jnp.zeros((0,), dtype)
    real = np.finfo(dtype).dtype.type
    s, e = (np.asarray(complex(x)).astype(dtype) for x in (start, end))
    if steps == 1:
        exponent = s.reshape(1)
    else:
        step = (e - s) / real(steps - 1)
        i = np.arange(steps)
        exponent = np.where(i < steps // 2, s + step * i.astype(dtype), e - step * (steps - 1 - i).astype(dtype))
    with np.errstate(all="ignore"):
        return jnp.asarray(np.power(np.complex128(complex(base)), exponent.astype(np.complex128)).astype(dtype))


def _logspace_on_host(start, end, steps: int, base: float, dtype: np.dtype) -> np.ndarray:
    """torch's ``logspace_out`` for a real ``dtype``, in numpy and glibc's pow (see ``logspace``)."""
    if steps == 0:
        return np.zeros((0,), dtype)
    if steps == 1:
        value = _c_pow(base, float(start))
        if is_low_precision(dtype) or dtype == np.bool_:  # fill_ converts these without an overflow check
            return _static_cast(np.full((1,), value), dtype)
        return _checked(value, dtype).reshape(1)
    if dtype == np.bool_:  # torch fills one step of bool but computes no more (its kernel's dispatch)
        raise NotImplementedError("\"logspace_cpu\" not implemented for 'Bool'")
    s, e = _checked(start, dtype), _checked(end, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        # C's arithmetic: integers narrower than int subtract as int; int and int64_t wrap
        wide = np.int64 if dtype == np.int64 else np.int32
        difference = float(np.subtract(e.astype(wide), s.astype(wide)))
    elif is_low_precision(dtype):  # c10's Half and BFloat16 subtract in float and round the result
        difference = float(_static_cast(np.subtract(e.astype(np.float32), s.astype(np.float32)), dtype))
    else:
        difference = float(np.subtract(e, s))
    step = difference / (steps - 1)
    i = np.arange(steps, dtype=np.float64)
    # numpy rounds each product before its sum, as torch's kernel (no fused multiply-add) does
    exponent = np.where(i < steps // 2, float(s) + step * i, float(e) - step * (steps - 1 - i))
    return _static_cast(np.fromiter((_c_pow(base, y) for y in exponent.tolist()), np.float64, steps), dtype)


def _c_pow(x: float, y: float) -> float:
    """glibc's ``pow(x, y)``, which torch's ``std::pow`` calls: ``math.pow`` calls it too (numpy's power may
    not: it can take SIMD approximations), but raises where C returns an infinity or a NaN."""
    try:
        return math.pow(x, y)
    except OverflowError:
        return -math.inf if x < 0 and _is_odd(y) else math.inf
    except ValueError:
        if x == 0:  # zero to a negative power
            return math.copysign(math.inf, x) if _is_odd(y) else math.inf
        # a negative number to a non-integer power: glibc returns (x - x) / (x - x), the hardware's
        # default NaN (x86's has its sign bit set)
        return float(np.divide(np.float64(0.0), np.float64(0.0)))


def _is_odd(y: float) -> bool:
    return y.is_integer() and math.fmod(y, 2.0) != 0.0


def _checked(value, dtype: np.dtype) -> np.ndarray:
    """A Python int or float as c10's ``checked_convert`` makes it ``dtype`` (``Scalar::to``, ``fill_``),
    a 0-d array: torch's error where the value overflows the dtype."""
    if jnp.issubdtype(dtype, jnp.floating):
        # infinities and NaN convert; the bound as a Python float (a numpy bound would round the value to it)
        fits = not math.isfinite(value) or abs(value) <= float(jnp.finfo(dtype).max)
    else:
        info = np.iinfo(dtype)
        # c10 compares a float with the dtype's bounds as doubles (NaN fits nowhere), and lets a negative
        # int wrap into an unsigned dtype
        fits = (info.min <= value <= float(info.max) if isinstance(value, float)
                else info.min <= value <= info.max or (info.min == 0 and -info.max <= value < 0))
    if not fits:
        raise RuntimeError(f"value cannot be converted to type {_C_NAMES[dtype]} without overflow")
    return _static_cast(np.asarray(value, np.int64 if isinstance(value, int) else np.float64), dtype)


def _static_cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """int64 or float64 ``values`` as C++'s ``static_cast`` makes them ``dtype`` on x86-64: 16-bit floats
    through float (c10's Half and BFloat16 convert from float; its BFloat16 makes every NaN 0x7FC0),
    integers truncated, an out-of-range float as x86's conversion makes it (numpy's cast does the same)."""
    if is_low_precision(dtype):
        values = values.astype(np.float32)
        if dtype == jnp.bfloat16:
            values = np.where(np.isnan(values), np.float32(np.nan), values)
    return values.astype(dtype)


# c10's names of the dtypes, in its conversion errors
_C_NAMES = {np.dtype(name): c_name for name, c_name in (
    ("float64", "double"), ("float32", "float"), ("float16", "c10::Half"), (jnp.bfloat16, "c10::BFloat16"),
    ("int64", "int64_t"), ("int32", "int"), ("int16", "int16_t"), ("int8", "int8_t"), ("uint8", "uint8_t"))}


@lowers(aten.eye.default, aten.eye.m)
def eye(n, m=None, *, dtype=None, **_placement):
    return jnp.eye(n, n if m is None else m, dtype=_dtype(dtype))


@lowers(aten._local_scalar_dense.default)
def local_scalar_dense(x):
    if isinstance(x, jax.core.Tracer):
        # JAX's own error for a traced value used as a Python one: the device then rebuilds the op with
        # its float arguments as constants (torch's norm decomposition calls p.item() on a float p
        # that the device passed in as a program input: F.pairwise_distance, triplet_margin_loss)
        raise jax.errors.ConcretizationTypeError(
            x, "aten._local_scalar_dense (Tensor.item()) needs a concrete value and cannot run inside jax.jit; "
               "it is a sync point: the caller must run the program first")
    return np.asarray(x).item()
