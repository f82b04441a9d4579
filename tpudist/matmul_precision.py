"""torch's float32 matmul precision, as the precision of the XLA programs tpudist traces.

On TPU a float32 ``dot_general`` or convolution with no precision of its own runs one bf16 pass
(XLA's DEFAULT), whatever torch says. tpudist reads ``torch.get_float32_matmul_precision()`` when an
op runs and traces the op's program under ``jax.default_matmul_precision`` of it (the numbers: a
float32 4096^3 matmul on one TPU v5e, jax 0.10.2, time, speed and relative error from float64):

- ``"highest"`` (torch's default) -> ``HIGHEST`` (six bf16 passes): 4.52 ms, 30 TFLOP/s, 6.0e-7
- ``"high"`` -> ``HIGH`` (bf16x3): 2.25 ms, 61 TFLOP/s, 1.3e-5
- ``"medium"`` -> ``DEFAULT`` (one bf16 pass): 0.78 ms, 176 TFLOP/s, 2.45e-3

(bf16 operands run at the same speed under every setting: 184 TFLOP/s for a bf16 8192^3 matmul,
with or without a float32 result.) Lowerings that pass a precision themselves (``reductions.py``'s
exact products, interpolation) keep it. The precision is part of every program key, in memory and on
disk, so switching it switches programs. Example::

    torch.set_float32_matmul_precision("high")   # the next op on the device, the next call of a
    y = x @ w                                    # compiled graph or of a kernel runs bf16x3
"""

from __future__ import annotations

import jax
import torch
from jax._src import config as _jax_config

from tpudist._jaxprs import any_equation

# torch's name -> jax.default_matmul_precision's (the names of jax.lax.Precision)
JAX_NAMES = {"highest": "highest", "high": "high", "medium": "default"}

# jax.default_matmul_precision's state (jax 0.10), part of jax.jit's cache key (include_in_jit_key):
# the per-op paths set it with swap_local/set_local, ~0.25 us where a context manager costs ~2 us
STATE = _jax_config.default_matmul_precision
_read = torch._C._get_float32_matmul_precision  # noqa: SLF001 - torch.get_float32_matmul_precision's body


def current() -> str:
    """torch's float32 matmul precision now: ``"highest"``, ``"high"`` or ``"medium"`` (~0.15 us)."""
    try:
        return _read()
    except RuntimeError as e:  # torch 2.13 refuses to answer when its per-backend fp32_precision settings differ
        raise RuntimeError(f"tpudist runs float32 matmuls at torch.get_float32_matmul_precision(), which torch "
                           f"refused: {e}; on the tpu device set it with torch.set_float32_matmul_precision("
                           "'highest' | 'high' | 'medium') instead of torch.backends.*.fp32_precision") from e


def jax_name(precision: str) -> str:
    """The ``jax.default_matmul_precision`` value of torch's ``precision``."""
    name = JAX_NAMES.get(precision)
    if name is None:
        raise ValueError(f"torch float32 matmul precision={precision!r} has no XLA equivalent in tpudist: it maps "
                         f"{JAX_NAMES}; set torch.set_float32_matmul_precision to one of those")
    return name


def scope(precision: str):
    """A context manager: traces inside take torch's ``precision`` for every dot and convolution
    without one of its own, and ``jax.jit`` picks (or traces) the program of it."""
    return jax.default_matmul_precision(jax_name(precision))


def uses_precision(jaxpr) -> bool:
    """Whether a (closed) jaxpr holds an op whose precision the setting decides: an equation with a
    ``precision`` parameter (dot_general, conv_general_dilated, ragged_dot_general), nested ones too."""
    return any_equation(jaxpr, lambda eqn: "precision" in eqn.params)
