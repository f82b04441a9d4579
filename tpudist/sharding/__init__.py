"""DTensor <-> JAX: the placement translator, SPMD where possible, MPMD otherwise.

DTensor placements (one per mesh *axis*) translate to a JAX ``PartitionSpec`` (one per tensor
*dim*) on a ``jax.sharding.Mesh`` over the same devices whose axis names are the DeviceMesh's dim
names (``axis0, axis1, ...`` when it has none). ``Partial`` rides beside the spec in
:class:`JaxLayout`. Uneven shards are padded inside tpudist's programs and are an error for
:func:`to_jax` (a ``jax.Array`` needs even shards).

:func:`redistribute` changes placements with one jitted XLA program over the whole mesh; XLA's
partitioner picks the collectives:

=========================  =========================
placement transition       XLA collective
=========================  =========================
Shard(i) -> Replicate      all_gather
Partial -> Replicate       psum (pmax / pmin; avg = psum / n)
Partial -> Shard(i)        psum_scatter
Shard(i) -> Shard(j)       all_to_all
Replicate -> Shard(i)      local slice (no communication)
Replicate -> Partial       local split (DTensor's own, MPMD)
=========================  =========================

Before an SPMD program runs, the mesh's ranks agree on its :class:`Plan` fingerprint through the
c10d store; a rank whose compiled program differs makes the call fall back to DTensor's per-rank
collectives (MPMD), a rank asking for something else raises :class:`PlanMismatch`, and a rank that
never arrives raises :class:`AgreementTimeout`.

Example:
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
    >>> to_jax(x).sharding.spec
    P('dp', 'tp')
    >>> y = redistribute(x, [Replicate(), Shard(0)])
"""

from tpudist.sharding.arrays import from_jax, jax_mesh, mesh_axis_names, to_jax
from tpudist.sharding.layout import (JaxLayout, LayoutError, default_axis_names, to_layout,
                                     to_partition_spec, to_placements)
from tpudist.sharding.plan import AgreementTimeout, Collective, Path, Plan, PlanMismatch, path_counts
from tpudist.sharding.redistribute import plan_redistribute, redistribute
from tpudist.sharding.spmd import spmd

__all__ = ["AgreementTimeout", "Collective", "JaxLayout", "LayoutError", "Path", "Plan", "PlanMismatch",
           "default_axis_names", "from_jax", "jax_mesh", "mesh_axis_names", "path_counts", "plan_redistribute",
           "redistribute", "spmd", "to_jax", "to_layout", "to_partition_spec", "to_placements"]
