"""What a Pallas kernel needs to compile for TPU (Mosaic), shared by the shipped kernels.

Pure JAX (no torch), so the kernels can be checked on a TPU machine without the project installed.

- Index maps return int32. Under ``jax_enable_x64`` (the "tpu" device traces with it on) a Python int
  returned by an index map traces as int64, and Mosaic then fails in libtpu with "failed to legalize
  operation 'func.return' ... (i32, i32, i64)" (seen on a v5e, 2026-12-05). :func:`block_spec` casts.
- Block shapes: the last two dims of a block are multiples of (sublanes, 128 lanes) or the array's
  whole dims. A vreg holds 8 rows of 32-bit values; 16-bit dtypes pack 16 rows, 8-bit 32.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

LANES = 128  # lanes of a TPU vreg (every generation to v6e)
SUBLANES = 8  # 32-bit rows of a TPU vreg


def sublanes(dtype) -> int:
    """Rows of ``dtype`` one vreg holds: 8 for 32-bit, 16 for bf16/f16 (packed), at least 8."""
    return SUBLANES * max(1, 4 // np.dtype(dtype).itemsize)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def int32_index_map(index_map):
    """``index_map`` with every block index cast to int32 (Mosaic rejects int64, see the module doc)."""

    def cast(*grid_indices):
        return tuple(jnp.asarray(i, jnp.int32) for i in index_map(*grid_indices))

    return cast


def block_spec(block_shape, index_map):
    """``pl.BlockSpec`` whose index map returns int32 whatever ``jax_enable_x64`` says."""
    from jax.experimental import pallas as pl

    return pl.BlockSpec(block_shape, int32_index_map(index_map))


def compiler_params(*dimension_semantics: str, vmem_limit_bytes: int | None = None):
    """Mosaic's parameters: "parallel" grid axes may be split across cores, "arbitrary" ones run in
    order (an axis a kernel accumulates over must be "arbitrary")."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=dimension_semantics, vmem_limit_bytes=vmem_limit_bytes)


def when(condition, body) -> None:
    """``pl.when(condition)(body)``, where a condition known while tracing (a Python bool) runs or drops
    ``body`` without a branch in the kernel."""
    from jax.experimental import pallas as pl

    if isinstance(condition, bool):
        if condition:
            body()
        return
    pl.when(condition)(body)


@contextlib.contextmanager
def pallas_interpret_unless_tpu():
    """Inside: ``pallas_call`` traces in interpret mode unless JAX runs on TPU (compiled there).

    Uses JAX's own switch (the config ``pl.pallas_call`` reads at trace time; jax 0.10). Set only
    while a kernel traces, so the user's setting outside kernels is untouched.
    """
    import jax
    from jax._src import config

    if jax.default_backend() == "tpu":
        yield
        return
    switch = config.pallas_tpu_interpret_mode_context_manager
    previous = switch.swap_local(switch.value or True)
    try:
        yield
    finally:
        switch.set_local(previous)


__all__ = ["LANES", "SUBLANES", "block_spec", "compiler_params", "int32_index_map", "pallas_interpret_unless_tpu",
           "round_up", "sublanes", "when"]
