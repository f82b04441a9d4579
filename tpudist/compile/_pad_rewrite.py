"""The padded graph of :mod:`tpudist.compile.dynamic`: a symbolic Core ATen graph rewritten so that
one static program serves every size of a bucket (the real length of each padded symbol is an input;
results are zeroed at the padding, means divide by real counts, softmax-like ops mask with -inf)."""

from __future__ import annotations

import torch
import torch.fx

from tpudist.compile._pad_analysis import _MASKED_REDUCTIONS, _MEANS, _dims, _expr, _factors, _norm_dims, _tensor

aten = torch.ops.aten


def _rewrite(aten_gm: torch.fx.GraphModule, padded: dict, located: dict,
             orders: dict) -> tuple[torch.fx.GraphModule, list]:
    """The padded graph: the real length of each padded symbol as an extra input, every result with a
    padded dim zeroed at the padding, means divided by real counts, softmax-like ops masked with -inf."""
    old = aten_gm.graph
    graph = torch.fx.Graph()
    env: dict = {}
    phs = [n for n in old.nodes if n.op == "placeholder"]
    for n in phs:
        env[n] = graph.node_copy(n, lambda a: env[a])
    lengths = {s: graph.placeholder(f"length_{s}") for s in padded}
    valid, sizes = {}, {}
    for s, loc in located.items():  # the program's size of each symbol (padded or exact)
        sizes[s] = graph.call_function(aten.sym_size.int, (env[phs[loc.index]], loc.dim))
    for s, loc in padded.items():
        device = phs[loc.index].meta["val"].device
        positions = graph.call_function(aten.arange.default, (sizes[s],), {"dtype": torch.int64, "device": device})
        valid[s] = graph.call_function(aten.lt.Tensor, (positions, lengths[s]))

    def size_of(factor):
        return factor if isinstance(factor, int) else sizes[factor]

    def valid_along(new, val, d, s):
        """Bool vector over dim ``d``: True at real positions (a merged dim: where ``s``'s index is real)."""
        factors = _factors(val.shape[d], s, orders)
        if factors == (s,):
            return valid[s]
        i = factors.index(s)
        index = graph.call_function(aten.arange.default, (graph.call_function(aten.sym_size.int, (new, d)),),
                                    {"dtype": torch.int64, "device": val.device})
        for inner in factors[i + 1:]:
            index = graph.call_function(aten.div.Tensor_mode, (index, size_of(inner)), {"rounding_mode": "floor"})
        if i > 0:
            index = graph.call_function(aten.remainder.Scalar, (index, sizes[s]))
        return graph.call_function(aten.lt.Tensor, (index, lengths[s]))

    def real_count(new, val, dims):
        """The number of real (unpadded) elements over ``dims`` of ``val``: a 0-d tensor in the graph."""
        static, tensors, symbolic = 1, [], []
        for d in dims:
            held = [s for s in padded if d in _dims(val, s, orders)]
            if not held:
                e = _expr(val.shape[d])
                if isinstance(e, int):
                    static *= e
                else:
                    symbolic.append(graph.call_function(aten.sym_size.int, (new, d)))
                continue
            for factor in _factors(val.shape[d], held[0], orders):
                if isinstance(factor, int):
                    static *= factor
                elif factor in padded:
                    tensors.append(lengths[factor])
                else:
                    symbolic.append(size_of(factor))
        total = tensors[0]
        for factor in [*tensors[1:], *symbolic, static]:
            total = graph.call_function(aten.mul.Tensor, (total, factor))
        return total

    def mask_of(new, val, dims_syms):
        m = None
        for d, s in dims_syms:
            shape = [1] * val.dim()
            shape[d] = -1
            v = graph.call_function(aten.view.default, (valid_along(new, val, d, s), shape))
            m = v if m is None else graph.call_function(aten.logical_and.default, (m, v))
        return m

    def padded_dims(val):
        return [(d, s) for s in padded for d in _dims(val, s, orders)]

    def fill(new, val, dims_syms, value):
        m = mask_of(new, val, dims_syms)
        if val.dtype == torch.bool:
            return graph.call_function(aten.logical_and.default, (new, m)) if value == 0 else new
        if not (val.is_floating_point() or val.is_complex()):  # integer amax/amin: the dtype's extremes
            value = 0 if value == 0 else torch.iinfo(val.dtype).min if value < 0 else torch.iinfo(val.dtype).max
        return graph.call_function(aten.where.ScalarOther, (m, new, value))

    output_dims = []
    for node in old.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outs = node.args[0]
            for o in outs if isinstance(outs, (list, tuple)) else [outs]:
                v = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
                output_dims.append(padded_dims(v) if _tensor(v) else [])
            graph.node_copy(node, lambda a: env[a])
            break
        target = node.target
        if target in _MASKED_REDUCTIONS:
            x = node.args[0].meta["val"]
            dims = _norm_dims(node.args[1] if len(node.args) > 1 else None, x.dim())
            along = [(d, s) for d, s in padded_dims(x) if d in dims]
            if along:
                masked = fill(env[node.args[0]], x, along, _MASKED_REDUCTIONS[target])
                env[node] = graph.call_function(target, (masked, *[torch.fx.node.map_arg(a, lambda n: env[n])
                                                                    for a in node.args[1:]]),
                                                torch.fx.node.map_arg(node.kwargs, lambda n: env[n]))
        if target in _MEANS:
            x = node.args[0].meta["val"]
            dims = _norm_dims(node.args[1] if target is aten.mean.dim and len(node.args) > 1 else None, x.dim())
            along = [(d, s) for d, s in padded_dims(x) if d in dims]
            if along:
                env[node] = _mean_as_sum(graph, node, env, dims, real_count(env[node.args[0]], x, dims))
        if node not in env:
            env[node] = graph.node_copy(node, lambda a: env[a])
        val = node.meta.get("val")
        if _tensor(val) and padded_dims(val):
            env[node] = fill(env[node], val, padded_dims(val), 0)
    graph.lint()
    return torch.fx.GraphModule(aten_gm, graph), output_dims


def _mean_as_sum(graph, node, env, dims, count):
    """``mean(x, dims)`` over a padded dim as ``sum(x, dims) / real count`` (the padding is zero)."""
    keepdim = node.args[2] if node.target is aten.mean.dim and len(node.args) > 2 else node.kwargs.get("keepdim", False)
    summed = graph.call_function(aten.sum.dim_IntList, (env[node.args[0]], dims, keepdim),
                                 {"dtype": node.kwargs.get("dtype")})
    return graph.call_function(aten.div.Tensor, (summed, count))
