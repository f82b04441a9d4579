"""The placement translator and plans as pure values: no processes, no live mesh."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from tpudist.sharding import (JaxLayout, LayoutError, Path, Plan, default_axis_names, to_layout,
                              to_partition_spec, to_placements)
from tpudist.sharding.layout import chunk, padded_length, padded_positions
from tpudist.sharding.plan import Agreement, Collective, collectives, transition

DP_TP = ("dp", "tp")

# (placements, axis names, ndim, mesh shape) -> spec: each row is a rule of the module docstring.
TRANSLATIONS = {
    "replicate": ((Replicate(),), ("x",), 2, (4,), P(None, None)),
    "shard0": ((Shard(0),), ("x",), 2, (4,), P("x", None)),
    "shard_last_negative": ((Shard(-1),), ("x",), 3, (4,), P(None, None, "x")),
    "two_dims": ((Shard(0), Shard(1)), DP_TP, 2, (2, 2), P("dp", "tp")),
    "transposed": ((Shard(1), Shard(0)), DP_TP, 2, (2, 2), P("tp", "dp")),
    "one_dim_two_axes_mesh_order": ((Shard(0), Shard(0)), DP_TP, 2, (2, 4), P(("dp", "tp"), None)),
    "fsdp_tp_strided": ((_StridedShard(0, split_factor=4), Shard(0)), DP_TP, 2, (2, 4), P(("tp", "dp"), None)),
    "replicate_then_shard": ((Replicate(), Shard(1)), DP_TP, 2, (2, 2), P(None, "tp")),
}


@pytest.mark.parametrize("name", sorted(TRANSLATIONS))
def test_translation_table_both_ways(name):
    placements, names, ndim, mesh_shape, spec = TRANSLATIONS[name]
    assert to_partition_spec(placements, names, ndim, mesh_shape) == spec
    canonical = tuple(Shard(p.dim % ndim) if type(p) is Shard else p for p in placements)
    assert to_placements(spec, names, mesh_shape) == canonical


def test_partial_rides_beside_the_spec():
    layout = to_layout([Shard(0), Partial("avg")], DP_TP, 2)
    assert layout == JaxLayout(P("dp", None), (("tp", "avg"),))
    assert str(layout) == "P('dp', None) +avg(tp)"
    assert to_placements(layout, DP_TP) == (Shard(0), Partial("avg"))
    assert eval(repr(layout), {"JaxLayout": JaxLayout, "P": P, "PartitionSpec": P}) == layout


def test_shard_order_matches_jax_major_to_minor():
    # DTensor gives mesh coordinate (i, j) of a (2, 4) mesh the chunk i * 4 + j of dim 0, which is
    # the block JAX gives device (i, j) under P(("dp", "tp")): "dp" is the major axis.
    for i, j in itertools.product(range(2), range(4)):
        _, offset = _compute_local_shape_and_global_offset((16, 3), (2, 4), [i, j], [Shard(0), Shard(0)])
        assert offset[0] == (i * 4 + j) * 2


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4), (4, 2)])
def test_strided_shard_is_the_reversed_axis_order(mesh_shape):
    # DTensor's offsets for FSDP2+TP's layout equal JAX's blocks under P(("tp", "dp")), "tp" major.
    dp_size, tp_size = mesh_shape
    placements = [_StridedShard(0, split_factor=tp_size), Shard(0)]
    assert to_partition_spec(placements, DP_TP, 2, mesh_shape) == P(("tp", "dp"), None)
    rows = 2 * dp_size * tp_size
    for dp, tp in itertools.product(range(dp_size), range(tp_size)):
        (size, _), (offset, _) = _compute_local_shape_and_global_offset((rows, 3), mesh_shape, [dp, tp], placements)
        assert (size, offset) == (2, (tp * dp_size + dp) * 2)


ERRORS = {
    "wrong_count": (lambda: to_layout([Shard(0)], DP_TP, 2),
                    "placements=(S(0)) has 1 entries but the mesh has 2 axes ('dp', 'tp'): give one "
                    "placement per mesh axis"),
    "dim_out_of_range": (lambda: to_layout([Shard(2)], ("x",), 2),
                         "placement=S(2) on mesh axis 'x' shards dim=2, but the tensor has ndim=2; use a "
                         "dim in [-2, 2)"),
    "product": (lambda: to_layout([Partial("product")], ("x",), 1),
                "placement=Partial(product) on mesh axis 'x': reduce_op='product' has no XLA collective; "
                "supported: ('sum', 'avg', 'max', 'min'). Redistribute it with DTensor.redistribute first"),
    "partial_in_spec": (lambda: to_partition_spec([Partial()], ("x",), 1),
                        "placements=(P(sum)) hold a pending reduction on mesh axes ['x'], which a "
                        "PartitionSpec cannot express; use to_layout() to get it beside the spec"),
    "duplicate_names": (lambda: to_layout([Replicate(), Replicate()], ("x", "x"), 1),
                        "mesh_axis_names=('x', 'x') has duplicates: each mesh axis needs its own name"),
    "strided_wrong_factor": (lambda: to_layout([_StridedShard(0, split_factor=3), Shard(0)], DP_TP, 1, (2, 2)),
                             "placements=(_S(0, 3), S(0)) on mesh axes ('dp', 'tp'): _StridedShard "
                             "split_factor=3 on mesh axis 'dp', but the later Shard(0) axes ('tp',) split "
                             "the dim 2 ways; only split_factor == their product is a PartitionSpec"),
    "strided_alone": (lambda: to_layout([_StridedShard(0, split_factor=2), Replicate()], DP_TP, 1, (2, 2)),
                      "placements=(_S(0, 2), R) on mesh axes ('dp', 'tp'): _StridedShard on mesh axis 'dp' "
                      "must precede at least one plain Shard(0) axis (the FSDP2+TP form); here it does not"),
    "unknown_axis": (lambda: to_placements(P("pp"), DP_TP),
                     "spec entry 'pp' of dim=0 names mesh axis 'pp', which is not in "
                     "mesh_axis_names=('dp', 'tp')"),
    "axis_twice": (lambda: to_placements(P("dp", "dp"), DP_TP),
                   "spec entry 'dp' of dim=1: mesh axis 'dp' is used twice in layout=P('dp', "
                   "'dp'); a mesh axis shards at most one dim and cannot also be pending a reduction"),
    "partial_and_shard": (lambda: to_placements(JaxLayout(P("dp"), (("dp", "sum"),)), DP_TP),
                          "partial_axes entry ('dp', 'sum'): mesh axis 'dp' is used twice in "
                          "layout=P('dp',) +sum(dp); a mesh axis shards at most one dim and "
                          "cannot also be pending a reduction"),
    "inexpressible_order": (lambda: to_placements(P(("c", "a", "b")), ("a", "b", "c"), (2, 2, 2)),
                            "spec entry ('c', 'a', 'b') of dim=0 orders mesh axes ('c', 'a', 'b') in a way "
                            "DTensor cannot express; DTensor shards a dim by axes in increasing mesh "
                            "order, or (FSDP2+TP) by the later axes first and one earlier axis last"),
    "strided_needs_shape": (lambda: to_placements(P(("tp", "dp")), DP_TP),
                            "spec entry ('tp', 'dp') of dim=0 needs a _StridedShard; pass mesh_shape to "
                            "compute its split_factor"),
    "unconstrained": (lambda: to_placements(P(P.UNCONSTRAINED), DP_TP),
                      "is not None, an axis name or a tuple of axis names; unconstrained entries have no "
                      "DTensor placement"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_state_rule_values_and_fix(name):
    call, text = ERRORS[name]
    with pytest.raises(LayoutError) as info:
        call()
    assert text in str(info.value)
    assert isinstance(info.value, ValueError)


def test_default_axis_names():
    assert default_axis_names(3) == ("axis0", "axis1", "axis2")


# -- uneven shards: the padded layout against DTensor's own chunk rule --------------------------------
def _dtensor_positions(length, mesh_shape):
    """Padded position of each logical index, from DTensor's local shapes and offsets."""
    slot = padded_length(length, mesh_shape) // math.prod(mesh_shape)
    positions = {}
    for flat, coord in enumerate(itertools.product(*(range(k) for k in mesh_shape))):
        (size,), (offset,) = _compute_local_shape_and_global_offset(
            (length,), mesh_shape, list(coord), [Shard(0)] * len(mesh_shape))
        assert size <= slot
        for i in range(size):
            positions[offset + i] = flat * slot + i
    return [positions[i] for i in range(length)]


