"""torch dtype <-> JAX dtype, both ways, for every dtype the lowering table handles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.bool: jnp.bool_,
    torch.uint8: jnp.uint8,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def to_jax_dtype(dtype: torch.dtype):
    """The JAX dtype of a torch dtype; TypeError naming the dtype where JAX has none."""
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"dtype={dtype} has no JAX equivalent; supported: "
                        f"{', '.join(str(d) for d in _TORCH_TO_JAX)}") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype."""
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"JAX dtype={dtype} has no torch equivalent") from None
