"""Unit tests of laying meshes onto slices (tpudist.mesh.layout), with JAX fed mock devices.

The hardware is mocked, not the algorithm: expected layouts come from JAX's own test table
(`tests/mesh_utils_test.py`, test_create_device_mesh_for_nd_torus) and from the rules JAX's
`_create_device_mesh_for_nd_torus` documents, checked through chip coordinates.
"""

import math

import numpy as np
import pytest

from tpudist.mesh import MeshLayout, Topology, TopologyError

# name, topology, mesh_shape, physical axes per mesh axis. Rows from JAX's test table for v4
# (one device per chip). JAX lists every physical axis assigned; tpudist lists the axes along which
# a mesh axis actually has chips, so the size-1 z of 2x2x1 is left out of the first row.
JAX_ND_TORUS_TABLE = [
    ("2x2x1", "v4:2x2x1", (1, 1, 4), ((), (), (0, 1))),
    ("2x2x4", "v4:2x2x4", (1, 4, 4), ((), (2,), (0, 1))),
    ("4x4x4", "v4:4x4x4", (1, 16, 4), ((), (1, 2), (0,))),
    ("4x4x8a", "v4:4x4x8", (1, 16, 8), ((), (0, 1), (2,))),
    ("4x4x8b", "v4:4x4x8", (1, 8, 16), ((), (2,), (0, 1))),
    ("4x4x8c", "v4:4x4x8", (16, 8, 1), ((0, 1), (2,), ())),
    ("4x8x8", "v4:4x8x8", (1, 32, 8), ((), (0, 2), (1,))),
    ("8x8x8", "v4:8x8x8", (1, 64, 8), ((), (1, 2), (0,))),
    ("8x8x16", "v4:8x8x16", (1, 64, 16), ((), (0, 1), (2,))),
    # v5e 16x16: JAX assigns the last (most intensive) mesh axis first, to the first physical axis
    # of its size (x), then the first mesh axis to y.
    ("v5e_16x16", "v5e:16x16", (16, 16), ((1,), (0,))),
    # 7x is laid out per chip by the same generic 3-D algorithm as v4.
    ("7x_4x4x4", "7x:4x4x4", (1, 16, 4), ((), (1, 2), (0,))),
]


@pytest.mark.parametrize("name,text,mesh_shape,physical_axes", JAX_ND_TORUS_TABLE,
                         ids=[row[0] for row in JAX_ND_TORUS_TABLE])
def test_physical_axes_match_jax_table(name, text, mesh_shape, physical_axes):
    topology = Topology.parse(text)
    layout = topology.mesh_layout(mesh_shape)
    assert layout.physical_axes == physical_axes
    assert layout.physical_sizes == tuple(
        tuple(topology.shape[p] for p in axes) for axes in physical_axes)
    assert sorted(layout.ranks) == list(range(topology.num_chips))


