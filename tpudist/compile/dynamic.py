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
  autocast switches, no higher-order ops. A ``torch.no_grad()`` region (Hugging Face's rotary
  embeddings have one) is kept as a detach of each tensor entering it: the ATen retrace drops grad
  mode, a detach it keeps; ``enable_grad`` inside a graph traced without grad is not padded.

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

The analysis is in :mod:`tpudist.compile._pad_analysis`, the padded graph's rewrite in
:mod:`tpudist.compile._pad_rewrite`; this module holds the plan and the callable the backend returns.
"""

from __future__ import annotations

import copy
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from tpudist.compile._pad_analysis import _Analysis, _dims, _expr, _needs_grad, _symbolic, _tensor, trace_aten
from tpudist.compile._pad_rewrite import _rewrite
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


_GRAPH_STATE_TARGETS = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled")


def _detach_no_grad_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``gm`` with each no-grad region as detaches of the tensors entering it, its switches removed.

    Dynamo records ``torch.no_grad()`` entered with grad on as ``_set_grad_enabled(False)`` ...
    ``_set_grad_enabled(True)`` (nothing when grad is off already). Values computed from detached
    tensors need no grad, as the region's results in eager, so the graph gives the same values and
    gradients, and its ATen retrace (which drops grad-mode switches) keeps the detaches. In-place ops,
    whose effect a detach would not carry, make the analysis refuse the graph anyway. None: the graph
    switches grad mode some other way (``enable_grad`` with grad off, a mode that is not a constant),
    or a region reads a value that is neither a tensor nor free of tensors (a tuple of an op's results).
    """
    graph = copy.deepcopy(gm.graph)
    disabled = False
    inside: set = set()  # nodes computed in the current no-grad region
    detached: dict = {}  # outside node -> its detach, for the current region
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:  # noqa: SLF001
            mode = node.args[0] if len(node.args) == 1 and not node.kwargs else None
            if not isinstance(mode, bool) or (mode and not disabled):
                return None
            disabled = not mode
            inside, detached = set(), {}
            graph.erase_node(node)
            continue
        if not disabled or node.op == "output":
            continue
        entering = [a for a in node.all_input_nodes if a not in inside]
        for arg in entering:
            value = _value(gm, arg)
            if value is _MISSING or (not _tensor(value) and _holds_tensors(value)):
                return None
            if _tensor(value) and arg not in detached:
                with graph.inserting_before(node):
                    detached[arg] = graph.call_method("detach", (arg,))
        node.args, node.kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda a: detached.get(a, a))
        inside.add(node)
    return torch.fx.GraphModule(gm, graph)


_MISSING = object()


def _value(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """A Dynamo graph node's (fake) value: its meta, or the module's attribute of a ``get_attr``."""
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    return node.meta.get("example_value", node.meta.get("val", _MISSING))


def _holds_tensors(value) -> bool:
    return any(isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(value))  # noqa: SLF001


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
    if any(n.target is torch._C._set_grad_enabled for n in gm.graph.nodes):  # noqa: SLF001
        gm = _detach_no_grad_regions(gm) or gm
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
