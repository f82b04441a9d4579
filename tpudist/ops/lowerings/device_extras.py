"""Lowerings the "tpu" device met that the table did not have yet (merged into the families later)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.ops.registry import lowering_for, lowers

aten = torch.ops.aten


@lowers(aten.matmul_backward.default)
def matmul_backward(grad, x, y, mask):
    # jnp.matmul broadcasts exactly like torch.matmul, so its VJP is matmul's backward (1-D cases too)
    _, vjp = jax.vjp(jnp.matmul, x, y)
    gx, gy = vjp(grad.astype(jnp.result_type(x, y)))
    return gx, gy


if lowering_for(aten.copy.default) is None:
    @lowers(aten.copy.default)
    def copy(x, src, non_blocking=False):
        return jnp.broadcast_to(src, x.shape).astype(x.dtype)
