"""The padding analysis of :mod:`tpudist.compile.dynamic`: per symbolic size, whether every op of a
symbolic Core ATen graph is row-independent along it, so that padding it to a bucket is safe (the rules
are in that module's docstring). :class:`_Analysis` records why a symbol is not padded, the largest size
a slice allows, and the layout of dims that views merge with static sizes (``orders``)."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from tpudist.compile.decompositions import decompositions, math_sdpa

aten = torch.ops.aten


def _symbolic(size) -> bool:
    try:
        return not (size.node.is_constant() or size.node.maybe_as_int() is not None)
    except AttributeError:
        return False


def _expr(size):
    """The sympy expression of a size (an int for a static one)."""
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return int(size)


# Where an op may take a size of a padded symbol: as a shape, never as a value (the argument
# positions that are sizes; the padded program sees the padded size there).
_SHAPE_ARGS = {
    aten.view.default: (1,), aten._unsafe_view.default: (1,), aten.reshape.default: (1,),
    aten.expand.default: (1,), aten.view_copy.default: (1,), aten.expand_copy.default: (1,),
    aten.arange.default: (0,), aten.arange.start: (1,), aten.arange.start_step: (1,),
    aten.full.default: (0,), aten.zeros.default: (0,), aten.ones.default: (0,), aten.empty.memory_format: (0,),
    aten.empty_strided.default: (0, 1), aten.new_zeros.default: (1,), aten.new_ones.default: (1,),
    aten.new_full.default: (1,), aten.new_empty.default: (1,), aten.slice.Tensor: (3,),
}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default}
_SAME_LAYOUT = {aten.clone.default, aten._to_copy.default, aten.detach.default, aten.alias.default,
                aten.lift_fresh_copy.default, aten.contiguous.default}
_REARRANGE = {aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default,
              aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
              aten.permute_copy.default, aten.expand_copy.default, aten.unsqueeze_copy.default,
              aten.squeeze_copy.dim, aten.transpose_copy.int}
_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
              aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.new_zeros.default,
              aten.new_ones.default, aten.new_full.default, aten.new_empty.default, aten.full_like.default,
              aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.scalar_tensor.default,
              aten.empty_strided.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_CONTRACTIONS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.dot.default}
_SUMS = {aten.sum.dim_IntList, aten.sum.default,  # padding is zero (False for any)
         aten.any.dim, aten.any.dims, aten.any.default}
_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int}
_MEANS = {aten.mean.dim, aten.mean.default}
_MASKED_REDUCTIONS = {aten._softmax.default: float("-inf"), aten._log_softmax.default: float("-inf"),
                      aten.amax.default: float("-inf"), aten.amin.default: float("inf")}
# Pointwise ops whose gradient with respect to an operand broadcast along a padded dim is a sum of
# finite terms over the padding: the derivative is 1, -1 or the other (finite, zero) operand.
_LINEAR_BROADCAST = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.rsub.Tensor, aten.where.self,
                     aten.maximum.default, aten.minimum.default}


def _tensor(val) -> bool:
    return isinstance(val, torch.Tensor)


def _dims(val, s, orders=None) -> list[int]:
    """Dims of ``val`` of size ``s``, or of a size ``k*s`` whose layout (``orders``) a view set."""
    if not _tensor(val):
        return []
    return [i for i, d in enumerate(val.shape) if _expr(d) == s or (orders and (s, _expr(d)) in orders)]


def _factors(size, s, orders) -> tuple:
    """The factors of a dim holding ``s``, outer to inner (static sizes and symbols): ``(s,)`` for a
    dim of size ``s``, e.g. ``(2, s)`` for ``x.view(2 * s, ...)`` of a ``(2, s, ...)`` tensor."""
    e = _expr(size)
    return (s,) if e == s else orders[(s, e)]


def _mixes(val, s, orders=None) -> Any:
    """A size of ``val`` that is an expression of ``s`` other than ``s`` or a known ``k*s`` (or None)."""
    sizes = list(val.shape) if _tensor(val) else [val] if isinstance(val, torch.SymInt) else []
    for d in sizes:
        e = _expr(d)
        if not isinstance(e, int) and s in e.free_symbols and e != s and not (
                _tensor(val) and orders and (s, e) in orders):
            return e
    if isinstance(val, (torch.SymFloat, torch.SymBool)) and s in val.node.expr.free_symbols:
        return val.node.expr
    return None


def _atoms(val, s, orders) -> list | None:
    """``val``'s shape as a sequence of factors, outer to inner: ``s`` whole, static sizes, other symbols."""
    out = []
    for d in val.shape:
        e = _expr(d)
        if isinstance(e, int) or (s not in e.free_symbols and e.is_Symbol):
            out.append(e)
        elif s not in e.free_symbols:  # another symbol's merged dim: its layout if a view set one
            known = [f for (t, merged), f in orders.items() if merged == e]
            out += list(known[0]) if known else [e]
        elif e == s:
            out.append(s)
        elif (s, e) in orders:
            out += list(orders[(s, e)])
        else:
            return None
    return out


