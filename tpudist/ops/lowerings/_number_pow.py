"""float32 ``number ** tensor`` near 1 as a correctly rounded power gives it, on every backend.

Near 1 a power's error is amplified by what usually follows it: AdamW's bias correction
``1 - 0.999 ** step`` turns one ulp of the power into 6e-5 relative. On a TPU v5e a compiled AdamW
step (``aten.pow.Scalar(0.999, step)`` in its graph) left parameters 4.2e-6 from torch's eager step
where the CPU leaves 2.4e-7; on the CPU, one ulp added to the powers gave 1.6e-6, three 4.3e-6, while
sqrt, div and reciprocal 16 ulp off changed nothing. XLA's TPU compiler expands a float32 ``pow`` into
its own ``exp(y * log(base))``, which no ``accuracy`` argument reaches (scripts/probes/pow_accuracy.py
measures it on the chip). Where ``|y * log(base)| <= 1/8`` (a result in [0.88, 1.14]),
:func:`number_pow` computes in float32 multiplies, adds and bit masks only:

- ``y * log(base) = t + lo`` to about 2**-44: ``log(base)`` in float64 on the host, split in two
  float32s, ``y`` times the first exactly (Dekker's product: no fused multiply-add needed);
- ``exp(t + lo) = 1 + t + t**2 / 2 + rest``, ``t**2`` exactly, ``rest`` with the Taylor series to
  ``t**7`` (truncation below 2**-39); the bits of ``t`` and ``t**2 / 2`` from 2**-23 up add to 1
  exactly, so that the last addition is the one rounding.

On the CPU, against float64 (2 million exponents, ten bases): at most 0.501 ulp, 10-36 in 200000 not
correctly rounded (XLA's ``pow``: 0.502 ulp, 117-151); 0.07% of results changed, 85-95% of those
closer. Elsewhere the result is ``jnp.power``'s, as before. No torch here: the probe loads this file.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

NEAR = 0.125  # |y * log(base)| up to which the power is computed here
# (exp(t) - 1 - t - t**2 / 2) / t**3 = 1/6 + t/24 + ...: its Taylor coefficients, highest degree first
_TAYLOR = tuple(np.float32(1 / math.factorial(k)) for k in range(7, 2, -1))


def _clear_low_bits(x, n):
    """``x`` with the ``n`` (0..32, traced or not) lowest bits of its float32 encoding cleared: a truncation of
    ``x`` to fewer significant bits. Bit masks, not sums such as ``(x + c) - c``: XLA's algebraic
    simplifier folds those (``(1 + x) - 1`` became ``x`` on the CPU), which would undo the exact sums."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    mask = jnp.where(n >= 32, jnp.uint32(0), ~((jnp.uint32(1) << jnp.minimum(n, 31).astype(jnp.uint32)) - 1))
    return jax.lax.bitcast_convert_type(bits & mask, jnp.float32)


def _from_ulp_of_one(x):
    """``x`` (|x| < 1) truncated to a multiple of 2**-23, 1's ulp: its float32 encoding's low
    ``127 - exponent`` bits cleared, all but the sign below 2**-23."""
    low_bits = 127 - ((jax.lax.bitcast_convert_type(x, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32)
    return _clear_low_bits(x, jnp.where(low_bits >= 24, 31, jnp.maximum(low_bits, 0)))


def _two_product(a, b):
    """``a * b`` as ``p + e`` exactly (Dekker): products of 12-bit halves are exact in float32."""
    p = a * b
    ah, bh = _clear_low_bits(a, 12), _clear_low_bits(b, 12)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def number_pow(base: float, y: jax.Array) -> jax.Array:
    """float32 ``base ** y`` for a number ``base`` (rounded to float32 first, as torch does) and a float32
    array ``y``: see the module doc."""
    base = float(np.float32(base))
    plain = jnp.power(np.float32(base), y)
    if not (base > 0 and math.isfinite(base)):
        return plain
    log = math.log(base)
    log_hi = np.float32(log)
    log_lo = np.float32(log - float(log_hi))
    t, e = _two_product(y, jnp.float32(log_hi))  # y * log(base) = t + lo, to about 2**-44 relative
    lo = e + y * log_lo
    # exp(t + lo) - 1 - t = lo + t**2 / 2 + t**3 * P(t) + t * lo, to first order in lo; t**2 exactly
    square, square_lo = _two_product(t, t)
    taylor = _TAYLOR[0]
    for c in _TAYLOR[1:]:
        taylor = taylor * t + c
    half_square = 0.5 * square
    rest = (lo + 0.5 * square_lo) + t * (square * taylor + lo)
    # 1 + t + t**2 / 2 + rest with one rounding: their bits from 2**-23 up add to 1 exactly (the sum, in
    # [0.88, 1.14], is a float32 then), and what is left, each below 2**-23, adds last
    head, half_square_head = _from_ulp_of_one(t), _from_ulp_of_one(half_square)
    tail = (t - head) + (half_square - half_square_head) + rest
    return jnp.where(jnp.abs(t) <= NEAR, ((1 + head) + half_square_head) + tail, plain)
