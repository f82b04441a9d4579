"""Human-readable descriptions of a slice and of a mesh laid onto it.

The lines are written where their data lives (``Topology.describe``, ``MeshLayout.describe``);
``describe`` takes either.
"""

from __future__ import annotations

from tpudist.mesh.layout import MeshLayout
from tpudist.mesh.topology import Topology


def describe(target: Topology | MeshLayout) -> str:
    """Describes a slice, or a mesh layout on its slice, in a few lines.

    For a layout: which physical axes each mesh axis got, whether it is a ring with wraparound, how
    far apart its consecutive chips are, and the all-reduce time of 1 MiB over it.

    Example:
        >>> from tpudist.mesh import Topology
        >>> print(describe(Topology.parse("v4:2x2x1")).splitlines()[0])
        v4:2x2x1: TPU v4 slice of 4 chips (x=2, y=2, z=1), 3-D torus
    """
    if isinstance(target, (MeshLayout, Topology)):
        return target.describe()
    raise TypeError(f"target={target!r} is not a Topology or MeshLayout: pass one of these.")
