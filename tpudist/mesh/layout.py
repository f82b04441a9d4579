"""Laying a logical mesh onto a TPU slice so that each mesh axis follows torus rings.

The layout is JAX's: `jax.experimental.mesh_utils.create_device_mesh` is fed mock devices (one per
chip, with the coordinates, host and `device_kind` the slice would report) and returns them arranged
as the mesh; the ranks are read back from the devices. Which physical axes each mesh axis got is
then read off the rank array, so device-kind special cases in JAX (tray ring orders on v5e, v5p
2x2x2) are described as they are. JAX is imported on first use only, and no JAX backend is touched
(`jax.distributed.initialize` must still be possible afterwards).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tpudist.mesh._errors import TopologyError
from tpudist.mesh.cost import PHYSICAL_AXIS_NAMES, CollectiveCost, RingAxis, estimate_collective, format_seconds
from tpudist.mesh.generations import Generation

# JAX's "TPU7x" handler (mesh_utils._7x_create_device_mesh) orders the two TensorCores of each chip
# of a 2x2 tray; fed one device per chip it would make diagonal chips neighbours. tpudist lays out
# 7x per chip (one rank per chip), so its mock devices carry a kind JAX has no handler for, which
# sends them through JAX's generic 3-D torus assignment, as for v4.
CHIP_LEVEL_7X_DEVICE_KIND = "TPU7x (one device per chip)"

# The array size used to give each mesh axis a concrete all-reduce time in descriptions.
DESCRIBE_ALL_REDUCE_BYTES = 2**20
# Rank arrays up to this many chips are printed in full.
DESCRIBE_MAX_PRINTED_RANKS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class _MockTpuDevice:
    """The attributes `jax.experimental.mesh_utils` reads from a TPU device."""

    id: int
    process_index: int
    coords: tuple[int, int, int]
    core_on_chip: int
    device_kind: str
    platform: str = "tpu"
    slice_index: int = 0


class Slice(Protocol):
    """What laying a mesh reads from the slice it is handed: `tpudist.mesh.Topology` is one (topology.py
    sits above this module and offers the layout as `Topology.mesh_layout`)."""

    @property
    def generation(self) -> str: ...
    @property
    def generation_info(self) -> Generation: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def num_dims(self) -> int: ...
    @property
    def num_chips(self) -> int: ...
    @property
    def wraparound(self) -> tuple[bool, ...]: ...
    def coords(self, rank: int) -> tuple[int, ...]: ...
    def host_of(self, rank: int) -> int: ...
    def hops(self, rank_a: int, rank_b: int) -> int: ...
    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class MeshLayout:
    """A logical mesh laid onto a slice: the rank at each mesh position and the physical axes used.

    Attributes:
        topology: the slice.
        mesh_shape: size of each mesh axis, ordered by increasing network intensity.
        axis_names: one name per mesh axis ("axis0", ... unless given).
        ranks: the rank array flattened in row-major order (see `rank_array`).
        physical_axes: per mesh axis, the physical axes (0 is x) along which its chips lie,
            ascending.
        physical_sizes: per mesh axis, how many chips it spans along each of those physical axes
            (the whole physical axis, or part of it when `allow_split_physical_axes` split it).

    Example:
        >>> layout = Topology.parse("v4:4x4x4").mesh_layout((4, 16), axis_names=("dp", "tp"))
        >>> layout.physical_axes, layout.physical_sizes
        (((2,), (0, 1)), ((4,), (4, 4)))
        >>> str(layout)
        'v4:4x4x4 as (dp=4, tp=16)'
    """

    topology: Slice
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    ranks: tuple[int, ...]
    physical_axes: tuple[tuple[int, ...], ...]
    physical_sizes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        assert len(self.axis_names) == len(self.mesh_shape) == len(self.physical_axes), self
        assert sorted(self.ranks) == list(range(self.topology.num_chips)), self

    def __str__(self) -> str:
        axes = ", ".join(f"{name}={size}" for name, size in zip(self.axis_names, self.mesh_shape))
        return f"{self.topology} as ({axes})"

    @property
    def rank_array(self) -> np.ndarray:
        """The ranks as an int64 array shaped `mesh_shape` (a new array each call)."""
        return np.array(self.ranks, dtype=np.int64).reshape(self.mesh_shape)

    def axis_index(self, axis: int | str) -> int:
        """The position of a mesh axis given by name or index."""
        if isinstance(axis, str) and axis in self.axis_names:
            return self.axis_names.index(axis)
        if not isinstance(axis, (bool, str)) and hasattr(axis, "__index__"):
            if 0 <= operator.index(axis) < len(self.mesh_shape):
                return operator.index(axis)
        raise TopologyError(
            f"axis={axis!r} is not a mesh axis of {self}: the axes are {self.axis_names} (or 0.."
            f"{len(self.mesh_shape) - 1}); pass one of these.")

    def wraps(self, axis: int | str) -> bool:
        """Whether a mesh axis is a ring closed by wraparound links: it covers whole physical axes
        that all wrap."""
        index = self.axis_index(axis)
        shape, wraparound = self.topology.shape, self.topology.wraparound
        return bool(self.physical_axes[index]) and all(
            size == shape[p] and wraparound[p]
            for p, size in zip(self.physical_axes[index], self.physical_sizes[index]))

    def ring_hops(self, axis: int | str) -> tuple[int, int]:
        """How well a mesh axis follows the torus: (most hops between consecutive chips along it,
        most hops from its last chip back to its first), over every line of the axis.

        (1, 1) is a ring of neighbours; (1, n - 1) a line without wraparound.

        Example:
            >>> Topology.parse("v5e:4x2").mesh_layout((8,)).ring_hops(0)
            (1, 1)
        """
        index = self.axis_index(axis)
        lines = np.moveaxis(self.rank_array, index, -1).reshape(-1, self.mesh_shape[index])
        hops = self.topology.hops
        step = max((hops(int(a), int(b)) for line in lines for a, b in zip(line, line[1:])),
                   default=0)
        closing = max(hops(int(line[-1]), int(line[0])) for line in lines)
        return step, closing

    def collective_cost(self, op: str, nbytes: int,
                        axes: int | str | Sequence[int | str]) -> CollectiveCost:
        """Estimates a collective over some mesh axes (by name or index), as laid on the torus.

        A physical axis the group covers only in part is costed as a line of that many chips with
        no wraparound (an estimate: a strided part of a split axis takes longer hops).

        Example:
            >>> layout = Topology.parse("v4:4x4x4").mesh_layout((4, 16), axis_names=("dp", "tp"))
            >>> round(layout.collective_cost("all_gather", 8 * 2**20, "tp").seconds * 1e6, 2)
            43.69
        """
        items = [axes] if isinstance(axes, str) or hasattr(axes, "__index__") else list(axes)
        indices = [self.axis_index(item) for item in items]
        if len(set(indices)) != len(indices):
            raise TopologyError(
                f"axes={axes!r} names a mesh axis twice: each mesh axis can be used once; pass "
                "distinct axes.")
        covered: dict[int, int] = {}
        for index in indices:
            for p, size in zip(self.physical_axes[index], self.physical_sizes[index]):
                covered[p] = covered.get(p, 1) * size
        shape, wraparound = self.topology.shape, self.topology.wraparound
        rings = [RingAxis(p, min(size, shape[p]), size >= shape[p] and wraparound[p])
                 for p, size in sorted(covered.items())]
        group_size = math.prod(self.mesh_shape[index] for index in indices)
        return estimate_collective(self.topology.generation_info, op, nbytes, group_size, rings)

    def collective_seconds(self, op: str, nbytes: int,
                           axes: int | str | Sequence[int | str]) -> float:
        """`collective_cost(...).seconds`."""
        return self.collective_cost(op, nbytes, axes).seconds

    def describe(self) -> str:
        """The slice, then which physical axes each mesh axis got, with wraparound.

        Example:
            >>> layout = Topology.parse("v4:2x2x1").mesh_layout((2, 2), axis_names=("dp", "tp"))
            >>> layout.describe().splitlines()[4:6]
            ['mesh (dp=2, tp=2):', '  dp 2 chips on y: ring; neighbours 1 hop apart; all_reduce of 1 MiB 23.3 us']
        """
        topology = self.topology
        axes = ", ".join(f"{name}={size}" for name, size in zip(self.axis_names, self.mesh_shape))
        lines = [f"mesh ({axes}):"]
        width = max(len(name) for name in self.axis_names)
        for index, (name, size) in enumerate(zip(self.axis_names, self.mesh_shape)):
            if size == 1:
                lines.append(f"  {name:<{width}} 1 chip")
                continue
            parts = []
            for p, span in zip(self.physical_axes[index], self.physical_sizes[index]):
                whole = span == topology.shape[p]
                parts.append(f"{PHYSICAL_AXIS_NAMES[p]}" + ("" if whole else f" ({span} of "
                                                             f"{topology.shape[p]})"))
            step, closing = self.ring_hops(index)
            if self.wraps(index):
                shape = "ring with wraparound"
            elif closing <= 1:
                shape = "ring"
            else:
                shape = f"no wraparound, {closing} hops back"
            cost = self.collective_cost("all_reduce", DESCRIBE_ALL_REDUCE_BYTES, index)
            lines.append(
                f"  {name:<{width}} {size} chips on {', '.join(parts)}: {shape}; neighbours "
                f"{step} hop{'s' if step != 1 else ''} apart; all_reduce of 1 MiB "
                f"{format_seconds(cost.seconds)}")
        if topology.num_chips <= DESCRIBE_MAX_PRINTED_RANKS:
            lines.append("ranks:")
            lines.extend("  " + line for line in str(self.rank_array).splitlines())
        return "\n".join([topology.describe(), *lines])


def mesh_layout(topology: Slice, mesh_shape: Sequence[int] | str, *,
                axis_names: Sequence[str] | str | None = None,
                allow_split_physical_axes: bool = False,
                contiguous_submeshes: bool = False) -> MeshLayout:
    """Lays `mesh_shape` onto `topology` with `jax.experimental.mesh_utils.create_device_mesh`.

    Args:
        topology: the slice.
        mesh_shape: mesh axis sizes (or "4x16"), ordered by increasing network intensity: the last
            axis gets the most physical axes. The product must be `topology.num_chips`.
        axis_names: one name per mesh axis (or "dp,tp"); defaults to "axis0", "axis1", ...
        allow_split_physical_axes: let a physical axis be shared by two mesh axes.
        contiguous_submeshes: make each host's chips a contiguous block of the mesh.

    Returns:
        The layout; `layout.rank_array` is what `Topology.create_mesh` returns.

    Raises:
        TopologyError: the mesh does not fit, in tpudist's terms (JAX's error is chained).

    Example:
        >>> mesh_layout(Topology.parse("v4:4x4x4"), (1, 16, 4)).physical_axes
        ((), (1, 2), (0,))
    """
    mesh_shape = _canonical_mesh_shape(mesh_shape)
    axis_names = _canonical_axis_names(axis_names, mesh_shape)
    if math.prod(mesh_shape) != topology.num_chips:
        raise TopologyError(
            f"mesh_shape={mesh_shape} has {math.prod(mesh_shape)} chips but topology {topology} "
            f"has {topology.num_chips}: the product of mesh_shape must equal num_chips; pass a "
            f"mesh_shape whose sizes multiply to {topology.num_chips}.")
    # Imported here: JAX takes a second to import and most users of tpudist.mesh never lay out.
    from jax.experimental import mesh_utils

    try:
        device_mesh = mesh_utils.create_device_mesh(
            mesh_shape, devices=_mock_devices(topology),
            contiguous_submeshes=contiguous_submeshes,
            allow_split_physical_axes=allow_split_physical_axes)
    except NotImplementedError as exc:  # JAX's "Failed to find assignment ..." without splitting
        raise TopologyError(
            f"mesh_shape={mesh_shape} does not fit topology {topology}: each mesh axis must be a "
            "product of physical axes; pass allow_split_physical_axes=True to split one.") from exc
    except ValueError as exc:
        if not contiguous_submeshes:
            raise
        raise TopologyError(
            f"contiguous_submeshes=True is not available for mesh_shape={mesh_shape} on topology "
            f"{topology}: JAX has per-host contiguous layouts only for some slice and mesh shapes "
            f"({exc}); pass contiguous_submeshes=False.") from exc
    rank_array = np.vectorize(operator.attrgetter("id"), otypes=[np.int64])(device_mesh)
    if contiguous_submeshes:
        _check_contiguous_hosts(topology, mesh_shape, rank_array)
    placements = [_physical_placement(topology, rank_array, axis)
                  for axis in range(len(mesh_shape))]
    return MeshLayout(topology, mesh_shape, axis_names, tuple(int(r) for r in rank_array.flat),
                      tuple(axes for axes, _ in placements),
                      tuple(sizes for _, sizes in placements))


def _mock_devices(topology: Slice) -> list[_MockTpuDevice]:
    kind = topology.generation_info.device_kind
    if topology.generation == "7x":
        kind = CHIP_LEVEL_7X_DEVICE_KIND
    devices = []
    for rank in range(topology.num_chips):
        coords = topology.coords(rank) + (0,) * (3 - topology.num_dims)
        devices.append(_MockTpuDevice(rank, topology.host_of(rank), coords, 0, kind))
    return devices


def _physical_placement(topology: Slice, rank_array: np.ndarray,
                        axis: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # The chips along `axis` with every other mesh index at 0.
    line = np.moveaxis(rank_array, axis, 0).reshape(rank_array.shape[axis], -1)[:, 0]
    coords = np.array([topology.coords(int(rank)) for rank in line])
    spans = [len(set(coords[:, p].tolist())) for p in range(topology.num_dims)]
    physical = tuple(p for p, span in enumerate(spans) if span > 1)
    return physical, tuple(spans[p] for p in physical)


def _check_contiguous_hosts(topology: Slice, mesh_shape: tuple[int, ...],
                            rank_array: np.ndarray) -> None:
    # JAX's device-kind handlers ignore contiguous_submeshes: check the promise, do not trust it.
    positions: dict[int, list[tuple[int, ...]]] = {}
    for position, rank in np.ndenumerate(rank_array):
        positions.setdefault(topology.host_of(int(rank)), []).append(position)
    for host, host_positions in positions.items():
        spans = [sorted({pos[axis] for pos in host_positions}) for axis in range(len(mesh_shape))]
        is_box = all(span == list(range(span[0], span[-1] + 1)) for span in spans)
        if not is_box or math.prod(len(span) for span in spans) != len(host_positions):
            raise TopologyError(
                f"contiguous_submeshes=True cannot be honoured for mesh_shape={mesh_shape} on "
                f"topology {topology}: host {host}'s chips do not form a contiguous block of the "
                "mesh; pass contiguous_submeshes=False or another mesh_shape.")


def _canonical_mesh_shape(mesh_shape: Sequence[int] | str) -> tuple[int, ...]:
    try:
        if isinstance(mesh_shape, str):
            if re.fullmatch(r"\d+(x\d+)*", mesh_shape.strip()) is None:
                raise TypeError
            sizes = tuple(int(size) for size in mesh_shape.strip().split("x"))
        else:
            if any(isinstance(size, bool) for size in mesh_shape):
                raise TypeError
            sizes = tuple(operator.index(size) for size in mesh_shape)
        if not sizes or min(sizes) < 1:
            raise TypeError
    except TypeError:
        raise TopologyError(
            f"mesh_shape={mesh_shape!r} is not a mesh shape: it must be one or more ints >= 1; "
            "pass e.g. (4, 16) or '4x16'.") from None
    return sizes


def _canonical_axis_names(axis_names: Sequence[str] | str | None,
                          mesh_shape: tuple[int, ...]) -> tuple[str, ...]:
    if axis_names is None:
        return tuple(f"axis{i}" for i in range(len(mesh_shape)))
    names = axis_names.split(",") if isinstance(axis_names, str) else list(axis_names)
    names = [name.strip() if isinstance(name, str) else name for name in names]
    if len(names) != len(mesh_shape) or not all(isinstance(n, str) and n for n in names):
        raise TopologyError(
            f"axis_names={axis_names!r} do not name the {len(mesh_shape)} axes of "
            f"mesh_shape={mesh_shape}: pass one non-empty name per mesh axis, e.g. "
            f"{tuple(f'axis{i}' for i in range(len(mesh_shape)))}.")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise TopologyError(
            f"axis_names={axis_names!r} repeat {', '.join(map(repr, duplicates))}: mesh axis names "
            "must be distinct; pass distinct names.")
    return tuple(names)

