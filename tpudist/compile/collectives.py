"""Functional collectives inside compiled graphs: one ``shard_map`` program over the group's devices.

DTensor, tensor-parallel and funcol code traces to ``_c10d_functional`` ops naming a c10d group.
When that group is a "tpu" group, the whole graph becomes one XLA program over the group's
``jax.sharding.Mesh`` (the 1-D mesh the process group already uses), each op a ``jax.lax``
collective over its axis:

==================================  =====================================
``_c10d_functional`` op              inside the program
==================================  =====================================
all_reduce (sum/avg/max/min/product) psum / pmean / pmax / pmin / gather+prod
all_gather_into_tensor               all_gather(axis 0, tiled)
reduce_scatter_tensor                psum_scatter(dim 0, tiled) (/ n for avg);
                                     max/min/product: all-reduce, own chunk
all_to_all_single (equal splits)     all_to_all(dim 0, tiled)
broadcast                            psum of the source's block
wait_tensor                          nothing (XLA orders the program)
==================================  =====================================

Every call runs on the process's comm stream, in order with the group's eager collectives. It
starts with a fingerprint exchange inside XLA (unless ``TPUDIST_VERIFY=0``): ranks calling
different compiled programs (rank-dependent branches or shapes) all raise
:class:`~tpudist.sharding.PlanMismatch` instead of pairing wrongly. Before a program's first run
the ranks also agree on it through the store (``tpudist.sharding.plan.settle``: the same error
naming the ranks, or :class:`~tpudist.sharding.AgreementTimeout` for a rank that never comes).

Collectives on several groups (the axes of a DeviceMesh: "dp" and "tp" of a 2x2 mesh) make one
program over an N-D mesh whose axis k is group k, rebuilt from the groups' global ranks (each must
be an arithmetic progression through this rank, as DeviceMesh cuts them); other layouts, and
non-"tpu" groups, are refused with the reason.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from dataclasses import dataclass

import numpy as np
import torch

from tpudist.compile.errors import UnsupportedGraph, user_line

_NAMESPACE = "_c10d_functional"
_GROUP_ARG = {  # op name -> index of the group-name argument
    "all_reduce": 2, "all_reduce_coalesced": 2, "all_gather_into_tensor": 2,
    "all_gather_into_tensor_coalesced": 2, "reduce_scatter_tensor": 3, "reduce_scatter_tensor_coalesced": 3,
    "all_to_all_single": 3, "broadcast": 2,
}


def _op_name(target) -> str:
    return target._schema.name.split("::")[1]  # noqa: SLF001


def collective_nodes(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "namespace", None) == _NAMESPACE]


def for_graph(gm: torch.fx.GraphModule) -> "GraphCollectives | None":
    """The collective context of an ATen graph, or None when it calls no functional collective."""
    nodes = collective_nodes(gm)
    names = {}
    for node in nodes:
        name = _op_name(node.target)
        if name == "wait_tensor":
            continue
        if name not in _GROUP_ARG:
            raise UnsupportedGraph(f"{node.target} at {user_line(node)} has no lowering inside compiled graphs; "
                                   f"supported: {sorted(_GROUP_ARG)} and wait_tensor")
        index = _GROUP_ARG[name]
        group = node.args[index] if len(node.args) > index else node.kwargs.get("group_name")
        names.setdefault(group, node)
    if not names:
        return None
    return GraphCollectives(names)


class GraphCollectives:
    """The group a graph's collectives run over, and how to lower, wrap and run the graph on it."""

    def __init__(self, groups: dict):
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        import torch.distributed.distributed_c10d as c10d

        from tpudist.process_group import programs, runtime
        from tpudist.process_group.group import ProcessGroupTPU

        pgs = {}
        for group_name, node in groups.items():
            pg = c10d._resolve_process_group(group_name)  # noqa: SLF001
            if not isinstance(pg, ProcessGroupTPU):
                raise UnsupportedGraph(
                    f"{node.target} at {user_line(node)} runs on group {group_name!r} of backend "
                    f"{getattr(pg, 'name', lambda: type(pg).__name__)()}; collectives inside compiled graphs need "
                    "a \"tpu\" process group (init_process_group('tpu')), or compile with another backend")
            pgs[group_name] = pg
        rt = runtime.current()
        if len(pgs) == 1:
            (group_name, pg), = pgs.items()
            self.axes = (programs.AXIS,)
            self.grid = np.array(pg.global_ranks)
            self.mesh = programs.mesh_of(tuple(pg.global_ranks))  # the group's own mesh
        else:
            self.grid = _grid([tuple(pg.global_ranks) for pg in pgs.values()], rt.process_id, list(pgs))
            self.axes = tuple(f"group{i}" for i in range(len(pgs)))
            self.mesh = Mesh(np.vectorize(rt.device, otypes=[object])(self.grid), self.axes)
        self.axis_of = dict(zip(pgs, self.axes))
        self.size_of = {name: len(pg.global_ranks) for name, pg in pgs.items()}
        self.ranks = tuple(int(r) for r in self.grid.reshape(-1))
        self.num_block_dims = len(self.axes)
        self.device = rt.local_device
        self.input_sharding = NamedSharding(self.mesh, P(*self.axes))
        self.key = f"collectives over global ranks {self.grid.tolist()} on axes {self.axes}"
        self._agreed: set[str] = set()
        self._check_fn = None
        self._timeout = max((getattr(pg, "_timeout", None) or timedelta(seconds=300)) for pg in pgs.values())

    def canonical(self, code: str) -> str:
        """A graph's code with group names (which differ between ranks of a 2-D mesh: rank 0's and rank
        2's "tp" groups are different groups) replaced by mesh axes, for the cross-rank program key."""
        for name, axis in self.axis_of.items():
            code = code.replace(repr(name), repr(f"<axis {axis}>"))
        return code

    # -- tracing ----------------------------------------------------------------------------------
    def lower(self, target, args, kwargs, node):
        name = _op_name(target)
        fn = _LOWERINGS.get(name)
        if fn is None:
            raise UnsupportedGraph(f"{target} at {user_line(node)}: no lowering inside compiled graphs")
        if name == "wait_tensor":
            return fn(None, node, *args, **kwargs)
        index = _GROUP_ARG[name]
        group = node.args[index] if len(node.args) > index else node.kwargs["group_name"]
        return fn(_Axis(self.axis_of[group], self.size_of[group], group), node, *args, **kwargs)

    def wrap(self, program, num_inputs: int):
        """``program`` (on one rank's blocks) as a shard_map over the group: every input and output
        carries a leading axis of the group's size, one block per rank."""
        import jax
        from jax.sharding import PartitionSpec as P

        lead = (0,) * self.num_block_dims
        new = (None,) * self.num_block_dims

        def per_rank(key_data, consts, *arrays):
            outs = program(key_data[lead], [c[lead] for c in consts], *[a[lead] for a in arrays])
            return [o[new] for o in outs]

        spec = P(*self.axes)
        return jax.shard_map(per_rank, mesh=self.mesh, in_specs=spec, out_specs=spec, check_vma=False)

    def global_aval(self, aval):
        import jax

        return jax.ShapeDtypeStruct((*self.grid.shape, *aval.shape), aval.dtype, sharding=self.input_sharding)

    # -- running ----------------------------------------------------------------------------------
    def _put(self, arr: np.ndarray):
        import jax
        from jax._src.lib import xla_client

        aval = jax.core.ShapedArray((*self.grid.shape, *arr.shape), arr.dtype)
        block = arr[(None,) * self.num_block_dims]
        return xla_client.batched_device_put(aval, self.input_sharding, [block], [self.device], True)

    def run(self, program, tensors: list, keep: list) -> list:
        """Runs ``program`` (a GraphProgram) on this rank's tensors; this rank's output blocks."""
        import jax

        from tpudist.compile import boundary
        from tpudist.sharding.plan import run_in_order

        arrays = []
        for t in tensors:
            arr, owner = boundary.numpy_view(t.detach())
            keep.append(owner)
            arrays.append(self._put(arr))
        key = self._put(program._key_data())  # noqa: SLF001
        consts = [self._put(boundary.numpy_view(v)[0]) for _, v in program._constants]  # noqa: SLF001
        exe = program._exe.compiled  # noqa: SLF001

        def task():
            # The in-XLA fingerprint exchange first: a rank running an agreed program and a rank
            # bringing a new one meet there (and both raise) instead of one waiting in the store.
            self._verify(program.key)
            self._agree(program)
            outs = exe(key, consts, *arrays)
            jax.block_until_ready(outs)
            return [o.addressable_data(0) for o in outs]  # (1, ..., 1, *shape)

        return run_in_order(f"compiled graph {program.name} over global ranks {list(self.ranks)}", task,
                            self._timeout)

    def _agree(self, program) -> None:
        if program.key in self._agreed:
            return
        from tpudist.sharding.plan import Path, Plan, digest, environment, settle

        plan = Plan(f"compiled {program.name} graph", Path.SPMD, "a torch.compile graph with collectives",
                    (), program.key, digest(program.key, environment()))
        settle(plan, self.ranks, digest("tpudist.compile", self.ranks),
               f"compiled {program.name} graph {program.key[:12]}", "raise", self._timeout)
        self._agreed.add(program.key)

    def _verify(self, key: str) -> None:
        """Every rank of the group runs the same program now, or all raise before it runs."""
        if os.environ.get("TPUDIST_VERIFY", "1") == "0":
            return
        import jax
        from jax.sharding import PartitionSpec as P

        if self._check_fn is None:
            from tpudist.compile.program import _table_digest
            from tpudist.process_group.programs import CachedProgram

            lead, new = (0,) * self.num_block_dims, (None,) * self.num_block_dims
            jitted = jax.jit(jax.shard_map(
                lambda fp: jax.lax.all_gather(fp[lead], self.axes, axis=0)[new], mesh=self.mesh,
                in_specs=P(*self.axes), out_specs=P(*self.axes), check_vma=False))
            # Its executable, like the graph's own, comes from tpudist's program cache (keyed by the
            # mesh's devices): the next world of the same layout compiles neither.
            self._check_fn = CachedProgram(jitted, list(self.mesh.devices.flat),
                                           ("graph_check", self.grid.shape, self.axes, _table_digest()))
        mine = np.frombuffer(hashlib.sha256(key.encode()).digest()[:8], np.int32).copy()
        got = np.asarray(self._check_fn(self._put(mine)).addressable_data(0)).reshape(len(self.ranks), -1)
        if not (got == mine).all():
            from tpudist.sharding.plan import PlanMismatch

            differ = [self.ranks[i] for i in range(len(self.ranks)) if not (got[i] == mine).all()]
            raise PlanMismatch(f"compiled graph {key[:12]} on global ranks {list(self.ranks)}: ranks {differ} are "
                               "running a different compiled program at this point (rank-dependent code paths "
                               "or shapes); every rank of the group must run the same graphs in the same order")


