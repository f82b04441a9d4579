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
reduce_scatter_tensor (sum/avg)      psum_scatter(dim 0, tiled) (/ n)
all_to_all_single (equal splits)     all_to_all(dim 0, tiled)
broadcast                            psum of the source's block
wait_tensor                          nothing (XLA orders the program)
==================================  =====================================

Before a program first runs, the group's ranks agree on it through the store
(``tpudist.sharding.plan.settle``): ranks that compiled different graphs (rank-dependent
branches or shapes) get :class:`~tpudist.sharding.PlanMismatch` naming them, a rank that never
comes :class:`~tpudist.sharding.AgreementTimeout`. Every call then runs on the process's comm
stream, in order with the group's eager collectives, after a fingerprint exchange (unless
``TPUDIST_VERIFY=0``) so ranks calling different programs raise instead of pairing wrongly.
Graphs whose collectives name several groups, or a non-"tpu" group, are refused with the reason.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

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
    if len(names) > 1:
        raise NotImplementedError(
            f"a compiled graph with collectives on {len(names)} groups ({sorted(names)}) is not supported yet: "
            "tpudist compiles one group's collectives per graph. Compile smaller regions (e.g. each block) "
            "so each graph uses one group, or let FSDP's collectives stay eager (they do by default)")
    group_name, node = next(iter(names.items()))
    return GraphCollectives(group_name, node)


class GraphCollectives:
    """The group a graph's collectives run over, and how to lower, wrap and run the graph on it."""

    def __init__(self, group_name: str, node):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import torch.distributed.distributed_c10d as c10d

        from tpudist.process_group import programs, runtime
        from tpudist.process_group.group import ProcessGroupTPU

        pg = c10d._resolve_process_group(group_name)  # noqa: SLF001
        if not isinstance(pg, ProcessGroupTPU):
            raise UnsupportedGraph(
                f"{node.target} at {user_line(node)} runs on group {group_name!r} of backend "
                f"{getattr(pg, 'name', lambda: type(pg).__name__)()}; collectives inside compiled graphs need a "
                "\"tpu\" process group (init_process_group('tpu')), or compile with the eager backend")
        self.group_name = group_name
        self.pg = pg
        self.ranks = tuple(pg.global_ranks)
        self.size = len(self.ranks)
        self.axis = programs.AXIS
        self.mesh = programs.mesh_of(self.ranks)
        self.device = runtime.current().local_device
        self.input_sharding = NamedSharding(self.mesh, P(self.axis))
        self.key = f"collectives over global ranks {self.ranks}"
        self._agreed: set[str] = set()
        self._check_fn = None
        self._timeout = getattr(pg, "_timeout", timedelta(seconds=300))
        del jax

    # -- tracing ----------------------------------------------------------------------------------
    def lower(self, target, args, kwargs, node):
        name = _op_name(target)
        fn = _LOWERINGS.get(name)
        if fn is None:
            raise UnsupportedGraph(f"{target} at {user_line(node)}: no lowering inside compiled graphs")
        return fn(self, node, *args, **kwargs)

    def wrap(self, program, num_inputs: int):
        """``program`` (on one rank's blocks) as a shard_map over the group: every input and output
        carries a leading axis of the group's size, one block per rank."""
        import jax
        from jax.sharding import PartitionSpec as P

        def per_rank(key_data, consts, *arrays):
            outs = program(key_data[0], [c[0] for c in consts], *[a[0] for a in arrays])
            return [o[None] for o in outs]

        return jax.shard_map(per_rank, mesh=self.mesh, in_specs=P(self.axis), out_specs=P(self.axis),
                             check_vma=False)

    def global_aval(self, aval):
        import jax

        return jax.ShapeDtypeStruct((self.size, *aval.shape), aval.dtype, sharding=self.input_sharding)

    # -- running ----------------------------------------------------------------------------------
    def _put(self, arr: np.ndarray):
        import jax
        from jax._src.lib import xla_client

        aval = jax.core.ShapedArray((self.size, *arr.shape), arr.dtype)
        return xla_client.batched_device_put(aval, self.input_sharding, [arr[None]], [self.device], True)

    def run(self, program, tensors: list, keep: list) -> list:
        """Runs ``program`` (a GraphProgram) on this rank's tensors; this rank's output blocks."""
        import jax

        from tpudist.compile import boundary
        from tpudist.sharding.plan import run_in_order

        self._agree(program)
        arrays = []
        for t in tensors:
            arr, owner = boundary.numpy_view(t.detach())
            keep.append(owner)
            arrays.append(self._put(arr))
        key = self._put(program._key_data())  # noqa: SLF001
        consts = [self._put(boundary.numpy_view(v)[0]) for _, v in program._constants]  # noqa: SLF001
        exe = program._exe.compiled  # noqa: SLF001

        def task():
            self._verify(program.key)
            outs = exe(key, consts, *arrays)
            jax.block_until_ready(outs)
            return [o.addressable_data(0) for o in outs]

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
            self._check_fn = jax.jit(jax.shard_map(
                lambda fp: jax.lax.all_gather(fp, self.axis, axis=0, tiled=True)[None], mesh=self.mesh,
                in_specs=P(self.axis), out_specs=P(self.axis), check_vma=False))
        mine = np.frombuffer(hashlib.sha256(key.encode()).digest()[:8], np.int32).copy()
        got = np.asarray(self._check_fn(self._put(mine[None])).addressable_data(0))[0]
        if not (got == got[0]).all():
            from tpudist.sharding.plan import PlanMismatch

            differ = [self.ranks[i] for i in range(self.size) if not (got[i] == mine[0]).all()]
            raise PlanMismatch(f"compiled graph {key[:12]} on global ranks {list(self.ranks)}: ranks {differ} are "
                               "running a different compiled program at this point (rank-dependent code paths "
                               "or shapes); every rank of the group must run the same graphs in the same order")


# -- lowerings: one small function per functional collective -----------------------------------------
def _check_size(ctx: GraphCollectives, node, group_size: int) -> None:
    if group_size != ctx.size:
        raise UnsupportedGraph(f"{node.target} at {user_line(node)} says group_size={group_size}, group "
                               f"{ctx.group_name!r} has {ctx.size} ranks")


def _reduce(ctx: GraphCollectives, node, x, op: str):
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
    if op not in ("sum", "avg"):
        raise UnsupportedGraph(f"{node.target} at {user_line(node)}: reduce_scatter {op!r} is not supported "
                               "inside compiled graphs (sum, avg)")
    out = lax.psum_scatter(x, ctx.axis, scatter_dimension=0, tiled=True)
    return out / ctx.size if op == "avg" else out


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

    mine = lax.axis_index(ctx.axis) == ctx.ranks.index(src) if src in ctx.ranks else None
    if mine is None:
        raise UnsupportedGraph(f"{node.target} at {user_line(node)}: src={src} is not in group ranks {ctx.ranks}")
    return lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), ctx.axis)


def _wait(ctx, node, x):
    return x


_LOWERINGS = {
    "all_reduce": _all_reduce, "all_reduce_coalesced": _all_reduce_coalesced,
    "all_gather_into_tensor": _all_gather, "all_gather_into_tensor_coalesced": _all_gather_coalesced,
    "reduce_scatter_tensor": _reduce_scatter, "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
    "all_to_all_single": _all_to_all, "broadcast": _broadcast, "wait_tensor": _wait,
}