def _view_layout(src, dst, s, orders, located) -> str | None:
    """Checks that a view keeps ``s`` a factor of its own (static sizes may split and merge around
    it) and records the layout of each dim of the result that merges ``s`` with static sizes."""
    import sympy

    atoms = _atoms(src, s, orders)
    if atoms is None:
        return f"view of a dim whose layout around {s} is not known"
    atoms = [a for a in atoms if a != 1]
    for d in dst.shape:
        want, group = sympy.sympify(_expr(d)), []
        while sympy.sympify(math.prod(group)) != want:
            rest = sympy.simplify(want / math.prod(group))
            coeff = rest.as_coeff_Mul()[0]
            atom = atoms[0] if atoms else None
            if isinstance(atom, int) and coeff.is_Integer and int(coeff) % atom == 0:
                group.append(atoms.pop(0))
            elif isinstance(atom, int) and not rest.free_symbols and atom % int(coeff) == 0:
                group.append(int(coeff))  # a static size splits
                atoms[0] = atom // int(coeff)
            elif atom is not None and not isinstance(atom, int) and (atom in rest.free_symbols or atom == rest):
                group.append(atoms.pop(0))
            else:
                return f"view {tuple(src.shape)} -> {tuple(dst.shape)} does not keep {s} a factor of its own"
        if s in group and len(group) > 1:
            if any(not isinstance(a, int) and not (a.is_Symbol and a in located) for a in group):
                return f"view merges {s} with a size that is not an input dim of its own"
            layout = tuple(group)
            if orders.setdefault((s, want), layout) != layout:
                return f"dims of size {want} put {s} in two layouts"
    return None


_dims_of = _dims


def _nodes_in(arg) -> list:
    out: list = []
    torch.fx.node.map_arg(arg, out.append)
    return out


def _free(val) -> set:
    if not _tensor(val):
        return set()
    out = set()
    for d in val.shape:
        e = _expr(d)
        if not isinstance(e, int):
            out |= e.free_symbols
    return out


def _norm_dims(dims, rank) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return [d % rank if rank else 0 for d in dims]