def _grid(group_ranks: list[tuple], me: int, names: list) -> np.ndarray:
    """The global ranks as an N-D grid in which each group is the line through ``me`` along one axis.

    Holds for groups cut from one DeviceMesh (each an arithmetic progression of global ranks);
    anything else is refused with the groups named.
    """
    strides, where = [], []
    for ranks, name in zip(group_ranks, names):
        steps = {b - a for a, b in zip(ranks, ranks[1:])}
        if len(steps) > 1 or me not in ranks:
            raise NotImplementedError(f"collectives on groups {names} in one compiled graph: group {name!r} "
                                      f"(global ranks {list(ranks)}) is not a regular mesh axis through rank {me}; "
                                      "compile regions that use one group each")
        strides.append(steps.pop() if steps else 1)
        where.append(ranks.index(me))
    base = me - sum(i * s for i, s in zip(where, strides))
    grid = np.full([len(r) for r in group_ranks], base, dtype=np.int64)
    for axis, stride in enumerate(strides):
        shape = [1] * len(strides)
        shape[axis] = len(group_ranks[axis])
        grid = grid + (np.arange(len(group_ranks[axis])) * stride).reshape(shape)
    if len(set(grid.reshape(-1).tolist())) != grid.size:
        raise NotImplementedError(f"collectives on groups {names} in one compiled graph: their ranks do not form "
                                  "a mesh (overlapping axes); compile regions that use one group each")
    return grid


