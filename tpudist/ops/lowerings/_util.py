"""Helpers the lowerings share: torch's type promotion, dim canonicalisation, precise accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Categories of torch's type promotion (c10/core/ScalarType.h): a higher category wins.
_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3
_PY_SCALAR_DTYPE = {bool: np.dtype(np.bool_), int: np.dtype(np.int64), float: np.dtype(np.float32),
                    complex: np.dtype(np.complex64)}
LOW_PRECISION = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))


def is_number(x) -> bool:
    """A real Python number, or the weakly typed 0-d array the device passes one as
    (device/_core.py)."""
    if is_array(x):
        return (x.ndim == 0 and np.dtype(x.dtype).kind != "c"
                and bool(getattr(getattr(x, "aval", x), "weak_type", False)))
    return isinstance(x, (int, float))


def _category(dtype) -> int:
    if dtype == np.bool_:
        return _BOOL
    kind = np.dtype(dtype).kind
    if kind in "iu":
        return _INT
    if kind == "c":
        return _COMPLEX
    return _FLOAT


def _promote_pair(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return np.dtype(jnp.promote_types(a, b))


def _combine(higher, lower):
    """torch's combine_categories: a lower-priority operand only counts if its category is higher."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    hc, lc = _category(higher), _category(lower)
    if hc == _COMPLEX:
        return higher
    if lc == _COMPLEX:
        return np.dtype(jnp.complex128 if higher == np.float64 else jnp.complex64) if hc == _FLOAT else lower
    if hc == _FLOAT:
        return higher
    if hc == _BOOL or lc == _FLOAT:
        return _promote_pair(higher, lower)
    return higher


def result_type(*operands):
    """torch.result_type over arrays and Python scalars (None operands are ignored)."""
    dim = zero = wrapped = None
    for x in operands:
        if x is None:
            continue
        if is_array(x):
            if x.ndim:
                dim = _promote_pair(dim, np.dtype(x.dtype))
            else:
                zero = _promote_pair(zero, np.dtype(x.dtype))
        else:
            wrapped = _promote_pair(wrapped, _PY_SCALAR_DTYPE[type(x) if type(x) in _PY_SCALAR_DTYPE else
                                                             (float if isinstance(x, float) else int)])
    return _combine(dim, _combine(zero, wrapped))


def promote(*operands):
    """Cast array operands to torch's result type of all operands; Python scalars stay (weakly typed)."""
    dtype = result_type(*operands)
    return tuple(x.astype(dtype) if is_array(x) and x.dtype != dtype else x for x in operands)


def is_float(x) -> bool:
    return _category(x.dtype) >= _FLOAT


def is_integral(x, include_bool=True) -> bool:
    c = _category(x.dtype)
    return c == _INT or (include_bool and c == _BOOL)


def to_float(x):
    """Integer/bool arrays as torch's default float (float32), float arrays unchanged."""
    return x if is_float(x) else x.astype(jnp.float32)


def upcast(x):
    """bf16/f16 as float32 for accumulation (torch's CPU kernels accumulate low precision in fp32)."""
    return x.astype(jnp.float32) if is_low_precision(x.dtype) else x


def is_low_precision(dtype) -> bool:
    """bf16 or f16: the dtypes torch's CPU kernels compute in float32."""
    return np.dtype(dtype) in LOW_PRECISION


def rounding_to(dtype):
    """Rounds float32 values to ``dtype``'s precision and keeps them float32 (XLA cannot elide it): one
    operation of torch's CPU kernels on c10::BFloat16 / Half, computed in float and rounded."""
    info = jnp.finfo(dtype)
    return functools.partial(jax.lax.reduce_precision, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def dim_of(dim, ndim: int) -> int:
    """A non-negative dim; a 0-d tensor accepts dims -1 and 0 as torch does."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def dims_of(dims, ndim: int) -> tuple:
    """Canonical reduction dims: None or [] means all dims."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(ndim))
    return tuple(sorted({dim_of(d, ndim) for d in dims})) if ndim else ()


def is_one(x) -> bool:
    """True for the Python number 1 (a traced scalar is never taken for a constant)."""
    return not is_array(x) and x == 1


def is_zero(x) -> bool:
    """True for the Python number 0 (a traced scalar is never taken for a constant)."""
    return not is_array(x) and x == 0


def concrete(x, what: str, fix: str):
    """``x`` as a numpy array, for an op whose result's shape depends on the data.

    Inside ``jax.jit`` it raises JAX's own concretization error: the device (and opcheck) take it as
    "run this op on concrete values outside jit", so such ops work eagerly; a compiled graph still fails,
    with ``what`` and ``fix`` in the message.
    """
    if isinstance(x, jax.core.Tracer):
        raise jax.errors.ConcretizationTypeError(
            x, f"{what} has a data-dependent shape (its size depends on the data) and cannot run inside "
               f"jax.jit; {fix}")
    return np.asarray(x)


def sigmoid(x):
    """torch's sigmoid as ``1 / (1 + exp(-x))``: its ``exp`` takes float32 accuracy=HIGHEST (see
    tpudist.ops.accuracy); XLA's ``logistic`` on TPU was 82 ulp off with or without it (v5e)."""
    return jnp.reciprocal(1 + jnp.exp(-x))