class _Analysis:
    """Decides, per symbol, whether padding it is safe (see the module docstring)."""

    def __init__(self, graph: torch.fx.Graph, needs_grad: set, located: set):
        self.graph = graph
        self.located = located  # symbols that are the size of an input dim
        self.needs_grad = needs_grad
        self.unsafe: dict = {}
        self.max_size: dict = {}
        self.orders: dict = {}  # (symbol, k*symbol) -> (static size outside, inside): set by views

    def no(self, s, node, why: str) -> None:
        if s not in self.unsafe:
            from tpudist.compile.errors import user_line

            self.unsafe[s] = f"{why} (node {node.name}: {node.target}, from {user_line(node)})"

    def run(self, symbols) -> None:
        for node in self.graph.nodes:
            for s in symbols:
                if s not in self.unsafe:
                    self.check(node, s)

    def check(self, node, s) -> None:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if _mixes(val, s) is not None:
                self.no(s, node, f"input size {_mixes(val, s)} is an expression of {s}")
            return
        if node.op == "get_attr":
            return
        if node.op == "output":
            for out in node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
                v = out.meta.get("val") if isinstance(out, torch.fx.Node) else out
                if _tensor(v) and any(_expr(v.shape[i]) != s for i in _dims(v, s, self.orders)):
                    self.no(s, node, f"the graph returns a tensor of shape {tuple(v.shape)}: {s} merged into a dim")
                if isinstance(out, torch.fx.Node) and out.op == "placeholder" and _dims(v, s):
                    self.no(s, node, f"the graph returns its input {out.name} (the padded copy would not alias it)")
                if not _tensor(v) and isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) \
                        and s in v.node.expr.free_symbols:
                    self.no(s, node, f"the graph returns a size ({v}) of {s}")
            return
        inputs = [a for a in node.all_input_nodes]
        in_vals = [a.meta.get("val") for a in inputs]
        if node.target in _VIEWS and _tensor(val) and (s in _free(val) or s in _free(in_vals[0])):
            why = _view_layout(in_vals[0], val, s, self.orders, self.located)
            if why:
                self.no(s, node, why)
                return
        target = node.target
        # a size of s (or an expression of it) used as a number rather than as a shape
        if not isinstance(val, torch.SymInt):
            allowed = _SHAPE_ARGS.get(target, ())
            for i, arg in enumerate([*node.args, *node.kwargs.values()]):
                for a in _nodes_in(arg):
                    av = a.meta.get("val")
                    if isinstance(av, torch.SymInt) and not isinstance(_expr(av), int) \
                            and s in _expr(av).free_symbols and i not in allowed:
                        self.no(s, node, f"size {av} is used as a value")
                        return
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            # size arithmetic: fine while it only shapes tensors (their sizes are checked)
            if not isinstance(val, torch.SymInt) and s in val.node.expr.free_symbols:
                self.no(s, node, f"size arithmetic on {s} ({val})")
            return
        for v in [val, *in_vals]:
            e = _mixes(v, s, self.orders) if _tensor(v) else None
            if e is not None:
                self.no(s, node, f"size {e} mixes {s} with other sizes (flatten, cat or arithmetic on the padded dim)")
                return
        touched = any(_dims(v, s, self.orders) for v in [val, *in_vals] if _tensor(v)) or (
            isinstance(val, (tuple, list)) and any(_dims(v, s, self.orders) for v in val if _tensor(v)))
        if not touched:
            return
        if isinstance(target, torch._ops.HigherOrderOperator):  # noqa: SLF001
            self.no(s, node, "higher-order op")
            return
        if target is operator.getitem:
            return
        if not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
            self.no(s, node, "not an ATen op")
            return
        if target._schema.is_mutable:  # noqa: SLF001
            self.no(s, node, "in-place op")
            return
        if torch.Tag.nondeterministic_seeded in target.tags:
            self.no(s, node, "random op: padded draws differ from the unpadded program's")
            return
        why = self.rule(node, target, s, val, in_vals)
        if why:
            self.no(s, node, why)

    def rule(self, node, target, s, val, in_vals) -> str | None:  # noqa: PLR0911, PLR0912
        def _dims(v, s):  # noqa: F811 - merged dims of a known layout count as padded dims
            return _dims_of(v, s, self.orders)

        args = node.args
        x = args[0].meta.get("val") if args and isinstance(args[0], torch.fx.Node) else None
        if target in _ARANGES:
            end = args[0] if target is aten.arange.default else args[1]
            e = _expr(end.meta["val"]) if isinstance(end, torch.fx.Node) else end
            if not isinstance(e, int) and e != s:  # values i = 0..k*P-1 would differ from 0..k*n-1
                return f"arange of size {e}"
        if target in _FACTORIES or target in _SAME_LAYOUT or target in _REARRANGE or target in _SUMS \
                or target in _MEANS or target in _CONTRACTIONS or target is aten.sym_size.int:
            return None
        if torch.Tag.pointwise in target.tags:
            want = set(_dims(val, s))
            for a in node.all_input_nodes:
                av = a.meta.get("val")
                if not _tensor(av) or a not in self.needs_grad or not want:
                    continue
                offset = val.dim() - av.dim()  # broadcasting aligns trailing dims
                broadcast = any(i < offset or (i - offset) not in _dims(av, s) for i in want)
                if not broadcast:
                    continue
                if target in _LINEAR_BROADCAST:
                    continue
                if target in (aten.div.Tensor,) and len(args) > 1 and args[1] is a and args[0] is not a:
                    continue
                return (f"{target} broadcasts {a.name} (needs grad) along {s}: its gradient sums over the padding "
                        "a derivative that may be infinite there")
            return None
        if target in _VIEWS:
            return None  # checked (and its layout recorded) before
        if target in _MASKED_REDUCTIONS:
            return None
        if target is aten.native_layer_norm.default:
            normalized = len(args[1])
            return f"layer norm over {s}" if any(d >= x.dim() - normalized for d in _dims(x, s)) else None
        if target is aten.cumsum.default:
            return None  # prefix sums: right padding comes after every real position
        if target is aten.embedding.default:
            return f"embedding table sized by {s}" if _dims(x, s) else None
        if target in (aten.index_select.default, aten.gather.default, aten.select.int):
            dim = args[1] % max(x.dim(), 1)
            index = args[2].meta.get("val") if isinstance(args[2], torch.fx.Node) else None
            along = dim in _dims(x, s) or (target is aten.gather.default and dim in _dims(index, s))
            return f"{target} along {s}" if along else None
        if target in _SPLITS:
            dim = (args[2] if target is not aten.unbind.int and len(args) > 2 else
                   args[1] if target is aten.unbind.int and len(args) > 1 else 0) % max(x.dim(), 1)
            return f"{target} along {s}" if dim in _dims(x, s) else None
        if target is aten.cat.default:
            dim = (args[1] if len(args) > 1 else 0) % max(val.dim(), 1)
            if dim not in _dims(val, s):
                return None
            # along s only onto empty tensors (a KV cache's first update: cat([empty, k], dim=-2))
            parts = [a.meta.get("val") for a in args[0]]
            empty = [p for p in parts if (p.dim() == val.dim() and _expr(p.shape[dim]) == 0)
                     or (p.dim() == 1 and _expr(p.shape[0]) == 0)]  # cat skips 1-d empty tensors
            return None if len(empty) == len(parts) - 1 else f"cat along {s}"
        if target is aten.slice.Tensor:
            dim = (args[1] if len(args) > 1 else 0) % max(x.dim(), 1)
            start = args[2] if len(args) > 2 else None
            end = args[3] if len(args) > 3 else None
            step = args[4] if len(args) > 4 else 1
            end_expr = _expr(end.meta["val"]) if isinstance(end, torch.fx.Node) else end
            if dim in _dims(x, s):
                full = start in (None, 0) and step == 1 and (end_expr is None or end_expr == s
                                                              or (isinstance(end_expr, int) and end_expr >= 2 ** 62))
                return None if full else f"slice along {s}"
            if dim in _dims(val, s):  # x[:s] of a static dim: the padded size must fit in it
                if start not in (None, 0) or step != 1:
                    return f"slice of size {s} with start={start}, step={step}"
                limit = int(x.shape[dim])
                self.max_size[s] = min(self.max_size.get(s, limit), limit)
            return None
        return f"{target} is not known to be row-independent along {s}"


