"""The errors a kernel raises on bad input; each names the kernel, what it got and what it expects."""

from __future__ import annotations


class KernelInputError(TypeError, ValueError):
    """A kernel got tensors of a dtype or shape it does not accept (or static arguments it rejects).

    Both a ``TypeError`` and a ``ValueError``, so callers catching either for bad input catch it.
    """


class KernelShardingError(ValueError):
    """A DTensor's placements do not fit the dims a shard-by-shard kernel declares shardable."""


class KernelGradientError(NotImplementedError):
    """A kernel has no reverse-mode gradient (a Pallas ``pallas_call`` without ``backward=``/``reference=``)."""


def describe(value) -> str:
    """``float32[8, 64]`` for an array-like (torch, JAX, ShapeDtypeStruct), ``repr`` otherwise."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return repr(value)
    name = str(dtype).removeprefix("torch.")
    return f"{name}[{', '.join(str(int(n)) for n in shape)}]"


__all__ = ["KernelGradientError", "KernelInputError", "KernelShardingError", "describe"]