@dataclass(frozen=True, slots=True)
class _Axis:
    """What a lowering needs of its group: the mesh axis, its size and the group's name."""

    axis: str
    size: int
    group_name: str


# -- lowerings: one small function per functional collective -----------------------------------------
def _check_size(ctx: _Axis, node, group_size: int) -> None:
    if group_size != ctx.size:
        raise UnsupportedGraph(f"{node.target} at {user_line(node)} says group_size={group_size}, group "
                               f"{ctx.group_name!r} has {ctx.size} ranks")


def _reduce(ctx: _Axis, node, x, op: str):
    from jax import lax

    op = op.lower()
    if op == "sum":
        return lax.psum(x, ctx.axis)
    if op == "avg":
        return lax.pmean(x, ctx.axis) if x.dtype.kind == "f" else lax.psum(x, ctx.axis) // ctx.size
    if op == "max":
        return lax.pmax(x, ctx.axis)
    if op == "min":
        return lax.pmin(x, ctx.axis)
    if op == "product":  # XLA has no product all-reduce (FACTS.md)
        return lax.all_gather(x, ctx.axis).prod(axis=0).astype(x.dtype)
    raise UnsupportedGraph(f"{node.target} at {user_line(node)}: reduce op {op!r} is not supported inside "
                           "compiled graphs (sum, avg, max, min, product)")