@pytest.mark.parametrize("length,mesh_shape", [(5, (2,)), (5, (4,)), (1, (4,)), (5, (2, 2)), (7, (2, 3)),
                                               (3, (2, 2)), (0, (2,)), (9, (4, 2))])
def test_padded_positions_follow_dtensor(length, mesh_shape):
    assert padded_positions(length, mesh_shape) == _dtensor_positions(length, mesh_shape)


def test_chunk_is_torch_chunk():
    assert [chunk(5, 4, i) for i in range(4)] == [(2, 0), (2, 2), (1, 4), (0, 5)]


# -- plans --------------------------------------------------------------------------------------------
def test_transition_table():
    kinds = {(str(s), str(d)): transition("x", s, d).kind for s, d in [
        (Shard(0), Replicate()), (Partial(), Replicate()), (Partial(), Shard(1)), (Shard(0), Shard(1)),
        (Replicate(), Shard(0)), (Replicate(), Partial())]}
    assert kinds == {("S(0)", "R"): "all_gather", ("P(sum)", "R"): "psum", ("P(sum)", "S(1)"): "psum_scatter",
                     ("S(0)", "S(1)"): "all_to_all", ("R", "S(0)"): "local_slice", ("R", "P(sum)"): "local"}
    assert transition("x", Shard(0), Shard(0)) is None


