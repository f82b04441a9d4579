"""Dynamic dimensions in ``torch.compile(backend="tpu")``: one static program per bucket, not per size.

Dynamo hands the backend a graph with symbolic sizes (``dynamic=True``, ``torch._dynamo.mark_dynamic``,
or its automatic dynamic after a second size). XLA compiles static shapes only, so the backend returns
a :class:`DynamicGraph`: each call reads the concrete sizes and runs a static program compiled (once,
then cached) for them through the ordinary static path (AOTAutograd outside Dynamo, fresh static fake
tensors).

Where padding is provably safe, a dynamic dimension is padded with zeros up to its bucket
(:class:`tpudist.device.buckets.Buckets`) and the outputs are sliced back to the real size, so N
sizes compile O(buckets) programs. Safety is decided once per graph on its symbolic ATen graph
(Core ATen, traced with Dynamo's own fake tensors), per symbol ``s``:

- every op touching a dim of size ``s`` is row-independent along it: pointwise/broadcast ops, views
  that keep ``s`` a factor of its own (``(b, s, d) -> (b * s, d)`` is tracked as a merged dim of
  known layout), transposes, matmuls (contracting over ``s`` included), sums, means,
  softmax/log_softmax/amax/amin (rewritten, see below), layer norm over other dims, cumsum,
  embedding/gather/index_select of padded indices, slices, selects and cats along other dims;
- a size of ``s`` shapes tensors only: it is never used as a number (``x.sum() / x.size(0)``), and
  no dim is an expression of ``s`` other than ``s`` or a merged dim a view made;
- no random ops (the draws would differ from the unpadded program's), no in-place ops, no
  grad-mode or autocast switches, no higher-order ops.

The padded graph carries the real length of each padded symbol as a runtime input (a 0-d int64
tensor), so one program serves every size of a bucket. Every op result with a padded dim is set to
zero at the padding (``where(valid, x, 0)``): padding stays exactly zero in the forward,
and the backward of that ``where`` gives exactly zero gradients there, so contractions over the
padded dim (parameter gradients, ``sum``) see zeros. Means over a padded dim divide by the real
count; softmax, log_softmax and amax put ``-inf`` (amin ``+inf``) at padding first. In training, a
pointwise op that broadcasts a tensor needing grad along a padded dim must be linear in it (add,
sub, mul, where, the divisor of a div): its gradient sums over the padding, where any other
derivative may be infinite.

A symbol that fails the analysis (or a size outside the buckets) runs at its exact size: one program
per size, counted in :data:`STATS` as a fallback, never a wrong result.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from tpudist.device.buckets import Buckets

log = logging.getLogger(__name__)

aten = torch.ops.aten

DEFAULT_BUCKETS = Buckets(max_length=1024)  # 128, 256, ..., 1024; longer sizes run at their exact size


@dataclass(slots=True)
class Stats:
    """What the backend did with dynamic graphs in this process (tests and benchmarks read it)."""

    graphs: int = 0  # dynamic graphs the backend received
    programs: int = 0  # static versions compiled for them (each: a forward, and a backward when training)
    padded_programs: int = 0  # ... of which padded to a bucket
    exact_programs: int = 0  # ... of which at an exact size (nothing padded: unsafe, out of range, no buckets)
    fallbacks: list = field(default_factory=list)  # (graph, symbol, reason): symbols not padded

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in ("graphs", "programs", "padded_programs", "exact_programs")}


STATS = Stats()


def is_dynamic(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """Whether Dynamo's graph has a symbolic size: a SymInt input, or a symbolic dim of an input's
    example value (Dynamo hands real tensors as example inputs, fake ones in the placeholders' meta)."""
    fakes = [n.meta.get("val", n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"]
    for x in [*example_inputs, *fakes]:
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) and _symbolic(d) for d in x.shape):
            return True
    return False


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


# -- the plan: which symbols pad, and the padded graph ----------------------------------------------
@dataclass(frozen=True, slots=True)
class Location:
    """Where a symbol's value is read at call time: dim ``dim`` of input ``index``."""

    index: int
    dim: int


@dataclass(slots=True)
class Plan:
    symbols: dict  # padded symbol -> Location of a tensor input dim of exactly that size
    max_size: dict  # padded symbol -> the largest padded size the graph allows (a slice of a static dim)
    graph: torch.fx.GraphModule | None  # the rewritten ATen graph (None: nothing pads)
    input_dims: list  # per input: [(dim, symbol)] of padded dims (tensors), or the symbol (SymInt input) or None
    output_dims: list  # per output: [(dim, symbol)] to slice back
    unsafe: dict  # symbol -> why it is not padded


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


def _needs_grad(graph: torch.fx.Graph, fakes: list) -> set:
    """Nodes whose value depends on an input that requires grad (a floating result)."""
    out, phs = set(), [n for n in graph.nodes if n.op == "placeholder"]
    for node, fake in zip(phs, fakes):
        if _tensor(fake) and fake.requires_grad:
            out.add(node)
    for node in graph.nodes:
        if node.op == "call_function" and any(a in out for a in node.all_input_nodes):
            val = node.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else [val]
            if any(_tensor(v) and (v.is_floating_point() or v.is_complex()) for v in vals):
                out.add(node)
    return out


_GRAPH_STATE_TARGETS = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled")


def trace_aten(gm: torch.fx.GraphModule, fakes: list) -> torch.fx.GraphModule:
    """``gm`` as a symbolic Core ATen graph, traced with Dynamo's own fake tensors (sizes stay symbols)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tpudist.compile.backend import _decompositions, _math_sdpa

    from torch._subclasses.fake_tensor import FakeTensor

    # the fake values' own mode (Dynamo's tracing context may hold another one by now)
    mode = next(f.fake_mode for f in fakes if isinstance(f, FakeTensor))
    with mode, _math_sdpa():
        return make_fx(gm, decomposition_table=_decompositions())(*fakes)


def plan(gm: torch.fx.GraphModule, buckets: Buckets | None) -> Plan:
    """Which symbols of ``gm`` pad (and the padded graph), or why not."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta.get("val", n.meta.get("example_value")) for n in phs]
    symbols: dict = {}
    all_symbols: set = set()
    for i, f in enumerate(fakes):
        if isinstance(f, torch.SymInt) and _symbolic(f):
            all_symbols |= f.node.expr.free_symbols
        if _tensor(f):
            for d, size in enumerate(f.shape):
                e = _expr(size)
                if isinstance(e, int):
                    continue
                all_symbols |= e.free_symbols
                if e.is_Symbol and e not in symbols:
                    symbols[e] = Location(i, d)
    unsafe = {s: "not the size of an input dim of its own (an int argument or a size expression)"
              for s in all_symbols - set(symbols)}
    nothing = Plan({}, {}, None, [], [], unsafe)
    if buckets is None:
        nothing.unsafe.update({s: "no buckets (options={'buckets': None})" for s in symbols})
        return nothing
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and (name in _GRAPH_STATE_TARGETS
                                            or isinstance(node.target, torch._ops.HigherOrderOperator)):  # noqa: SLF001
            nothing.unsafe.update({s: f"the graph calls {name or node.target} (grad mode, autocast or a "
                                      "higher-order op), which a retrace of its ATen ops would not keep"
                                   for s in symbols})
            return nothing
        if node.op == "call_module":
            nothing.unsafe.update({s: f"the graph calls module {node.target}" for s in symbols})
            return nothing
    if any(f is None for f in fakes):
        nothing.unsafe.update({s: "an input has no fake value" for s in symbols})
        return nothing
    try:
        aten_gm = trace_aten(gm, fakes)
    except Exception as e:  # noqa: BLE001 - any graph the symbolic trace cannot take runs at exact sizes
        nothing.unsafe.update({s: f"symbolic ATen trace failed: {type(e).__name__}: {e}" for s in symbols})
        return nothing
    analysis = _Analysis(aten_gm.graph, _needs_grad(aten_gm.graph, fakes), set(symbols))
    analysis.run(list(symbols))
    unsafe.update(analysis.unsafe)
    padded = {s: loc for s, loc in symbols.items() if s not in unsafe}
    if not padded:
        return Plan({}, {}, None, [], [], unsafe)
    graph, output_dims = _rewrite(aten_gm, padded, symbols, analysis.orders)
    input_dims = []
    for f in fakes:
        if _tensor(f):
            input_dims.append([(d, s) for s in padded for d in _dims(f, s)])
        elif isinstance(f, torch.SymInt) and _expr(f) in padded:
            input_dims.append(_expr(f))
        else:
            input_dims.append(None)
    return Plan(padded, {s: analysis.max_size[s] for s in padded if s in analysis.max_size}, graph, input_dims,
                output_dims, unsafe)


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


# -- the callable the backend returns ---------------------------------------------------------------
def _specialize(gm: torch.fx.GraphModule, ints: dict[int, int], scalars: dict | None = None) -> torch.fx.GraphModule:
    """``gm`` with its SymInt inputs (by position) replaced by their values, and the ``.item()`` of
    0-d inputs (``scalars``: position -> value; Dynamo passes float attributes so under
    ``dynamic=True``) by theirs: a static graph."""
    graph = copy.deepcopy(gm.graph)
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    for i, value in (scalars or {}).items():
        for user in list(phs[i].users):
            if _reads_value(user):
                user.replace_all_uses_with(value)
                graph.erase_node(user)
    for i, value in ints.items():
        phs[i].replace_all_uses_with(value)
        graph.erase_node(phs[i])
    for node in graph.nodes:  # symbolic values of the dynamic trace: stale here (split_module reads them)
        node.meta.pop("val", None)
        node.meta.pop("example_value", None)
    return torch.fx.GraphModule(gm, graph)


def _reads_value(node: torch.fx.Node) -> bool:
    """``x.item()``: in a Dynamo graph, or in an ATen graph."""
    return (node.op == "call_method" and node.target == "item") or node.target is aten._local_scalar_dense.default


def _scalar_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of inputs whose value the graph reads with ``.item()``."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(phs) if any(_reads_value(u) for u in n.users)]


class DynamicGraph:
    """What the backend returns for a graph with dynamic sizes: static programs per bucket (or size).

    ``programs`` maps each static version's key to its compiled callable; ``num_padded`` and
    ``num_exact`` count them; ``plan.unsafe`` says why a symbol is not padded.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, compile_static, buckets: Buckets | None,
                 name: str = "graph"):
        self._gm = gm
        self._compile = compile_static  # (gm, example inputs) -> callable, the static path
        self.buckets = buckets
        self.name = name
        self.plan = plan(gm, buckets)
        # 0-d inputs read with .item() (dynamic=True passes float attributes so): their values are
        # constants of each program, part of its key
        self._scalars = _scalar_inputs(self.plan.graph) if self.plan.graph is not None else []
        self._exact_scalars = _scalar_inputs(gm)
        self.programs: dict = {}
        self.num_padded = 0
        self.num_exact = 0
        STATS.graphs += 1
        for s, why in self.plan.unsafe.items():
            STATS.fallbacks.append((name, str(s), why))
            log.info("tpudist.compile: %s: dim %s runs at exact sizes: %s", name, s, why)

    def _sizes(self, args) -> dict:
        """(real size, program size, padded?) per padded symbol for this call: its bucket, or the
        largest size the graph allows if smaller (a slice of a static dim: ``pos[:t]``); a size
        beyond the buckets stays exact."""
        out = {}
        for s, loc in self.plan.symbols.items():
            n = int(args[loc.index].shape[loc.dim])
            limit = self.plan.max_size.get(s)
            if n > self.buckets.max_length:
                size = n
            else:
                size = self.buckets.size_for(n) if limit is None else min(self.buckets.size_for(n), limit)
            out[s] = (n, size, n <= self.buckets.max_length)
        return out

    def __call__(self, *args):
        sizes = self._sizes(args) if self.plan.graph is not None else {}
        if any(padded for _, _, padded in sizes.values()):
            return self._run_padded(args, sizes)
        return self._run_exact(args)

    def _run_exact(self, args):
        scalars = {i: args[i].item() for i in self._exact_scalars}
        key = ("exact", *[tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args], *sorted(scalars.items()))
        fn = self.programs.get(key)
        if fn is None:
            ints = {i: int(a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            fn = self._compile(_specialize(self._gm, ints, scalars), tensors)
            self.programs[key] = fn
            self.num_exact += 1
            STATS.programs += 1
            STATS.exact_programs += 1
        return fn(*[a for a in args if isinstance(a, torch.Tensor)])

    def _run_padded(self, args, sizes):
        plan = self.plan
        inputs, ints = [], {}
        for i, (a, dims) in enumerate(zip(args, plan.input_dims)):
            if isinstance(a, torch.Tensor):
                for d, s in dims or []:
                    a = _pad(a, d, sizes[s][1])
                inputs.append(a)
            else:
                ints[i] = sizes[dims][1] if dims is not None else int(a)
        lengths = [torch.tensor(sizes[s][0], dtype=torch.int64) for s in plan.symbols]
        scalars = {i: args[i].item() for i in self._scalars}
        key = ("padded", *[tuple(a.shape) for a in inputs], *sorted(ints.items()), *sorted(scalars.items()))
        fn = self.programs.get(key)
        if fn is None:
            fn = self._compile(_specialize(plan.graph, ints, scalars), [*inputs, *lengths])
            self.programs[key] = fn
            self.num_padded += 1
            STATS.programs += 1
            STATS.padded_programs += 1
        outs = fn(*inputs, *lengths)
        result = []
        for out, dims in zip(outs, plan.output_dims):
            for d, s in dims:
                out = out.narrow(d, 0, sizes[s][0])
            result.append(out)
        return result


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    have = x.shape[dim]
    if have == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - have
    return torch.cat([x, x.new_zeros(shape)], dim=dim)
