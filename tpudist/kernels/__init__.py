"""JAX and Pallas kernels as PyTorch operators: on CPU tensors, DTensors and compiled graphs.

    from tpudist.kernels import custom_jax_kernel

    @custom_jax_kernel("mylib::rms_norm", shard_dims="... _, _ -> ... _")
    def rms_norm(x, w, *, eps: float = 1e-6):          # a jnp function, or one calling pallas_call
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w

    y = rms_norm(x_torch, w_torch)                      # torch in, torch out; autograd works

Helion kernels (``backend="pallas"``) become such ops with ``helion_op`` (``tpudist.kernels.helion``).

``tpudist.kernels.library`` holds the shipped kernels (RMSNorm, attention; Pallas variants);
``python -m tpudist warmup`` compiles them into the persistent compile cache.
"""

from tpudist.kernels.dtensor import current_mesh
from tpudist.kernels.errors import KernelGradientError, KernelInputError, KernelShardingError
from tpudist.kernels.kernel import JaxKernel, custom_jax_kernel


def __getattr__(name):
    if name == "helion_op":  # imports Helion (seconds): only when asked for
        from tpudist.kernels.helion import helion_op

        return helion_op
    raise AttributeError(f"module 'tpudist.kernels' has no attribute {name!r}")


__all__ = ["JaxKernel", "KernelGradientError", "KernelInputError", "KernelShardingError", "current_mesh",
           "custom_jax_kernel"]
