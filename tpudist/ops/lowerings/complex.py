"""Complex numbers: building them from parts (``complex``, ``polar``).

torch's decompositions of these write through ``real``/``imag`` views of a fresh complex tensor
(``result.real.copy_(...)``): a write into a view that changes the element type, which the
decomposition interpreter cannot propagate. One JAX expression each instead.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from tpudist.ops.lowerings._util import promote, to_float
from tpudist.ops.registry import lowers

aten = torch.ops.aten


@lowers(aten.complex.default)
def complex_(real, imag):
    real, imag = promote(to_float(real), to_float(imag))
    return lax.complex(*jnp.broadcast_arrays(real, imag))  # torch broadcasts the two parts


@lowers(aten.polar.default)
def polar(abs, angle):
    abs, angle = promote(abs, angle)
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))
