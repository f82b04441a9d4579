"""Human-readable descriptions of a slice and of a mesh laid onto it."""

from __future__ import annotations

from tpudist.mesh.cost import PHYSICAL_AXIS_NAMES, format_seconds
from tpudist.mesh.generations import HOP_LATENCY_SECONDS
from tpudist.mesh.layout import MeshLayout
from tpudist.mesh.topology import Topology

# The array size used to give each mesh axis a concrete all-reduce time in descriptions.
DESCRIBE_ALL_REDUCE_BYTES = 2**20
# Rank arrays up to this many chips are printed in full.
DESCRIBE_MAX_PRINTED_RANKS = 64


def describe(target: Topology | MeshLayout) -> str:
    """Describes a slice, or a mesh layout on its slice, in a few lines.

    For a layout: which physical axes each mesh axis got, whether it is a ring with wraparound, how
    far apart its consecutive chips are, and the all-reduce time of 1 MiB over it.

    Example:
        >>> from tpudist.mesh import Topology
        >>> print(describe(Topology.parse("v4:2x2x1")).splitlines()[0])
        v4:2x2x1: TPU v4 slice of 4 chips (x=2, y=2, z=1), 3-D torus
    """
    if isinstance(target, MeshLayout):
        return "\n".join(_topology_lines(target.topology) + _layout_lines(target))
    if isinstance(target, Topology):
        return "\n".join(_topology_lines(target))
    raise TypeError(f"target={target!r} is not a Topology or MeshLayout: pass one of these.")


def _axes(topology: Topology, axes: tuple[int, ...]) -> str:
    return ", ".join(PHYSICAL_AXIS_NAMES[p] for p in axes)


def _topology_lines(topology: Topology) -> list[str]:
    info = topology.generation_info
    names = PHYSICAL_AXIS_NAMES[: topology.num_dims]
    sizes = ", ".join(f"{name}={size}" for name, size in zip(names, topology.shape))
    wrapped = tuple(p for p, wraps in enumerate(topology.wraparound) if wraps)
    if len(wrapped) == topology.num_dims:
        wrap = "on every axis"
    elif wrapped:
        wrap = f"on {_axes(topology, wrapped)} only"
    else:
        wrap = "on no axis"
    rule = ("slices of whole 4x4x4 cubes wrap" if info.wraps_by_cube
            else "axes of 16 chips wrap")
    host = "x".join(map(str, topology.host_shape))
    lines = [
        f"{topology}: {info.device_kind} slice of {topology.num_chips} chips ({sizes}), "
        f"{topology.num_dims}-D torus",
        f"  wraparound {wrap} ({rule})",
        f"  hosts: {topology.num_hosts} of up to {topology.chips_per_host} chips ({host}); ranks "
        "are host-major, x fastest within a host",
        f"  per chip: {info.hbm_bytes / 2**30:g} GiB HBM at {info.hbm_bytes_per_s:.3g} B/s, "
        f"{info.peak_bf16_flops:.3g} bf16 FLOP/s, {info.links_per_chip} ICI links of "
        f"{info.ici_one_way_bytes_per_s:.3g} B/s one-way, "
        f"~{HOP_LATENCY_SECONDS * 1e6:g} us per hop",
    ]
    if topology.devices_per_chip > 1:
        lines.append(
            f"  devices: {topology.devices_per_chip} per chip (TensorCores) on hardware; one rank "
            "per chip drives them, the CPU emulation gives it one device")
    return lines


def _layout_lines(layout: MeshLayout) -> list[str]:
    topology = layout.topology
    axes = ", ".join(f"{name}={size}" for name, size in zip(layout.axis_names, layout.mesh_shape))
    lines = [f"mesh ({axes}):"]
    width = max(len(name) for name in layout.axis_names)
    for index, (name, size) in enumerate(zip(layout.axis_names, layout.mesh_shape)):
        if size == 1:
            lines.append(f"  {name:<{width}} 1 chip")
            continue
        parts = []
        for p, span in zip(layout.physical_axes[index], layout.physical_sizes[index]):
            whole = span == topology.shape[p]
            parts.append(f"{PHYSICAL_AXIS_NAMES[p]}" + ("" if whole else f" ({span} of "
                                                         f"{topology.shape[p]})"))
        step, closing = layout.ring_hops(index)
        if layout.wraps(index):
            shape = "ring with wraparound"
        elif closing <= 1:
            shape = "ring"
        else:
            shape = f"no wraparound, {closing} hops back"
        cost = layout.collective_cost("all_reduce", DESCRIBE_ALL_REDUCE_BYTES, index)
        lines.append(
            f"  {name:<{width}} {size} chips on {', '.join(parts)}: {shape}; neighbours "
            f"{step} hop{'s' if step != 1 else ''} apart; all_reduce of 1 MiB "
            f"{format_seconds(cost.seconds)}")
    if topology.num_chips <= DESCRIBE_MAX_PRINTED_RANKS:
        lines.append("ranks:")
        lines.extend("  " + line for line in str(layout.rank_array).splitlines())
    return lines