def test_plan_prints_path_reason_collectives():
    steps = collectives(DP_TP, [Shard(0), Partial()], [Replicate(), Partial()])
    plan = Plan("redistribute", Path.SPMD, "both layouts have a JAX sharding", steps, "abc", "def")
    assert steps == (Collective("all_gather", "dp", "S(0)", "R"),)
    assert str(plan) == ("redistribute: spmd (both layouts have a JAX sharding); all_gather[dp] S(0)->R; "
                         "fingerprint abc/def")


def test_agreement_groups_ranks_by_fingerprint():
    a = Agreement(3, ((0, "m", "p1", "f(x) + print"), (1, "m", "p0", "f(x)"), (2, "m", "p0", "f(x)")))
    assert a.same_meaning and not a.same_program
    assert a.differing() == "ranks [0]: f(x) + print [m/p1]; ranks [1, 2]: f(x) [m/p0]"


# -- properties ----------------------------------------------------------------------------------------
_mesh_shapes = st.sampled_from([(2,), (4,), (1,), (2, 2), (2, 4), (4, 2), (1, 3)])


@st.composite
def _layouts(draw):
    mesh_shape = draw(_mesh_shapes)
    names = default_axis_names(len(mesh_shape)) if draw(st.booleans()) else DP_TP[:len(mesh_shape)]
    ndim = draw(st.integers(1, 3))
    options = [Replicate(), *(Shard(d) for d in range(ndim)), *(Partial(op) for op in ("sum", "avg", "max", "min"))]
    placements = tuple(draw(st.sampled_from(options)) for _ in mesh_shape)
    return placements, names, ndim, mesh_shape


@settings(max_examples=60, deadline=None)
@given(_layouts())
def test_placements_to_layout_and_back(case):
    placements, names, ndim, mesh_shape = case
    layout = to_layout(placements, names, ndim, mesh_shape)
    assert len(layout.spec) == ndim
    assert to_placements(layout, names, mesh_shape) == placements


@settings(max_examples=60, deadline=None)
@given(_mesh_shapes, st.integers(1, 3), st.data())
def test_spec_to_placements_and_back(mesh_shape, ndim, data):
    names = DP_TP[:len(mesh_shape)]
    entries = [[] for _ in range(ndim)]
    for axis in names:  # each axis shards at most one dim, in a random order within the dim
        dim = data.draw(st.integers(-1, ndim - 1))
        if dim >= 0:
            entries[dim].append(axis)
    for axes in entries:
        if len(axes) == 2 and data.draw(st.booleans()):
            axes.reverse()  # ("tp", "dp"): the FSDP2+TP strided form
    spec = P(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in entries))
    placements = to_placements(spec, names, mesh_shape)
    assert to_partition_spec(placements, names, ndim, mesh_shape) == spec


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (4, 2)]))
def test_padded_positions_property(length, mesh_shape):
    positions = padded_positions(length, mesh_shape)
    assert positions == _dtensor_positions(length, mesh_shape)
    assert len(set(positions)) == length and all(0 <= p < padded_length(length, mesh_shape) for p in positions)
