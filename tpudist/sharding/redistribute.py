"""``redistribute``: a DTensor placement change as one jitted XLA program over the whole mesh.

=========================  =========================  ==============================================
placement transition       XLA collective             note
=========================  =========================  ==============================================
Shard(i) -> Replicate      all_gather                 padded shards are sliced off after
Partial -> Replicate       psum (pmax, pmin)          avg = psum / n
Partial -> Shard(i)        psum_scatter               XLA:CPU: all-reduce + slice
Shard(i) -> Shard(j)       all_to_all                 i != j; i == j on other axes: permute
Replicate -> Shard(i)      local slice                no communication
Replicate -> Partial       local (MPMD)               DTensor's own split, no communication
=========================  =========================  ==============================================

The program maps the source global array (its sharding = source placements) to the destination
sharding; XLA's SPMD partitioner picks the collectives, several mesh axes at once. Uneven shards are
padded to the largest shard on entry and sliced off on exit. What JAX cannot express (``Partial``
with ``product``/bitwise ops, uneven ``_StridedShard``, a new ``Partial``) takes DTensor's own
redistribute (MPMD), as does a rank whose compiled program differs from the others'.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Placement, Shard

from tpudist.sharding import arrays
from tpudist.sharding.arrays import BlockSpec, pad, reduce_partial, unpad
from tpudist.sharding.layout import LayoutError
from tpudist.sharding.plan import (DEFAULT_TIMEOUT, Path, Plan, collectives, digest, environment,
                                   run_in_order, settle)

_programs: dict[tuple, tuple[Any, Any, str]] = {}
_lock = threading.Lock()


def _canonical(dtensor: DTensor, placements: Sequence[Placement]) -> tuple[Placement, ...]:
    placements = tuple(placements)
    ndim = dtensor.device_mesh.ndim
    if len(placements) != ndim:
        raise ValueError(f"placements={tuple(str(p) for p in placements)} has {len(placements)} entries; the "
                         f"mesh has ndim={ndim}: give one placement per mesh axis")
    return tuple(Shard(p.dim % dtensor.ndim) if type(p) is Shard and p.dim < 0 else p for p in placements)


def plan_redistribute(dtensor: DTensor, placements: Sequence[Placement]) -> Plan:
    """The plan of ``redistribute(dtensor, placements)``: path, reason, collectives, fingerprint.

    Needs no other rank (an SPMD plan is lowered locally to fingerprint its program).

    Example:
        >>> print(plan_redistribute(x, [Replicate()]))
        redistribute: spmd (both layouts have a JAX sharding); all_gather[x] S(0)->R; fingerprint ...
    """
    return _prepare(dtensor, placements)[0]


def _prepare(dtensor: DTensor, placements: Sequence[Placement]) -> tuple[Plan, Any, Any]:
    """The plan with its program fingerprint, its block specs and the jitted program (SPMD only)."""
    plan, specs = _plan(dtensor, placements)
    if specs is None:
        return plan, None, None
    with arrays.x64(dtensor.dtype):
        program, text_digest = program_for(arrays.jax_mesh(dtensor.device_mesh), *specs, _jax_dtype(dtensor))
    return plan.with_program(digest(text_digest, environment())), specs, program


def _plan(dtensor: DTensor, placements: Sequence[Placement]) -> tuple[Plan, Any]:
    dst = _canonical(dtensor, placements)
    src = tuple(dtensor.placements)
    mesh = dtensor.device_mesh
    names = arrays.mesh_axis_names(mesh)
    steps = collectives(names, src, dst)
    grad = dtensor.requires_grad and torch.is_grad_enabled()
    meaning = digest("redistribute", arrays.mesh_key(mesh), tuple(dtensor.shape), str(dtensor.dtype),
                     tuple(map(repr, src)), tuple(map(repr, dst)), grad)
    if src == dst:
        return Plan("redistribute", Path.MPMD, "placements unchanged", (), meaning), None
    if grad:
        return Plan("redistribute", Path.MPMD, "the input requires grad: DTensor's redistribute is "
                    "differentiable, the XLA program is not", steps, meaning), None
    try:
        src_spec = arrays.block_spec_of(dtensor)
        dst_layout = arrays.to_layout(dst, names, dtensor.ndim, tuple(mesh.mesh.shape))
        dst_spec = BlockSpec(src_spec.shape, dst_layout, src_spec.mesh_sizes)
        if not set(dst_layout.partial_axes) <= set(src_spec.layout.partial_axes):
            raise LayoutError(f"placements={tuple(map(str, dst))} create a pending reduction, which is a "
                              "local split in DTensor, not an XLA collective")
    except LayoutError as e:
        return Plan("redistribute", Path.MPMD, str(e), steps, meaning), None
    return Plan("redistribute", Path.SPMD, "both layouts have a JAX sharding", steps, meaning), (src_spec, dst_spec)


def _jax_dtype(dtensor: DTensor) -> np.dtype:
    return arrays.numpy_dtype(dtensor.dtype)


def _build(mesh: Any, src: BlockSpec, dst: BlockSpec, dtype: Any) -> tuple[Any, str]:
    import jax
    from jax.sharding import NamedSharding

    def program(block):
        x = reduce_partial(block, src, keep=dst.layout.partial_axes)
        lead = len(dst.layout.partial_axes)
        return pad(unpad(x, src, lead), dst, lead)

    jitted = jax.jit(program, out_shardings=NamedSharding(mesh, dst.block_spec()))
    abstract = jax.ShapeDtypeStruct(src.block_shape(), dtype, sharding=NamedSharding(mesh, src.block_spec()))
    text = jitted.lower(abstract).as_text()
    return jitted, digest(text)


def program_for(mesh: Any, src: BlockSpec, dst: BlockSpec, dtype: Any) -> tuple[Any, str]:
    """The cached program and the digest of its lowered text. Its XLA executable comes from tpudist's
    program cache at the first call (keyed by the lowered program and the mesh's devices): every rank
    of the next world, and a rank after its peer in this one, loads it instead of compiling."""
    return _entry(mesh, src, dst, dtype)[1:]


def _entry(mesh: Any, src: BlockSpec, dst: BlockSpec, dtype: Any) -> tuple[Any, Any, str]:
    """(the jitted program, the program to run, the digest of its lowered text)."""
    from tpudist.process_group.programs import CachedProgram

    key = (mesh, src, dst, np.dtype(dtype).name)
    with _lock:
        hit = _programs.get(key)
    if hit is None:
        jitted, text_digest = _build(mesh, src, dst, dtype)
        hit = (jitted, CachedProgram(jitted, list(mesh.devices.flat), ("redistribute", text_digest)), text_digest)
        with _lock:
            _programs[key] = hit
    return hit


def redistribute(dtensor: DTensor, placements: Sequence[Placement], *, on_mismatch: str = "mpmd",
                 timeout: timedelta = DEFAULT_TIMEOUT) -> DTensor:
    """``dtensor`` with new placements, computed by one XLA program across its mesh.

    Every rank of ``dtensor.device_mesh`` calls it (as for ``DTensor.redistribute``); the result
    equals ``dtensor.redistribute(dtensor.device_mesh, placements)``. See the module docstring for
    the collective each transition becomes.

    Args:
        dtensor: the source DTensor.
        placements: one per mesh axis.
        on_mismatch: if ranks agree on the call but compiled different programs, ``"mpmd"`` falls
            back to DTensor's per-rank collectives, ``"raise"`` raises :class:`PlanMismatch`.
        timeout: how long to wait for the other ranks' fingerprints.

    Raises:
        PlanMismatch: ranks asked for different redistributions (names them).
        AgreementTimeout: a rank did not arrive within ``timeout``.

    Example:
        >>> y = redistribute(x, [Replicate()])     # x: Shard(0) on a 1-D mesh -> all_gather
    """
    import jax

    plan, specs, program = _prepare(dtensor, placements)
    dst = _canonical(dtensor, placements)
    mesh = dtensor.device_mesh
    key = arrays.mesh_key(mesh)
    path = settle(plan, key[0], digest(key), _describe(dtensor, dst), on_mismatch, timeout)
    if path is Path.MPMD:
        return dtensor if dst == tuple(dtensor.placements) else dtensor.redistribute(mesh, dst)
    src_spec, dst_spec = specs

    def run():
        with arrays.x64(dtensor.dtype):
            return jax.block_until_ready(program(arrays.to_block(dtensor, src_spec)))

    out = run_in_order(_describe(dtensor, dst), run, timeout)
    return arrays.from_block(out, dst_spec, mesh, dst)


def _describe(dtensor: DTensor, dst: Sequence[Placement]) -> str:
    return (f"redistribute(shape={tuple(dtensor.shape)}, dtype={dtensor.dtype}, "
            f"{tuple(map(str, dtensor.placements))} -> {tuple(map(str, dst))})")


def compiled_text(dtensor: DTensor, placements: Sequence[Placement]) -> str:
    """The optimised HLO of the SPMD program (to count collectives); needs no other rank."""
    plan, specs, program = _prepare(dtensor, placements)
    if plan.path is not Path.SPMD:
        raise ValueError(f"redistribute to {tuple(map(str, placements))} is not SPMD: {plan.reason}")
    import jax
    from jax.sharding import NamedSharding

    src = specs[0]
    jmesh = arrays.jax_mesh(dtensor.device_mesh)
    with arrays.x64(dtensor.dtype):
        abstract = jax.ShapeDtypeStruct(src.block_shape(), _jax_dtype(dtensor),
                                        sharding=NamedSharding(jmesh, src.block_spec()))
        return _entry(jmesh, *specs, _jax_dtype(dtensor))[0].lower(abstract).compile().as_text()


__all__ = ["compiled_text", "plan_redistribute", "redistribute"]
