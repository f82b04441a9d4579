"""Matrix products."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpudist.ops.registry import lowers

aten = torch.ops.aten


@lowers(aten.mm.default, aten.bmm.default)
def matmul(x, y):
    return jnp.matmul(x, y)