def test_v4_cube_rank_array_follows_the_assignment():
    # (1, 16, 4) on 4x4x4: mesh axis 2 is x, mesh axis 1 is (y, z) flattened y-major (JAX
    # transposes the physical mesh to (y, z, x) and reshapes).
    topology = Topology.parse("v4:4x4x4")
    ranks = topology.create_mesh((1, 16, 4))
    assert ranks.shape == (1, 16, 4) and ranks.dtype.kind == "i"
    for j in range(16):
        for k in range(4):
            assert topology.coords(int(ranks[0, j, k])) == (k, j // 4, j % 4)


def test_v5e_pod_rank_array():
    topology = Topology.parse("v5e:16x16")
    ranks = topology.create_mesh((16, 16))
    for i in range(16):
        for j in range(16):
            assert topology.coords(int(ranks[i, j])) == (j, i)


def test_mesh_that_needs_a_split_is_refused_then_accepted():
    topology = Topology.parse("v4:4x4x4")
    with pytest.raises(TopologyError) as info:
        topology.create_mesh((8, 8))
    assert str(info.value) == (
        "mesh_shape=(8, 8) does not fit topology v4:4x4x4: each mesh axis must be a product of "
        "physical axes; pass allow_split_physical_axes=True to split one.")
    assert isinstance(info.value.__cause__, NotImplementedError)  # JAX's own error, chained

    layout = topology.mesh_layout((8, 8), allow_split_physical_axes=True)
    assert layout.rank_array.shape == (8, 8)
    assert sorted(layout.ranks) == list(range(64))
    # 8 = 4 x 2: each mesh axis takes one whole physical axis and half of a shared one.
    for sizes in layout.physical_sizes:
        assert math.prod(sizes) == 8 and sorted(sizes) == [2, 4]
    shared = set(layout.physical_axes[0]) & set(layout.physical_axes[1])
    assert len(shared) == 1


# name, topology, mesh_shape, kwargs, exact message
BAD_MESH_TABLE = [
    ("wrong_product", "v4:4x4x4", (4, 4), {},
     "mesh_shape=(4, 4) has 16 chips but topology v4:4x4x4 has 64: the product of mesh_shape must "
     "equal num_chips; pass a mesh_shape whose sizes multiply to 64."),
    ("zero_axis", "v4:4x4x4", (0, 64), {},
     "mesh_shape=(0, 64) is not a mesh shape: it must be one or more ints >= 1; pass e.g. (4, 16) "
     "or '4x16'."),
    ("empty", "v4:2x2x1", (), {},
     "mesh_shape=() is not a mesh shape: it must be one or more ints >= 1; pass e.g. (4, 16) or "
     "'4x16'."),
    ("bad_string", "v4:4x4x4", "4by16", {},
     "mesh_shape='4by16' is not a mesh shape: it must be one or more ints >= 1; pass e.g. (4, 16) "
     "or '4x16'."),
    ("names_count", "v4:4x4x4", (4, 16), {"axis_names": ("dp",)},
     "axis_names=('dp',) do not name the 2 axes of mesh_shape=(4, 16): pass one non-empty name per "
     "mesh axis, e.g. ('axis0', 'axis1')."),
    ("names_repeat", "v4:4x4x4", (4, 16), {"axis_names": "tp,tp"},
     "axis_names='tp,tp' repeat 'tp': mesh axis names must be distinct; pass distinct names."),
]


@pytest.mark.parametrize("name,text,mesh_shape,kwargs,message", BAD_MESH_TABLE,
                         ids=[row[0] for row in BAD_MESH_TABLE])
def test_bad_mesh_message(name, text, mesh_shape, kwargs, message):
    with pytest.raises(TopologyError) as info:
        Topology.parse(text).mesh_layout(mesh_shape, **kwargs)
    assert str(info.value) == message


def _host_blocks_are_contiguous(topology, ranks):
    for host in range(topology.num_hosts):
        positions = np.argwhere(np.vectorize(topology.host_of)(ranks) == host)
        low, high = positions.min(axis=0), positions.max(axis=0)
        if math.prod(high - low + 1) != len(positions):
            return False
    return True


def test_contiguous_submeshes():
    topology = Topology.parse("v4:4x4x4")
    ranks = topology.create_mesh((16, 4), contiguous_submeshes=True)
    assert _host_blocks_are_contiguous(topology, ranks)
    # without the option JAX's default (16, 4) layout splits hosts (a 2x2 host spans 2 x values)
    assert not _host_blocks_are_contiguous(topology, topology.create_mesh((16, 4)))

    with pytest.raises(TopologyError) as info:
        topology.create_mesh((4, 16), contiguous_submeshes=True)
    message = str(info.value)
    assert message.startswith(
        "contiguous_submeshes=True is not available for mesh_shape=(4, 16) on topology v4:4x4x4: "
        "JAX has per-host contiguous layouts only for some slice and mesh shapes (")
    assert message.endswith("); pass contiguous_submeshes=False.")


def _consecutive_hops(topology, ranks):
    ring = [int(r) for r in ranks] + [int(ranks[0])]
    return [topology.hops(a, b) for a, b in zip(ring, ring[1:])]


# name, topology, 1-D mesh size. JAX's device-kind handlers lay a 1-D mesh along a physical ring:
# _V5E_TRAY_RING_ORDER on the 8-chip v5e tray (4 chips along x), _TRAY_4x4_RING_ORDER on v5e 4x4
# ("only uses ring order if the whole mesh is a replica group"), _V5P_2x2x2_ORDER on v5p 2x2x2.
RING_TABLE = [
    ("v5e_tray", "v5e:4x2", 8),
    ("v6e_tray", "v6e:4x2", 8),
    ("v5e_4x4", "v5e:4x4", 16),
    ("v5p_2x2x2", "v5p:2x2x2", 8),
]


@pytest.mark.parametrize("name,text,size", RING_TABLE, ids=[row[0] for row in RING_TABLE])
def test_one_dimensional_mesh_is_a_ring_of_neighbours(name, text, size):
    topology = Topology.parse(text)
    layout = topology.mesh_layout((size,))
    assert _consecutive_hops(topology, layout.rank_array) == [1] * size
    assert layout.ring_hops(0) == (1, 1)


def test_ring_hops_of_a_line():
    # 2x2x4 has no wraparound: the mesh axis laid on z is a line of 4 chips, 3 hops end to end.
    topology = Topology.parse("v4:2x2x4")
    layout = topology.mesh_layout((4, 4))
    z_axis = [i for i, axes in enumerate(layout.physical_axes) if axes == (2,)]
    assert z_axis, layout.physical_axes
    assert layout.ring_hops(z_axis[0]) == (1, 3)
    assert not layout.wraps(z_axis[0])


def test_wraps_needs_whole_wrapped_axes():
    layout = Topology.parse("v5e:8x16").mesh_layout((8, 16), axis_names=("dp", "tp"))
    # JAX gives the 16-chip axis to y, the only axis of the slice with a wraparound link.
    assert layout.physical_axes == ((0,), (1,))
    assert (layout.wraps("dp"), layout.wraps("tp")) == (False, True)


def test_7x_laid_out_per_chip_like_v4():
    for mesh_shape in [(2, 4), (8,), (4, 2)]:
        assert (Topology.parse("7x:2x2x2").mesh_layout(mesh_shape).ranks
                == Topology.parse("v4:2x2x2").mesh_layout(mesh_shape).ranks)


def test_layout_value():
    topology = Topology.parse("v4:4x4x4")
    layout = topology.mesh_layout("4x16", axis_names="dp, tp")
    assert layout.axis_names == ("dp", "tp") and layout.mesh_shape == (4, 16)
    assert str(layout) == "v4:4x4x4 as (dp=4, tp=16)"
    assert eval(repr(layout), {"Topology": Topology, "MeshLayout": MeshLayout}) == layout
    assert layout == topology.mesh_layout((4, 16), axis_names=("dp", "tp"))
    assert topology.mesh_layout((4, 16)).axis_names == ("axis0", "axis1")
    assert np.array_equal(layout.rank_array, topology.create_mesh((4, 16)))
    with pytest.raises(TopologyError) as info:
        layout.axis_index("pp")
    assert str(info.value) == (
        "axis='pp' is not a mesh axis of v4:4x4x4 as (dp=4, tp=16): the axes are ('dp', 'tp') (or "
        "0..1); pass one of these.")


def test_layout_cost_over_whole_axes_equals_topology_cost():
    topology = Topology.parse("v4:4x4x4")
    layout = topology.mesh_layout((4, 16), axis_names=("dp", "tp"))
    for axes in ["dp", "tp", ("dp", "tp")]:
        indices = [layout.axis_index(a) for a in ([axes] if isinstance(axes, str) else axes)]
        physical = sorted(p for i in indices for p in layout.physical_axes[i])
        assert (layout.collective_cost("all_gather", 2**22, axes)
                == topology.collective_cost("all_gather", 2**22, physical))


def test_layout_cost_of_a_split_axis_has_no_wraparound():
    # (8, 8) on a wrapped 4x4x4: each mesh axis spans one whole wrapped physical axis (W_bidi =
    # 9e10 B/s) and half of another, a line without wraparound (one-way 4.5e10 B/s).
    layout = Topology.parse("v4:4x4x4").mesh_layout((8, 8), allow_split_physical_axes=True)
    cost = layout.collective_cost("all_gather", 2**20, 0)
    assert cost.group_size == 8
    assert sorted(ring.wraps for ring in cost.rings) == [False, True]
    assert cost.bandwidth_seconds == pytest.approx(2**20 * 7 / 8 / (9e10 + 4.5e10))
    # hops: 4 // 2 = 2 on the wrapped axis plus 2 - 1 = 1 along the half axis
    assert cost.hops == 3


def test_contiguous_submeshes_is_checked_where_jax_ignores_it():
    # On v5e 4x4 JAX's device-kind handler returns its 16-chip tray ring for a 1-D mesh whatever
    # contiguous_submeshes says; host 0 (the 2x2 block at the origin) is not one run of that ring.
    topology = Topology.parse("v5e:4x4")
    with pytest.raises(TopologyError) as info:
        topology.create_mesh((16,), contiguous_submeshes=True)
    assert str(info.value) == (
        "contiguous_submeshes=True cannot be honoured for mesh_shape=(16,) on topology v5e:4x4: "
        "host 0's chips do not form a contiguous block of the mesh; pass contiguous_submeshes=False "
        "or another mesh_shape.")
    assert topology.create_mesh((4, 4), contiguous_submeshes=False).shape == (4, 4)
