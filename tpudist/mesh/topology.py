"""A TPU slice as data: its chips, their coordinates and ranks, hosts, wraparound and links.

Rank order is host-major, as TPU runtimes number processes: ranks 0..chips_per_host-1 are host 0's
chips, hosts are ordered by their position in the slice (x fastest, then y, then z), and within a
host chips go x fastest. That is the order of `jax.devices()` on a multi-host slice (JAX's
multi-controller guide lists a v5litepod-16 that way; JAX's `tests/mesh_utils_test.py` mocks v4
hosts with the same process numbering).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tpudist.mesh._errors import TopologyError
from tpudist.mesh.cost import (
    PHYSICAL_AXIS_NAMES, CollectiveCost, RingAxis, estimate_collective)
from tpudist.mesh.generations import (
    CUBE_SIZE, GENERATION_NAMES, GENERATIONS, HOP_LATENCY_SECONDS, HOST_SHAPE_2D_MULTI_HOST,
    HOST_SHAPE_3D, PART_OF_HOST_3D_SHAPES, PUBLISHED_2D_SHAPES, PUBLISHED_3D_SUB_CUBE_SHAPES,
    SINGLE_HOST_MAX_CHIPS_2D, WRAP_AXIS_SIZE_2D, Generation)
from tpudist.mesh.layout import MeshLayout, mesh_layout

if TYPE_CHECKING:
    import numpy as np

_GENERATION_ALIASES = {"tpu7x": "7x", "v7x": "7x"}


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """A TPU slice: a generation and the number of chips along each physical axis (x, y[, z]).

    Shapes are checked per generation against what Google offers: v4, v5p and 7x slices are 3-D,
    2x2x1, 2x2x2, 2x2x4 or 2x4x4 (in any axis order) or whole 4x4x4 cubes (every size a multiple
    of 4), up to a pod; 1x1x1 and 2x1x1 (any order) stand for one or two chips of a single host,
    the only topology a 1- or 2-rank world has. v5e and v6e slices are 2-D and one of Google's
    published shapes (1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16), in either orientation.

    For 7x each chip has two TensorCores, which JAX shows as two devices (`devices_per_chip == 2`).
    tpudist runs one rank per chip: on hardware that rank's process drives both devices of its chip;
    the CPU emulation gives it one device standing for the chip. Coordinates, layouts and costs are
    per chip.

    Attributes:
        generation: "v4", "v5e", "v5p", "v6e" or "7x".
        shape: chips along x, y (and z).

    Example:
        >>> topology = Topology.parse("v5p:4x4x4")
        >>> topology.num_chips, topology.num_hosts, topology.wraparound
        (64, 16, (True, True, True))
        >>> topology.coords(2), topology.rank_of((2, 0, 0)), str(topology)
        ((0, 1, 0), 4, 'v5p:4x4x4')
    """

    generation: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        generation = _canonical_generation(self.generation)
        shape = _canonical_shape(self.shape)
        _check_shape(GENERATIONS[generation], shape)
        object.__setattr__(self, "generation", generation)
        object.__setattr__(self, "shape", shape)

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Reads "<generation>:<shape>", e.g. "v5p:4x4x4" or "v5e:2x4".

        "<generation>:<num_chips>" (e.g. "v5p:8") means `smallest_for(num_chips, generation)`.

        Example:
            >>> Topology.parse("v5e:2x4")
            Topology(generation='v5e', shape=(2, 4))
            >>> str(Topology.parse("v5p:8"))
            'v5p:2x2x2'
        """
        match = re.fullmatch(r"\s*([^:\s]+)\s*:\s*([0-9x]+)\s*", str(text))
        if match is None:
            raise TopologyError(
                f"topology={text!r} is not of the form '<generation>:<shape>': expected e.g. "
                f"'v5p:4x4x4' or 'v5e:2x4', with generation one of {', '.join(GENERATION_NAMES)}; "
                "pass a string of that form.")
        generation, shape = match.groups()
        if "x" not in shape:
            return cls.smallest_for(int(shape), generation)
        return cls(generation, shape)

    @classmethod
    def smallest_for(cls, num_chips: int, generation: str = "v5p") -> Topology:
        """The smallest valid slice holding at least `num_chips` chips.

        Used for the emulated world when TPUDIST_TOPOLOGY is unset. 3-D generations: fewest chips,
        then fewest hosts (2x2x1 each), then whole 4x4x4 cubes (wraparound), then the most
        cube-like, then Google's x <= y <= z naming, then x before y before z: 1 -> 1x1x1,
        2 -> 2x1x1 (part of one host), 3-4 -> 2x2x1, 5-8 -> 2x2x2, 9-16 -> 2x2x4, 17-32 -> 2x4x4,
        33-64 -> 4x4x4, 65-128 -> 4x4x8. 2-D generations:
        the smallest published shape, x the longer axis (the 8-chip host tray is 4 chips along x:
        the scaling book's host size 4x2, and the tray ring order of JAX's mesh_utils assumes it):
        8 -> 4x2.

        Example:
            >>> str(Topology.smallest_for(4)), str(Topology.smallest_for(8, "v5e"))
            ('v5p:2x2x1', 'v5e:4x2')
        """
        info = GENERATIONS[_canonical_generation(generation)]
        if isinstance(num_chips, bool) or not hasattr(num_chips, "__index__") or num_chips < 1:
            raise TopologyError(
                f"num_chips={num_chips!r} is not a chip count: it must be an int >= 1; pass the "
                "number of chips (processes) to hold.")
        num_chips = operator.index(num_chips)
        if num_chips > info.pod_chips:
            raise TopologyError(
                f"num_chips={num_chips} does not fit any {info.name} slice: a {info.name} pod has "
                f"{info.pod_chips} chips; pass at most {info.pod_chips} chips or another "
                "generation.")
        if info.num_dims == 2:
            fitting = [s for s in PUBLISHED_2D_SHAPES if math.prod(s) >= num_chips]
            return cls(info.name, tuple(sorted(min(fitting, key=math.prod), reverse=True)))
        for total in range(num_chips, info.pod_chips + 1):
            candidates = [shape for shape in _factorizations_3d(total) if _valid_3d_shape(shape)]
            if candidates:
                return cls(info.name, min(candidates, key=_smallest_for_preference))
        raise AssertionError(f"no {info.name} slice for {num_chips} chips")  # pod_chips is one

    def __str__(self) -> str:
        return f"{self.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def generation_info(self) -> Generation:
        """Per-generation constants (links, bandwidths, memory, FLOP/s)."""
        return GENERATIONS[self.generation]

    @property
    def num_dims(self) -> int:
        """Physical axes: 3 for v4, v5p and 7x; 2 for v5e and v6e."""
        return len(self.shape)

    @property
    def num_chips(self) -> int:
        """Chips in the slice; one rank each."""
        return math.prod(self.shape)

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip on hardware: 2 for 7x (one per TensorCore), 1 otherwise."""
        return self.generation_info.devices_per_chip

    @property
    def num_devices(self) -> int:
        """JAX devices of the slice on hardware."""
        return self.num_chips * self.devices_per_chip

    @property
    def wraparound(self) -> tuple[bool, ...]:
        """Per physical axis, whether a wraparound link closes it into a ring.

        v4/v5p/7x: all axes wrap when the slice is made of whole 4x4x4 cubes (every size a multiple
        of 4), none otherwise. v5e/v6e: only axes of 16 chips wrap.
        """
        if self.generation_info.wraps_by_cube:
            cubes = all(size % CUBE_SIZE == 0 for size in self.shape)
            return (cubes,) * self.num_dims
        return tuple(size == WRAP_AXIS_SIZE_2D for size in self.shape)

    @property
    def host_shape(self) -> tuple[int, ...]:
        """Chips of one host along each axis (hosts at the far edge of a slice may hold fewer)."""
        return _host_shape(self.generation_info, self.shape)

    @property
    def chips_per_host(self) -> int:
        """Chips of one (full) host: 4 (2x2x1) on v4/v5p/7x; on v5e/v6e the whole slice up to 8
        chips, else 4 (2x2)."""
        return math.prod(self.host_shape)

    @property
    def num_hosts(self) -> int:
        """Hosts (one process each on hardware) in the slice."""
        return math.prod(_host_grid(self.shape, self.host_shape))

    def coords(self, rank: int) -> tuple[int, ...]:
        """Chip coordinates (x, y[, z]) of `rank`.

        Example:
            >>> Topology.parse("v4:4x4x4").coords(4)
            (2, 0, 0)
        """
        return _chip_tables(self).coords[self._check_rank(rank, "rank")]

    def rank_of(self, coords: Sequence[int]) -> int:
        """The rank of the chip at `coords`; the inverse of `coords`.

        Example:
            >>> Topology.parse("v4:4x4x4").rank_of((2, 0, 0))
            4
        """
        return _chip_tables(self).rank_by_coords[self._check_coords(coords)]

    def host_of(self, rank: int) -> int:
        """The host (process index on hardware) that holds `rank`'s chip.

        Example:
            >>> Topology.parse("v5p:4x4x4").host_of(5)
            1
        """
        return _chip_tables(self).host_by_rank[self._check_rank(rank, "rank")]

    def hops(self, rank_a: int, rank_b: int) -> int:
        """ICI hops on the shortest path between two chips, using wrap links only where they exist.

        Example:
            >>> cube, line = Topology.parse("v4:4x4x4"), Topology.parse("v4:2x2x4")
            >>> cube.hops(0, cube.rank_of((3, 0, 0))), line.hops(0, line.rank_of((0, 0, 3)))
            (1, 3)
        """
        coords_a = self.coords(self._check_rank(rank_a, "rank_a"))
        coords_b = self.coords(self._check_rank(rank_b, "rank_b"))
        total = 0
        for a, b, size, wraps in zip(coords_a, coords_b, self.shape, self.wraparound):
            distance = abs(a - b)
            total += min(distance, size - distance) if wraps else distance
        return total

    def collective_cost(self, op: str, nbytes: int,
                        physical_axes: int | str | Sequence[int | str]) -> CollectiveCost:
        """Estimates a collective over whole physical axes; see `tpudist.mesh.cost` for the model.

        Args:
            op: "all_gather", "reduce_scatter", "all_reduce", "all_to_all" or "permute".
            nbytes: size of the full (gathered / unreduced) array in bytes.
            physical_axes: axes by index (0 is x) or name ("x", "y", "z"); several axes at once
                share the bandwidth term.

        Example:
            >>> cost = Topology.parse("v4:4x4x4").collective_cost("all_gather", 8 * 2**20, "yz")
            >>> round(cost.seconds * 1e6, 2), cost.group_size
            (43.69, 16)
        """
        axes = self._check_physical_axes(physical_axes)
        rings = [RingAxis(axis, self.shape[axis], self.wraparound[axis]) for axis in axes]
        group_size = math.prod(self.shape[axis] for axis in axes)
        return estimate_collective(self.generation_info, op, nbytes, group_size, rings)

    def collective_seconds(self, op: str, nbytes: int,
                           physical_axes: int | str | Sequence[int | str]) -> float:
        """`collective_cost(...).seconds`.

        Example:
            >>> topology = Topology.parse("v4:4x4x4")
            >>> round(topology.collective_seconds("all_reduce", 2**20, 0) * 1e6, 2)
            17.48
        """
        return self.collective_cost(op, nbytes, physical_axes).seconds

    def mesh_layout(self, mesh_shape: Sequence[int] | str, *,
                    axis_names: Sequence[str] | None = None,
                    allow_split_physical_axes: bool = False,
                    contiguous_submeshes: bool = False) -> MeshLayout:
        """Lays a logical mesh onto the slice with JAX's algorithm; see `tpudist.mesh.layout`.

        Example:
            >>> Topology.parse("v4:4x4x4").mesh_layout((1, 16, 4)).physical_axes
            ((), (1, 2), (0,))
        """
        return mesh_layout(self, mesh_shape, axis_names=axis_names,
                           allow_split_physical_axes=allow_split_physical_axes,
                           contiguous_submeshes=contiguous_submeshes)

    def create_mesh(self, mesh_shape: Sequence[int] | str, *,
                    allow_split_physical_axes: bool = False,
                    contiguous_submeshes: bool = False) -> np.ndarray:
        """Integer array of ranks shaped `mesh_shape`, each mesh axis following torus rings.

        Mesh axes are ordered by increasing network intensity (the last axis gets the best rings),
        as in `jax.experimental.mesh_utils.create_device_mesh`.

        Example:
            >>> Topology.parse("v4:2x2x1").create_mesh((2, 2)).tolist()
            [[0, 1], [2, 3]]
        """
        return self.mesh_layout(mesh_shape, allow_split_physical_axes=allow_split_physical_axes,
                                contiguous_submeshes=contiguous_submeshes).rank_array

    def describe(self) -> str:
        """A few lines on the slice: chips, axes and wraparound, hosts, per-chip figures.

        Example:
            >>> print(Topology.parse("v4:2x2x1").describe().splitlines()[0])
            v4:2x2x1: TPU v4 slice of 4 chips (x=2, y=2, z=1), 3-D torus
        """
        info = self.generation_info
        names = PHYSICAL_AXIS_NAMES[: self.num_dims]
        sizes = ", ".join(f"{name}={size}" for name, size in zip(names, self.shape))
        wrapped = tuple(p for p, wraps in enumerate(self.wraparound) if wraps)
        if len(wrapped) == self.num_dims:
            wrap = "on every axis"
        elif wrapped:
            wrap = f"on {', '.join(PHYSICAL_AXIS_NAMES[p] for p in wrapped)} only"
        else:
            wrap = "on no axis"
        rule = ("slices of whole 4x4x4 cubes wrap" if info.wraps_by_cube
                else "axes of 16 chips wrap")
        host = "x".join(map(str, self.host_shape))
        lines = [
            f"{self}: {info.device_kind} slice of {self.num_chips} chips ({sizes}), "
            f"{self.num_dims}-D torus",
            f"  wraparound {wrap} ({rule})",
            f"  hosts: {self.num_hosts} of up to {self.chips_per_host} chips ({host}); ranks "
            "are host-major, x fastest within a host",
            f"  per chip: {info.hbm_bytes / 2**30:g} GiB HBM at {info.hbm_bytes_per_s:.3g} B/s, "
            f"{info.peak_bf16_flops:.3g} bf16 FLOP/s, {info.links_per_chip} ICI links of "
            f"{info.ici_one_way_bytes_per_s:.3g} B/s one-way, "
            f"~{HOP_LATENCY_SECONDS * 1e6:g} us per hop",
        ]
        if self.devices_per_chip > 1:
            lines.append(
                f"  devices: {self.devices_per_chip} per chip (TensorCores) on hardware; one rank "
                "per chip drives them, the CPU emulation gives it one device")
        return "\n".join(lines)

    def _check_rank(self, rank: int, name: str) -> int:
        if isinstance(rank, bool) or not hasattr(rank, "__index__"):
            raise TopologyError(
                f"{name}={rank!r} is not an int: ranks of topology {self} are ints from 0 to "
                f"{self.num_chips - 1}; pass an int.")
        rank = operator.index(rank)
        if not 0 <= rank < self.num_chips:
            raise TopologyError(
                f"{name}={rank} is out of range for topology {self}: ranks run from 0 to "
                f"{self.num_chips - 1}; pass a rank below num_chips={self.num_chips}.")
        return rank

    def _check_coords(self, coords: Sequence[int]) -> tuple[int, ...]:
        names = ", ".join(PHYSICAL_AXIS_NAMES[: self.num_dims])
        try:
            values = tuple(operator.index(c) for c in coords)
        except TypeError:
            values = None
        if values is None or len(values) != self.num_dims:
            raise TopologyError(
                f"coords={coords!r} are not {self.num_dims} ints: topology {self} is "
                f"{self.num_dims}-D; pass one int per physical axis ({names}).")
        for name, value, size in zip(PHYSICAL_AXIS_NAMES, values, self.shape):
            if not 0 <= value < size:
                raise TopologyError(
                    f"coords={values} are outside topology {self}: {name} must be in [0, {size}); "
                    f"pass coordinates within shape={self.shape}.")
        return values

    def _check_physical_axes(self,
                             physical_axes: int | str | Sequence[int | str]) -> tuple[int, ...]:
        names = PHYSICAL_AXIS_NAMES[: self.num_dims]
        if isinstance(physical_axes, str):
            items: list = list(physical_axes)
        elif hasattr(physical_axes, "__index__"):
            items = [physical_axes]
        else:
            items = list(physical_axes)
        axes: list[int] = []
        for item in items:
            if isinstance(item, str) and item in names:
                axis = names.index(item)
            elif not isinstance(item, (bool, str)) and hasattr(item, "__index__"):
                axis = operator.index(item)
            else:
                axis = -1
            if not 0 <= axis < self.num_dims:
                raise TopologyError(
                    f"physical_axes={physical_axes!r} names axis {item!r}, which topology {self} "
                    f"does not have: its axes are 0..{self.num_dims - 1} ({', '.join(names)}); "
                    "pass axes among these.")
            if axis in axes:
                raise TopologyError(
                    f"physical_axes={physical_axes!r} names axis {names[axis]} twice: each "
                    "physical axis can be used once; pass distinct axes.")
            axes.append(axis)
        return tuple(axes)


def _canonical_generation(generation: str) -> str:
    name = str(generation).strip().lower()
    name = _GENERATION_ALIASES.get(name, name)
    if name not in GENERATIONS:
        raise TopologyError(
            f"generation={generation!r} is not a TPU generation tpudist knows: the generations are "
            f"{', '.join(GENERATION_NAMES)}; pass one of these.")
    return name


def _canonical_shape(shape: Sequence[int] | str) -> tuple[int, ...]:
    if isinstance(shape, str):
        if re.fullmatch(r"\d+(x\d+)*", shape.strip()) is None:
            raise TopologyError(
                f"shape={shape!r} is not a slice shape: it must be sizes joined by 'x' (e.g. "
                "'4x4x4') or a tuple of ints; pass e.g. (4, 4, 4).")
        return tuple(int(size) for size in shape.strip().split("x"))
    try:
        if any(isinstance(size, bool) for size in shape):
            raise TypeError
        return tuple(operator.index(size) for size in shape)
    except TypeError:
        raise TopologyError(
            f"shape={shape!r} is not a slice shape: it must be sizes joined by 'x' (e.g. '4x4x4') "
            "or a tuple of ints; pass e.g. (4, 4, 4).") from None


def _check_shape(info: Generation, shape: tuple[int, ...]) -> None:
    example = "2x2x1" if info.num_dims == 3 else "2x4"
    if len(shape) != info.num_dims:
        raise TopologyError(
            f"shape={shape} has {len(shape)} axes but {info.name} slices are {info.num_dims}-D: "
            f"pass {info.num_dims} sizes, e.g. '{info.name}:{example}'.")
    if min(shape) < 1:
        raise TopologyError(
            f"shape={shape} has a size below 1: every axis holds at least one chip; pass positive "
            "sizes.")
    if info.num_dims == 3:
        if not _valid_3d_shape(shape):
            _refuse_3d(info, shape)
    elif tuple(sorted(shape)) not in PUBLISHED_2D_SHAPES:
        published = ", ".join("x".join(map(str, s)) for s in PUBLISHED_2D_SHAPES)
        fitting = [s for s in PUBLISHED_2D_SHAPES if math.prod(s) >= math.prod(shape)]
        hint = f", e.g. '{info.name}:{'x'.join(map(str, fitting[0]))}'" if fitting else ""
        raise TopologyError(
            f"shape={shape} is not a published {info.name} slice: {info.name} slices are "
            f"{published} (either orientation); pass one of these{hint}.")
    if math.prod(shape) > info.pod_chips:
        raise TopologyError(
            f"shape={shape} has {math.prod(shape)} chips, more than a {info.name} pod "
            f"({info.pod_chips}): a slice lives in one pod; pass a smaller shape.")


def _refuse_3d(info: Generation, shape: tuple[int, ...]) -> None:
    nearest = _nearest_3d(info, shape)
    names = " or ".join(f"{_name(s)} ({math.prod(s)} chips)" for s in nearest)
    raise TopologyError(
        f"shape={shape} is not a {info.name} slice: {info.name} slices are 2x2x1, 2x2x2, 2x2x4, "
        f"2x4x4 (any order) or whole 4x4x4 cubes, every size a multiple of 4 (4x4x4, 4x4x8, ...), "
        f"up to {info.pod_chips} chips; 1x1x1 and 2x1x1 (any order) are one or two chips of a host. "
        f"The nearest are {names}: pass one of these, e.g. '{info.name}:{_name(nearest[-1])}'.")


def _valid_3d_shape(shape: Sequence[int]) -> bool:
    canonical = tuple(sorted(shape))
    return (canonical in PUBLISHED_3D_SUB_CUBE_SHAPES or canonical in PART_OF_HOST_3D_SHAPES
            or all(size % CUBE_SIZE == 0 for size in shape))


def _name(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


@functools.lru_cache(maxsize=256)
def _nearest_3d(info: Generation, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The valid slices closest to ``shape`` in chip count: the largest with fewer chips and the
    smallest with at least as many (ties: closest sizes), each in ``shape``'s axis order."""
    order = sorted(range(3), key=lambda axis: shape[axis])  # rank of each axis by its size

    def oriented(canonical: tuple[int, ...]) -> tuple[int, ...]:
        out = [0, 0, 0]
        for size, axis in zip(canonical, order):
            out[axis] = size
        return tuple(out)

    num_cubes_max = info.pod_chips // CUBE_SIZE**3
    cubes = [(a * CUBE_SIZE, b * CUBE_SIZE, c * CUBE_SIZE)
             for a in range(1, num_cubes_max + 1) for b in range(a, num_cubes_max // a + 1)
             for c in range(b, num_cubes_max // (a * b) + 1)]
    valid = [s for s in (*PART_OF_HOST_3D_SHAPES, *PUBLISHED_3D_SUB_CUBE_SHAPES, *cubes)
             if math.prod(s) <= info.pod_chips]
    want, sizes = math.prod(shape), sorted(shape)

    def closeness(s):
        return sum(abs(a - b) for a, b in zip(s, sizes))

    below = [s for s in valid if math.prod(s) < want]
    above = [s for s in valid if math.prod(s) >= want]
    picks = []
    if below:
        most = max(math.prod(s) for s in below)
        picks.append(min((s for s in below if math.prod(s) == most), key=closeness))
    if above:
        least = min(math.prod(s) for s in above)
        picks.append(min((s for s in above if math.prod(s) == least), key=closeness))
    return tuple(oriented(s) for s in picks)


def _factorizations_3d(total: int) -> Iterator[tuple[int, int, int]]:
    for x in range(1, total + 1):
        if total % x == 0:
            for y in range(1, total // x + 1):
                if (total // x) % y == 0:
                    yield x, y, total // x // y


def _smallest_for_preference(shape: tuple[int, int, int]) -> tuple:
    x, y, z = shape
    host_shape = [min(b, size) for b, size in zip(HOST_SHAPE_3D, shape)]
    num_hosts = math.prod(_host_grid(shape, host_shape))
    whole_cubes = all(size % CUBE_SIZE == 0 for size in shape)
    return num_hosts, not whole_cubes, max(shape), not x <= y <= z, (z, y, x)


def _host_shape(info: Generation, shape: tuple[int, ...]) -> tuple[int, ...]:
    if info.num_dims == 2 and math.prod(shape) <= SINGLE_HOST_MAX_CHIPS_2D:
        return shape
    block = HOST_SHAPE_3D if info.num_dims == 3 else HOST_SHAPE_2D_MULTI_HOST
    return tuple(min(b, size) for b, size in zip(block, shape))


def _host_grid(shape: Sequence[int], host_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-size // h) for size, h in zip(shape, host_shape))


def _x_fastest(extent: Sequence[int]) -> Iterator[tuple[int, ...]]:
    for reversed_index in itertools.product(*(range(n) for n in reversed(extent))):
        yield tuple(reversed(reversed_index))


@dataclasses.dataclass(frozen=True)
class _ChipTables:
    coords: tuple[tuple[int, ...], ...]
    rank_by_coords: dict[tuple[int, ...], int]
    host_by_rank: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def _chip_tables(topology: Topology) -> _ChipTables:
    host_shape = topology.host_shape
    coords: list[tuple[int, ...]] = []
    hosts: list[int] = []
    for host, host_position in enumerate(_x_fastest(_host_grid(topology.shape, host_shape))):
        origin = [p * h for p, h in zip(host_position, host_shape)]
        extent = [min(h, size - o) for h, size, o in zip(host_shape, topology.shape, origin)]
        for local in _x_fastest(extent):
            coords.append(tuple(o + c for o, c in zip(origin, local)))
            hosts.append(host)
    return _ChipTables(tuple(coords), {c: r for r, c in enumerate(coords)}, tuple(hosts))
