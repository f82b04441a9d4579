"""JAX and Pallas kernels as PyTorch operators: on CPU tensors, DTensors and compiled graphs.

    from tpudist.kernels import custom_jax_kernel

    @custom_jax_kernel("mylib::rms_norm", shard_dims="... _, _ -> ... _")
    def rms_norm(x, w, *, eps: float = 1e-6):          # a jnp function, or one calling pallas_call
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w

    y = rms_norm(x_torch, w_torch)                      # torch in, torch out; autograd works

Helion kernels (``backend="pallas"``) become such ops with ``helion_op`` (``tpudist.kernels.helion``).

``tpudist.kernels.library`` holds the shipped kernels (RMSNorm, attention; Pallas variants);
``python -m tpudist warmup`` compiles them into the persistent compile cache. The Pallas TPU kernels
themselves are pure JAX (``flash_attention``, ``pallas_rms_norm``, ``tpu_blocks``): the names below are
imported on first use, so those modules load without torch (e.g. on a bare TPU machine).
"""

import importlib

_EXPORTS = {
    "current_mesh": "tpudist.kernels.dtensor",
    "KernelGradientError": "tpudist.kernels.errors",
    "KernelInputError": "tpudist.kernels.errors",
    "KernelShardingError": "tpudist.kernels.errors",
    "JaxKernel": "tpudist.kernels.kernel",
    "custom_jax_kernel": "tpudist.kernels.kernel",
    "helion_op": "tpudist.kernels.helion",  # imports Helion (seconds): only when asked for
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tpudist.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = ["JaxKernel", "KernelGradientError", "KernelInputError", "KernelShardingError", "current_mesh",
           "custom_jax_kernel"]
