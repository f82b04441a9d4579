"""A picture of a mesh laid onto a slice: one panel per z-plane, chips coloured by a mesh axis.

matplotlib is an optional extra (`pip install tpudist[plot]`); it is imported on use, without pyplot
and without touching matplotlib's global backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from tpudist.mesh.topology import Topology

# Chips per panel above which rank labels are left out (they would not be legible).
PLOT_MAX_LABELLED_CHIPS = 256
PLOT_INCHES_PER_CHIP = 0.55


def plot_mesh(topology: Topology, mesh_shape: Sequence[int] | str,
              axis_names: Sequence[str] | str | None, path: str | os.PathLike, *,
              color_axis: int | str | None = None,
              allow_split_physical_axes: bool = False) -> str:
    """Writes a PNG of `mesh_shape` laid onto `topology`.

    Each chip is a square at its (x, y) position, one panel per z-plane side by side (2-D slices
    have one panel), labelled with its rank and mesh position and coloured by its index along
    `color_axis` (default: the last mesh axis, the most network-intensive, e.g. "tp").

    Args:
        topology: the slice.
        mesh_shape: mesh axis sizes, as for `Topology.mesh_layout`.
        axis_names: one name per mesh axis, or None for "axis0", ...
        path: where to write the PNG.
        color_axis: mesh axis (name or index) whose index colours the chips.
        allow_split_physical_axes: as for `Topology.mesh_layout`.

    Returns:
        `path` as a str.

    Raises:
        ImportError: matplotlib is not installed.

    Example:
        >>> topology = Topology.parse("v5p:2x2x2")
        >>> plot_mesh(topology, (2, 4), ("dp", "tp"), "mesh.png")  # doctest: +SKIP
        'mesh.png'
    """
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as exc:
        raise ImportError(
            "plot_mesh needs matplotlib, which is not installed: install the plot extra "
            "(pip install 'tpudist[plot]') or matplotlib itself.") from exc

    layout = topology.mesh_layout(mesh_shape, axis_names=axis_names,
                                  allow_split_physical_axes=allow_split_physical_axes)
    last_axis = len(layout.mesh_shape) - 1
    colour_index = layout.axis_index(last_axis if color_axis is None else color_axis)
    positions = {int(rank): position for position, rank in np.ndenumerate(layout.rank_array)}
    size_x, size_y = topology.shape[0], topology.shape[1]
    num_planes = topology.shape[2] if topology.num_dims == 3 else 1

    figure = Figure(figsize=(max(3.0, PLOT_INCHES_PER_CHIP * (size_x + 1) * num_planes),
                             max(3.0, PLOT_INCHES_PER_CHIP * (size_y + 2))),
                    layout="constrained")
    FigureCanvasAgg(figure)
    cmap = colormaps["viridis"].resampled(max(layout.mesh_shape[colour_index], 2))
    label = size_x * size_y <= PLOT_MAX_LABELLED_CHIPS
    for plane in range(num_planes):
        axes = figure.add_subplot(1, num_planes, plane + 1)
        for rank in range(topology.num_chips):
            coords = topology.coords(rank)
            if topology.num_dims == 3 and coords[2] != plane:
                continue
            position = positions[rank]
            colour = cmap(position[colour_index])
            axes.add_patch(Rectangle((coords[0] - 0.45, coords[1] - 0.45), 0.9, 0.9,
                                     facecolor=colour, edgecolor="black", linewidth=0.5))
            if label:
                axes.text(coords[0], coords[1], f"{rank}\n{','.join(map(str, position))}",
                          ha="center", va="center", fontsize=6,
                          color="white" if position[colour_index] < cmap.N / 2 else "black")
        axes.set_xlim(-0.6, size_x - 0.4)
        axes.set_ylim(size_y - 0.4, -0.6)
        axes.set_aspect("equal")
        axes.set_xticks(range(size_x))
        axes.set_yticks(range(size_y))
        axes.set_xlabel("x")
        axes.set_ylabel("y")
        if topology.num_dims == 3:
            axes.set_title(f"z={plane}", fontsize=8)
    wraps = [name for name, w in zip("xyz", topology.wraparound) if w]
    figure.suptitle(
        f"{layout}: colour = {layout.axis_names[colour_index]} index; labels rank / mesh position; "
        f"wraparound: {', '.join(wraps) or 'none'}", fontsize=8)
    figure.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)
