"""``redistribute``: a DTensor placement change as one jitted XLA program over the whole mesh.

=========================  =========================  ==============================================
placement transition       XLA collective             note
=========================  =========================  ==============================================
Shard(i) -> Replicate      all_gather                 padded shards are sliced off after
Partial -> Replicate       psum (pmax, pmin)          avg = psum / n
Partial -> Shard(i)        psum_scatter               XLA's reduce-scatter
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
from torch.distributed.tensor import DTensor, Placement, Shard

from tpudist.sharding import arrays
from tpudist.sharding.arrays import BlockSpec
from tpudist.sharding.layout import LayoutError, padded_positions
from tpudist.sharding.plan import DEFAULT_TIMEOUT, Path, Plan, collectives, digest, environment, run_in_order, settle

_REDUCE = {"sum": "sum", "avg": "mean", "max": "max", "min": "min"}
_programs: dict[tuple, tuple[Any, str]] = {}
_lock = threading.Lock()


def _canonical(dtensor: DTensor, placements: Sequence[Placement]) -> tuple[Placement, ...]:
    placements = tuple(placements)
    ndim = dtensor.device_mesh.ndim
    if len(placements) != ndim:
        raise ValueError(f"placements={tuple(str(p) for p in placements)} has {len(placements)} entries; the "
                         f"mesh has ndim={ndim}: give one placement per mesh axis")
    return tuple(Shard(p.dim % dtensor.ndim) if type(p) is Shard and p.dim < 0 else p for p in placements)


def plan_redistribute(dtensor: DTensor, placements: Sequence[Placement]) -> tuple[Plan, Any]:
    """The plan of ``redistribute(dtensor, placements)`` and, for SPMD, its block specs."""
    dst = _canonical(dtensor, placements)
    src = tuple(dtensor.placements)
    mesh = dtensor.device_mesh
    names = arrays.mesh_axis_names(mesh)
    steps = collectives(names, src, dst)
    meaning = digest("redistribute", arrays.mesh_key(mesh), tuple(dtensor.shape), str(dtensor.dtype),
                     tuple(map(repr, src)), tuple(map(repr, dst)))
    if src == dst:
        return Plan("redistribute", Path.MPMD, "placements unchanged", (), meaning), None
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


def unpad(x: Any, spec: BlockSpec, lead: int) -> Any:
    """Padded block (after ``lead`` partial dims) -> logical array, inside a traced program."""
    import jax.numpy as jnp

    sizes = spec.sizes
    for dim, n in enumerate(spec.shape):
        axis_sizes = [sizes[a] for a in spec.layout.dim_axes(dim)]
        if x.shape[lead + dim] == n:
            continue
        positions = padded_positions(n, axis_sizes)
        if positions == list(range(n)):
            x = jax_slice(x, lead + dim, n)
        else:
            x = jnp.take(x, np.asarray(positions, dtype=np.int32), axis=lead + dim)
    return x


def pad(x: Any, spec: BlockSpec, lead: int) -> Any:
    """Logical array -> padded block (after ``lead`` partial dims), inside a traced program."""
    import jax.numpy as jnp

    sizes = spec.sizes
    for dim, (n, padded) in enumerate(zip(spec.shape, spec.padded_shape())):
        if padded == n:
            continue
        positions = padded_positions(n, [sizes[a] for a in spec.layout.dim_axes(dim)])
        if positions == list(range(n)):
            widths = [(0, 0)] * x.ndim
            widths[lead + dim] = (0, padded - n)
            x = jnp.pad(x, widths)
        else:
            shape = list(x.shape)
            shape[lead + dim] = padded
            index = [slice(None)] * x.ndim
            index[lead + dim] = np.asarray(positions, dtype=np.int32)
            x = jnp.zeros(shape, x.dtype).at[tuple(index)].set(x)
    return x


def jax_slice(x: Any, axis: int, length: int) -> Any:
    import jax

    return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def reduce_partial(x: Any, src: BlockSpec, keep: tuple[tuple[str, str], ...] = ()) -> Any:
    """Applies the pending reductions of ``src`` not in ``keep`` (leading dims, one per axis)."""
    import jax.numpy as jnp

    for index in reversed(range(len(src.layout.partial_axes))):
        entry = src.layout.partial_axes[index]
        if entry in keep:
            continue
        x = getattr(jnp, _REDUCE[entry[1]])(x, axis=index).astype(x.dtype)  # jnp.sum widens small ints
    return x


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
    """The cached jitted program and the digest of its lowered text."""
    key = (mesh, src, dst, np.dtype(dtype).name)
    with _lock:
        hit = _programs.get(key)
    if hit is None:
        hit = _build(mesh, src, dst, dtype)
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

    plan, specs = plan_redistribute(dtensor, placements)
    dst = _canonical(dtensor, placements)
    mesh = dtensor.device_mesh
    if plan.path is Path.SPMD:
        src_spec, dst_spec = specs
        jmesh = arrays.jax_mesh(mesh)
        with arrays.x64(dtensor.dtype):
            block = arrays.to_block(dtensor, src_spec)
            program, text_digest = program_for(jmesh, src_spec, dst_spec, block.dtype)
        plan = plan.with_program(digest(text_digest, environment()))
    key = arrays.mesh_key(mesh)
    path = settle(plan, key[0], digest(key), _describe(dtensor, dst), on_mismatch, timeout)
    if path is Path.MPMD:
        if plan.reason == "placements unchanged":
            return dtensor
        return dtensor.redistribute(mesh, dst)
    def run():
        with arrays.x64(dtensor.dtype):
            return jax.block_until_ready(program(block))

    out = run_in_order(_describe(dtensor, dst), run, timeout)
    return arrays.from_block(out, dst_spec, mesh, dst)


def _describe(dtensor: DTensor, dst: Sequence[Placement]) -> str:
    return (f"redistribute(shape={tuple(dtensor.shape)}, dtype={dtensor.dtype}, "
            f"{tuple(map(str, dtensor.placements))} -> {tuple(map(str, dst))})")


def compiled_text(dtensor: DTensor, placements: Sequence[Placement]) -> str:
    """The optimised HLO of the SPMD program (to count collectives); needs no other rank."""
    plan, specs = plan_redistribute(dtensor, placements)
    if plan.path is not Path.SPMD:
        raise ValueError(f"redistribute to {tuple(map(str, placements))} is not SPMD: {plan.reason}")
    import jax
    from jax.sharding import NamedSharding

    src, dst = specs
    jmesh = arrays.jax_mesh(dtensor.device_mesh)
    with arrays.x64(dtensor.dtype):
        dtype = arrays.to_block(dtensor, src).dtype
        program, _ = program_for(jmesh, src, dst, dtype)
        abstract = jax.ShapeDtypeStruct(src.block_shape(), dtype, sharding=NamedSharding(jmesh, src.block_spec()))
        return program.lower(abstract).compile().as_text()


__all__ = ["compiled_text", "plan_redistribute", "redistribute"]
