"""DTensor placements (one per mesh *axis*) <-> JAX ``PartitionSpec`` (one per tensor *dim*).

Pure translation: no processes, no live mesh. The functions take placements and mesh axis names (and
sizes where a rule needs them), so every rule can be tested on its own.

Rules:
- ``Shard(d)`` on axis ``a`` puts ``a`` in the spec entry of dim ``d``; ``Replicate`` puts it nowhere.
- Several axes sharding one dim: DTensor splits the dim by the axes in increasing mesh-axis order,
  the first one outermost. A spec tuple lists axes major-to-minor. So ``(Shard(0), Shard(0))`` on
  axes ``("dp", "tp")`` is ``P(("dp", "tp"))``.
- ``_StridedShard(d, split_factor=k)`` (FSDP2 + TP) on an axis that precedes the plain ``Shard(d)``
  axes of the same dim, with ``k`` = product of their sizes, means "split by the later axes first":
  ``(_StridedShard(0, sf=tp), Shard(0))`` on ``("dp", "tp")`` is ``P(("tp", "dp"))``. Other strided
  forms raise :class:`LayoutError`.
- ``Partial(op)``: a pending reduction is not a sharding, so it rides beside the spec in
  :class:`JaxLayout` as ``partial_axes``. ``sum``/``avg``/``max``/``min`` have XLA collectives;
  other ops raise.
- Uneven shards: DTensor's ``torch.chunk`` rule (chunk = ceil(n / k), trailing shards short or
  empty) cannot be a ``NamedSharding`` (JAX needs even division). :func:`padded_length` and
  :func:`padded_positions` describe the padded layout tpudist uses inside its own programs
  (each shard padded at its end to the largest shard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

# Reductions with an XLA collective (psum, pmax, pmin; avg = psum / n).
REDUCE_OPS = ("sum", "avg", "max", "min")
_AXIS_NAME_PREFIX = "axis"


class LayoutError(ValueError):
    """A layout that one side (DTensor or JAX) cannot express, or an invalid one."""


@dataclass(frozen=True, slots=True)
class JaxLayout:
    """A JAX ``PartitionSpec`` plus the pending reductions DTensor's ``Partial`` carries.

    Attributes:
        spec: one entry per tensor dim (None, an axis name, or a tuple of names major-to-minor).
        partial_axes: ``((axis_name, reduce_op), ...)`` in mesh-axis order.
    """

    spec: Any  # jax.sharding.PartitionSpec
    partial_axes: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"JaxLayout(spec={self.spec!r}, partial_axes={self.partial_axes!r})"

    def __str__(self) -> str:
        partial = "".join(f" +{op}({axis})" for axis, op in self.partial_axes)
        return f"{self.spec}{partial}"

    @property
    def partial(self) -> dict[str, str]:
        return dict(self.partial_axes)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """Mesh axes sharding tensor ``dim``, major-to-minor."""
        entry = self.spec[dim] if dim < len(self.spec) else None
        return _entry_axes(entry)


def default_axis_names(num_axes: int) -> tuple[str, ...]:
    """Names for a DeviceMesh without ``mesh_dim_names``: ``axis0``, ``axis1``, ..."""
    return tuple(f"{_AXIS_NAME_PREFIX}{i}" for i in range(num_axes))


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return entry
    raise LayoutError(f"spec entry={entry!r} is not None, an axis name or a tuple of axis names; "
                      "unconstrained entries have no DTensor placement")


def _check_names(mesh_axis_names: Sequence[str]) -> tuple[str, ...]:
    names = tuple(mesh_axis_names)
    if len(set(names)) != len(names):
        raise LayoutError(f"mesh_axis_names={names} has duplicates: each mesh axis needs its own name")
    return names


def _normalise_dim(placement: Placement, dim: int, ndim: int, axis: str) -> int:
    if not -ndim <= dim < ndim:
        raise LayoutError(f"placement={placement} on mesh axis {axis!r} shards dim={dim}, but the tensor "
                          f"has ndim={ndim}; use a dim in [{-ndim}, {ndim})")
    return dim % ndim


def to_layout(placements: Sequence[Placement], mesh_axis_names: Sequence[str], ndim: int,
              mesh_shape: Sequence[int] | None = None) -> JaxLayout:
    """DTensor placements -> :class:`JaxLayout` (spec + pending reductions).

    Args:
        placements: one per mesh axis, as ``DTensor.placements``.
        mesh_axis_names: one per mesh axis (DeviceMesh ``mesh_dim_names``).
        ndim: number of tensor dims; the spec has exactly this many entries.
        mesh_shape: mesh axis sizes; needed only to check a ``_StridedShard`` split factor.

    Example:
        >>> to_layout([Shard(0), Partial()], ("dp", "tp"), 2)
        JaxLayout(spec=P('dp', None), partial_axes=(('tp', 'sum'),))
    """
    from jax.sharding import PartitionSpec

    names = _check_names(mesh_axis_names)
    placements = tuple(placements)
    if len(placements) != len(names):
        raise LayoutError(f"placements={_fmt(placements)} has {len(placements)} entries but the mesh has "
                          f"{len(names)} axes {names}: give one placement per mesh axis")
    plain: list[list[str]] = [[] for _ in range(ndim)]
    strided: list[list[tuple[str, int, int]]] = [[] for _ in range(ndim)]  # (axis, split_factor, index)
    partial: list[tuple[str, str]] = []
    for index, (axis, p) in enumerate(zip(names, placements)):
        if isinstance(p, _StridedShard):
            dim = _normalise_dim(p, p.dim, ndim, axis)
            strided[dim].append((axis, int(p.split_factor), index))
        elif isinstance(p, Shard):
            plain[_normalise_dim(p, p.dim, ndim, axis)].append(axis)
        elif isinstance(p, Partial):
            if p.reduce_op not in REDUCE_OPS:
                raise LayoutError(f"placement={p!r} on mesh axis {axis!r}: reduce_op={p.reduce_op!r} has no "
                                  f"XLA collective; supported: {REDUCE_OPS}. Redistribute it with "
                                  "DTensor.redistribute first")
            partial.append((axis, p.reduce_op))
        elif isinstance(p, Replicate):
            continue
        else:
            raise LayoutError(f"placement={p!r} on mesh axis {axis!r} is not Shard, Replicate, Partial or "
                              "_StridedShard; JAX has no equivalent")
    entries = []
    for dim in range(ndim):
        axes = _strided_order(dim, plain[dim], strided[dim], names, mesh_shape, placements)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return JaxLayout(PartitionSpec(*entries), tuple(partial))


def _strided_order(dim: int, plain: list[str], strided: list[tuple[str, int, int]],
                   names: tuple[str, ...], mesh_shape: Sequence[int] | None,
                   placements: tuple[Placement, ...]) -> tuple[str, ...]:
    if not strided:
        return tuple(plain)
    where = f"placements={_fmt(placements)} on mesh axes {names}"
    if len(strided) > 1:
        raise LayoutError(f"{where}: {len(strided)} _StridedShard axes on dim={dim}; only the FSDP2+TP form "
                          "(one strided axis before the plain Shard axes) has a PartitionSpec")
    axis, split_factor, index = strided[0]
    if not plain or any(names.index(a) < index for a in plain):
        raise LayoutError(f"{where}: _StridedShard on mesh axis {axis!r} must precede at least one plain "
                          f"Shard({dim}) axis (the FSDP2+TP form); here it does not")
    if mesh_shape is None:
        raise LayoutError(f"{where}: translating _StridedShard needs mesh_shape to check its split_factor")
    expected = math.prod(mesh_shape[names.index(a)] for a in plain)
    if split_factor != expected:
        raise LayoutError(f"{where}: _StridedShard split_factor={split_factor} on mesh axis {axis!r}, but "
                          f"the later Shard({dim}) axes {tuple(plain)} split the dim {expected} ways; "
                          "only split_factor == their product is a PartitionSpec")
    return (*plain, axis)


def to_partition_spec(placements: Sequence[Placement], mesh_axis_names: Sequence[str], ndim: int,
                      mesh_shape: Sequence[int] | None = None) -> Any:
    """DTensor placements -> ``PartitionSpec``; raises for ``Partial`` (use :func:`to_layout`).

    Example:
        >>> to_partition_spec([Shard(0), Shard(0)], ("dp", "tp"), 2)
        P(('dp', 'tp'), None)
    """
    layout = to_layout(placements, mesh_axis_names, ndim, mesh_shape)
    if layout.partial_axes:
        raise LayoutError(f"placements={_fmt(placements)} hold a pending reduction on mesh axes "
                          f"{[a for a, _ in layout.partial_axes]}, which a PartitionSpec cannot express; "
                          "use to_layout() to get it beside the spec")
    return layout.spec


def to_placements(layout: Any, mesh_axis_names: Sequence[str],
                  mesh_shape: Sequence[int] | None = None) -> tuple[Placement, ...]:
    """``PartitionSpec`` or :class:`JaxLayout` -> DTensor placements (one per mesh axis).

    A spec tuple in increasing mesh-axis order becomes plain ``Shard``s; one that lists later axes
    before one earlier axis becomes ``_StridedShard`` on that axis (needs ``mesh_shape``).

    Example:
        >>> to_placements(PartitionSpec(None, "tp"), ("dp", "tp"))
        (Replicate(), Shard(dim=1))
    """
    if not isinstance(layout, JaxLayout):
        layout = JaxLayout(layout)
    names = _check_names(mesh_axis_names)
    placements: dict[str, Placement] = {}

    def claim(axis: str, p: Placement, what: str) -> None:
        if axis not in names:
            raise LayoutError(f"{what} names mesh axis {axis!r}, which is not in mesh_axis_names={names}")
        if axis in placements:
            raise LayoutError(f"{what}: mesh axis {axis!r} is used twice in layout={layout}; a mesh axis "
                              "shards at most one dim and cannot also be pending a reduction")
        placements[axis] = p

    for dim, entry in enumerate(layout.spec):
        axes = _entry_axes(entry)
        for axis in axes:
            if axis not in names:
                raise LayoutError(f"spec entry {entry!r} of dim={dim} names mesh axis {axis!r}, which is not "
                                  f"in mesh_axis_names={names}")
        order = [names.index(a) for a in axes]
        if order == sorted(order):
            for axis in axes:
                claim(axis, Shard(dim), f"spec entry {entry!r} of dim={dim}")
            continue
        # One earlier axis last (the FSDP2+TP form): the others split first, in mesh order.
        head, last = axes[:-1], axes[-1]
        head_order = order[:-1]
        if head_order != sorted(head_order) or names.index(last) > min(head_order):
            raise LayoutError(f"spec entry {entry!r} of dim={dim} orders mesh axes {axes} in a way DTensor "
                              "cannot express; DTensor shards a dim by axes in increasing mesh order, or "
                              "(FSDP2+TP) by the later axes first and one earlier axis last")
        if mesh_shape is None:
            raise LayoutError(f"spec entry {entry!r} of dim={dim} needs a _StridedShard; pass mesh_shape to "
                              "compute its split_factor")
        split_factor = math.prod(mesh_shape[names.index(a)] for a in head)
        claim(last, _StridedShard(dim, split_factor=split_factor), f"spec entry {entry!r} of dim={dim}")
        for axis in head:
            claim(axis, Shard(dim), f"spec entry {entry!r} of dim={dim}")
    for axis, op in layout.partial_axes:
        if op not in REDUCE_OPS:
            raise LayoutError(f"partial_axes entry ({axis!r}, {op!r}): reduce_op={op!r} is not one of {REDUCE_OPS}")
        claim(axis, Partial(op), f"partial_axes entry ({axis!r}, {op!r})")
    return tuple(placements.get(axis, Replicate()) for axis in names)


# -- uneven shards ----------------------------------------------------------------------------------
def chunk(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(size, offset) of chunk ``index`` of ``length`` split ``num_chunks`` ways, as ``torch.chunk``."""
    size = -(-length // num_chunks)
    offset = min(index * size, length)
    return max(0, min(size, length - offset)), offset


def padded_length(length: int, axis_sizes: Sequence[int]) -> int:
    """Length of a dim split by ``axis_sizes`` (major-to-minor) once every shard is padded to the largest.

    DTensor splits one level at a time; the first chunk of each level is the largest.
    """
    local = length
    for size in axis_sizes:
        local = -(-local // size)
    return local * math.prod(axis_sizes)


def padded_positions(length: int, axis_sizes: Sequence[int]) -> list[int]:
    """Position in the padded dim (see :func:`padded_length`) of each logical index ``0..length-1``."""
    num_shards = math.prod(axis_sizes)
    slot = padded_length(length, axis_sizes) // max(1, num_shards)
    positions = [0] * length
    for flat in range(num_shards):
        size, offset = length, 0
        rest = flat
        for level, k in enumerate(axis_sizes):
            stride = math.prod(axis_sizes[level + 1:])
            size, sub = chunk(size, k, rest // stride)
            offset += sub
            rest %= stride
        for i in range(size):
            positions[offset + i] = flat * slot + i
    return positions


def is_even(shape: Sequence[int], layout: JaxLayout, mesh_sizes: dict[str, int]) -> bool:
    """Whether every sharded dim divides evenly (then padding is a no-op)."""
    return all(shape[d] % math.prod(mesh_sizes[a] for a in layout.dim_axes(d)) == 0
               for d in range(len(shape)))


def _fmt(placements: Iterable[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


__all__ = ["JaxLayout", "LayoutError", "REDUCE_OPS", "chunk", "default_axis_names", "is_even",
           "padded_length", "padded_positions", "to_layout", "to_partition_spec", "to_placements"]
