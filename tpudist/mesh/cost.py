"""Collective time estimates on TPU ICI rings, after the JAX scaling book.

The model is that of "How to Scale Your Model", part 3 "Sharded matrices"
(https://jax-ml.github.io/scaling-book/sharding/), with link figures from part 2 (see
`generations.py`). `nbytes` is always the size of the full array: gathered for all_gather, unreduced
for reduce_scatter and all_reduce, the whole array for all_to_all and permute.

=============== =========================================== ===============================
op              bandwidth term                              hops (latency = hops x ~1 us)
=============== =========================================== ===============================
all_gather      V (X-1)/X / W                               sum over axes of ring steps
reduce_scatter  same as all_gather                          same as all_gather
all_reduce      2 x all_gather                              2 x all_gather
all_to_all      V floor(X/2) ceil(X/2) / X^2 / W (~V/4W)    same as all_gather
permute         (V/X) / W_one_way (one link, one way)       1, or n-1 to close a line
=============== =========================================== ===============================

X is the number of chips in the group and W the bandwidth into one chip: the sum over the physical
axes used of W_bidi (2 x one-way link bandwidth) for an axis with wraparound, W_one_way for one
without. That gives the book's rules: a bidirectional ring on a wrapped axis, twice the time on an
axis without wraparound (the end chips have one link), several axes at once divide the bandwidth
term by their number. Ring steps are floor(n/2) on a wrapped axis of n chips and n-1 without; the
book's "sum |X_i| / 2" is the length of the longest path. The time is max(latency, bandwidth).

The book writes T = V / W for an all-gather; we keep the exact (X-1)/X ring factor (each chip
receives all shards but its own), so our figures are the book's times (X-1)/X. For all_to_all the
factor floor(X/2) ceil(X/2) / X^2 is exactly the book's 1/4 for even rings (its footnote counts
N^2/4 chunks of V/N^2 per chip); on a line the middle link carries the same V/4 one way.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

from tpudist.mesh._errors import TopologyError
from tpudist.mesh.generations import HOP_LATENCY_SECONDS, Generation

PHYSICAL_AXIS_NAMES = ("x", "y", "z")


@dataclasses.dataclass(frozen=True, slots=True)
class RingAxis:
    """One physical axis as a collective uses it.

    Attributes:
        axis: the physical axis (0 is x).
        size: chips along it that take part (the whole axis, or a part of it).
        wraps: whether a wraparound link closes the ring.
    """

    axis: int
    size: int
    wraps: bool

    def __str__(self) -> str:
        name = PHYSICAL_AXIS_NAMES[self.axis]
        return f"{name}={self.size}{'' if self.wraps else ' (no wrap)'}"


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveCost:
    """The estimated time of one collective, with the terms it came from.

    Attributes:
        op: "all_gather", "reduce_scatter", "all_reduce", "all_to_all" or "permute".
        nbytes: size of the full array.
        group_size: chips taking part.
        rings: the physical axes used.
        hops: hops on the longest path the op walks.
        latency_seconds: hops x ~1 us.
        bandwidth_seconds: bytes over the links into one chip.

    Example:
        >>> from tpudist.mesh import Topology
        >>> cost = Topology.parse("v4:4x4x4").collective_cost("all_gather", 2**21, (0,))
        >>> round(cost.seconds * 1e6, 2), cost.bound
        (17.48, 'bandwidth')
    """

    op: str
    nbytes: int
    group_size: int
    rings: tuple[RingAxis, ...]
    hops: int
    latency_seconds: float
    bandwidth_seconds: float

    @property
    def seconds(self) -> float:
        """max(latency term, bandwidth term)."""
        return max(self.latency_seconds, self.bandwidth_seconds)

    @property
    def bound(self) -> str:
        """"latency" or "bandwidth": the term that decides `seconds`."""
        return "latency" if self.latency_seconds > self.bandwidth_seconds else "bandwidth"

    def __str__(self) -> str:
        axes = ", ".join(str(ring) for ring in self.rings) or "no axis"
        return (f"{self.op} of {self.nbytes:,} B over {axes} ({self.group_size} chips): "
                f"{format_seconds(self.seconds)}, {self.bound}-bound")


def format_seconds(seconds: float) -> str:
    """Short human form: "17.5 us", "3.20 ms", "1.50 s"."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def _ring_steps(ring: RingAxis) -> int:
    return ring.size // 2 if ring.wraps else ring.size - 1


