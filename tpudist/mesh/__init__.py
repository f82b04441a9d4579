"""tpudist.mesh: a TPU slice as data.

A `Topology` knows its chips, their coordinates and ranks (host-major), which axes wrap around,
its hosts, and per-generation link, memory and compute figures. It lays a logical mesh onto the
torus with JAX's algorithm (`mesh_layout`, `create_mesh`) and estimates collective times after the
JAX scaling book (`collective_cost`). Pure Python and numpy: no torch, and JAX only when a mesh is
laid out.

Example:
    >>> from tpudist.mesh import Topology
    >>> topology = Topology.parse("v5p:4x4x4")
    >>> topology.create_mesh((4, 16)).shape
    (4, 16)
    >>> round(topology.collective_seconds("all_gather", 2**21, "x") * 1e6, 2)
    8.74
"""

from tpudist.mesh._errors import TopologyError
from tpudist.mesh.cost import COLLECTIVE_OPS, CollectiveCost, RingAxis
from tpudist.mesh.describe import describe
from tpudist.mesh.generations import GENERATIONS, Generation
from tpudist.mesh.layout import MeshLayout, mesh_layout
from tpudist.mesh.plot import plot_mesh
from tpudist.mesh.topology import Topology

__all__ = [
    "COLLECTIVE_OPS",
    "CollectiveCost",
    "GENERATIONS",
    "Generation",
    "MeshLayout",
    "RingAxis",
    "Topology",
    "TopologyError",
    "describe",
    "mesh_layout",
    "plot_mesh",
]