def _all_reduce(ctx, node, x, reduce_op, group_name):
    return _reduce(ctx, node, x, reduce_op)


def _all_reduce_coalesced(ctx, node, xs, reduce_op, group_name):
    return [_reduce(ctx, node, x, reduce_op) for x in xs]


def _all_gather(ctx, node, x, group_size, group_name):
    from jax import lax

    _check_size(ctx, node, group_size)
    return lax.all_gather(x, ctx.axis, axis=0, tiled=True)


def _all_gather_coalesced(ctx, node, xs, group_size, group_name):
    return [_all_gather(ctx, node, x, group_size, group_name) for x in xs]


def _reduce_scatter(ctx, node, x, reduce_op, group_size, group_name):
    from jax import lax

    _check_size(ctx, node, group_size)
    if x.shape[0] % ctx.size:
        raise UnsupportedGraph(f"{node.target} at {user_line(node)}: dim 0 of size {x.shape[0]} does not divide "
                               f"into {ctx.size} ranks")
    op = reduce_op.lower()
    if op in ("sum", "avg"):
        out = lax.psum_scatter(x, ctx.axis, scatter_dimension=0, tiled=True)
        return out / ctx.size if op == "avg" else out
    # XLA's reduce-scatter only sums: all-reduce with the op, then keep this rank's chunk.
    chunk = x.shape[0] // ctx.size
    reduced = _reduce(ctx, node, x, op)
    return lax.dynamic_slice_in_dim(reduced, lax.axis_index(ctx.axis) * chunk, chunk, axis=0)


def _reduce_scatter_coalesced(ctx, node, xs, reduce_op, group_size, group_name):
    return [_reduce_scatter(ctx, node, x, reduce_op, group_size, group_name) for x in xs]


def _all_to_all(ctx, node, x, output_split_sizes, input_split_sizes, group_name):
    from jax import lax

    for sizes in (output_split_sizes, input_split_sizes):
        if sizes is not None and len(set(sizes)) > 1:
            raise UnsupportedGraph(f"{node.target} at {user_line(node)}: uneven splits {list(sizes)} are not "
                                   "supported inside compiled graphs (equal splits only)")
    return lax.all_to_all(x, ctx.axis, 0, 0, tiled=True)


def _broadcast(ctx, node, x, src, group_name):
    import jax.numpy as jnp
    from jax import lax

    # c10d's functional broadcast hands ``src`` to the group as its root: a rank within the group.
    if not 0 <= src < ctx.size:
        raise UnsupportedGraph(f"{node.target} at {user_line(node)}: src={src} is not a rank of group "
                               f"{ctx.group_name!r} (size {ctx.size})")
    return lax.psum(jnp.where(lax.axis_index(ctx.axis) == src, x, jnp.zeros_like(x)), ctx.axis)


def _wait(ctx, node, x):
    return x


_LOWERINGS = {
    "all_reduce": _all_reduce, "all_reduce_coalesced": _all_reduce_coalesced,
    "all_gather_into_tensor": _all_gather, "all_gather_into_tensor_coalesced": _all_gather_coalesced,
    "reduce_scatter_tensor": _reduce_scatter, "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
    "all_to_all_single": _all_to_all, "broadcast": _broadcast, "wait_tensor": _wait,
}