def _bandwidth_into_chip(rings: Sequence[RingAxis], generation: Generation) -> float:
    return sum(generation.ici_bidi_bytes_per_s if ring.wraps else generation.ici_one_way_bytes_per_s
               for ring in rings if ring.size > 1)


def _all_gather(nbytes: int, group_size: int, rings: Sequence[RingAxis],
                generation: Generation) -> tuple[int, float]:
    hops = sum(_ring_steps(ring) for ring in rings)
    received = nbytes * (group_size - 1) / group_size
    return hops, received / _bandwidth_into_chip(rings, generation)


def _all_reduce(nbytes: int, group_size: int, rings: Sequence[RingAxis],
                generation: Generation) -> tuple[int, float]:
    # [BOOK] an all-reduce is a reduce-scatter followed by an all-gather.
    hops, seconds = _all_gather(nbytes, group_size, rings, generation)
    return 2 * hops, 2 * seconds


def _all_to_all(nbytes: int, group_size: int, rings: Sequence[RingAxis],
                generation: Generation) -> tuple[int, float]:
    hops = sum(_ring_steps(ring) for ring in rings)
    half_down, half_up = group_size // 2, (group_size + 1) // 2
    carried = nbytes * half_down * half_up / group_size**2
    return hops, carried / _bandwidth_into_chip(rings, generation)


def _permute(nbytes: int, group_size: int, rings: Sequence[RingAxis],
             generation: Generation) -> tuple[int, float]:
    # A cyclic shift by one: each chip sends its shard over one link, one way. Without wraparound
    # the message that closes the ring walks back along the line (on otherwise idle links).
    hops = max(1 if ring.wraps or ring.size <= 2 else ring.size - 1
               for ring in rings if ring.size > 1)
    return hops, nbytes / group_size / generation.ici_one_way_bytes_per_s


_COST_MODELS: dict[str, Callable[[int, int, Sequence[RingAxis], Generation], tuple[int, float]]] = {
    "all_gather": _all_gather,
    "reduce_scatter": _all_gather,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "permute": _permute,
}

COLLECTIVE_OPS = tuple(_COST_MODELS)


def estimate_collective(generation: Generation, op: str, nbytes: int, group_size: int,
                        rings: Sequence[RingAxis]) -> CollectiveCost:
    """Estimates one collective over `group_size` chips laid on `rings`.

    `Topology.collective_cost` and `MeshLayout.collective_cost` are the public entry points; they
    work out the rings. A group of one chip costs nothing.

    Example:
        >>> from tpudist.mesh.generations import GENERATIONS
        >>> cost = estimate_collective(GENERATIONS["v4"], "all_reduce", 2**20, 4,
        ...                            [RingAxis(axis=0, size=4, wraps=True)])
        >>> round(cost.seconds * 1e6, 2)
        17.48
    """
    if op not in _COST_MODELS:
        raise TopologyError(
            f"op={op!r} is not a collective tpudist.mesh can cost: the ops are "
            f"{', '.join(COLLECTIVE_OPS)}; pass one of these.")
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TopologyError(
            f"nbytes={nbytes!r} is not a byte count: it must be an int >= 0; pass the size in "
            "bytes of the full (gathered or unreduced) array.")
    nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise TopologyError(
            f"nbytes={nbytes} is negative: it must be an int >= 0; pass the size in bytes of the "
            "full (gathered or unreduced) array.")
    rings = tuple(rings)
    assert group_size == 1 or any(ring.size > 1 for ring in rings), (group_size, rings)
    if group_size == 1:
        return CollectiveCost(op, nbytes, 1, rings, 0, 0.0, 0.0)
    hops, bandwidth_seconds = _COST_MODELS[op](nbytes, group_size, rings, generation)
    return CollectiveCost(op, nbytes, group_size, rings, hops, hops * HOP_LATENCY_SECONDS,
                          bandwidth_seconds)