# ops whose result needs no grad whatever their input's: the ATen retrace keeps them (trace_aten)
_GRADIENT_STOPS = frozenset({aten.detach.default})


def _needs_grad(graph: torch.fx.Graph, fakes: list) -> set:
    """Nodes whose value depends on an input that requires grad (a floating result), not through a detach."""
    out, phs = set(), [n for n in graph.nodes if n.op == "placeholder"]
    for node, fake in zip(phs, fakes):
        if _tensor(fake) and fake.requires_grad:
            out.add(node)
    for node in graph.nodes:
        if node.target in _GRADIENT_STOPS:
            continue
        if node.op == "call_function" and any(a in out for a in node.all_input_nodes):
            val = node.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else [val]
            if any(_tensor(v) and (v.is_floating_point() or v.is_complex()) for v in vals):
                out.add(node)
    return out


def trace_aten(gm: torch.fx.GraphModule, fakes: list) -> torch.fx.GraphModule:
    """``gm`` as a symbolic Core ATen graph, traced with Dynamo's own fake tensors (sizes stay symbols)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import make_fx

    # the fake values' own mode (Dynamo's tracing context may hold another one by now)
    mode = next(f.fake_mode for f in fakes if isinstance(f, FakeTensor))
    # detach stays itself: Core ATen's alias for it would let the padded graph's gradients through
    table = {op: fn for op, fn in decompositions().items() if op not in _GRADIENT_STOPS}
    with mode, math_sdpa():
        return make_fx(gm, decomposition_table=table)(*fakes)
