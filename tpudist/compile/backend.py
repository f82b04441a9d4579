"""The Dynamo backend: Dynamo graph -> AOTAutograd (Core ATen, min-cut) -> one XLA program per graph.

``backend(gm, example_inputs, options=None)`` is what ``torch.compile(model, backend="tpu")`` calls.
Options (``torch.compile(..., options={...})``):

- ``on_missing_op``: ``"raise"`` (default) raises :class:`MissingOpError` naming the op and the user
  line; ``"graph_break"`` splits the graph around the torch code that needs the op and runs that code
  eagerly in torch (with a warning), compiling the rest.
- ``xla_options``: a dict of XLA compiler options for these programs only (e.g.
  ``{"xla_cpu_multi_thread_eigen": False}``), part of the program key.
- ``buckets``: a :class:`tpudist.device.buckets.Buckets` for dynamic dims (``dynamic=True``,
  ``mark_dynamic``, Dynamo's automatic dynamic): sizes pad up to a bucket where the graph allows it
  (``tpudist.compile.dynamic``), one program per bucket. Default ``Buckets(max_length=1024)``
  (multiples of 128); ``None``: one program per size.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.fx

from tpudist.compile.dynamic import DEFAULT_BUCKETS, DynamicGraph, is_dynamic
from tpudist.compile.decompositions import attention_as_eager, corrected_decompositions, decompositions
from tpudist.compile.errors import MissingOpError, UnsupportedGraph, dynamo_sources, user_line
from tpudist.device.buckets import Buckets

_ON_MISSING = ("raise", "graph_break")
_KNOWN = ("on_missing_op", "xla_options", "buckets")


@dataclass(frozen=True, slots=True)
class Options:
    on_missing_op: str = "raise"
    xla_options: tuple = ()  # sorted (name, value) pairs
    buckets: Buckets | None = DEFAULT_BUCKETS

    @classmethod
    def from_dict(cls, options: dict | None) -> "Options":
        options = dict(options or {})
        unknown = sorted(set(options) - set(_KNOWN))
        if unknown:
            raise ValueError(f"torch.compile(backend='tpu') options {unknown} are not known; "
                             f"the backend takes: {', '.join(_KNOWN)}")
        value = options.get("on_missing_op", "raise")
        if value not in _ON_MISSING:
            raise ValueError(f"on_missing_op={value!r} must be one of {_ON_MISSING}")
        xla = options.get("xla_options") or {}
        if not isinstance(xla, dict):
            raise TypeError(f"xla_options={xla!r} must be a dict of XLA compiler option names to values")
        buckets = options.get("buckets", DEFAULT_BUCKETS)
        if buckets is not None and not isinstance(buckets, Buckets):
            raise TypeError(f"buckets={buckets!r} must be a tpudist.device.buckets.Buckets (e.g. "
                            "Buckets(max_length=1024)) or None (one program per size)")
        return cls(on_missing_op=value, xla_options=tuple(sorted(xla.items())), buckets=buckets)

    def as_dict(self) -> dict:
        return {"on_missing_op": self.on_missing_op, "xla_options": dict(self.xla_options), "buckets": self.buckets}


def backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
            mode: str | None = None):
    """The ``torch.compile`` backend: a callable running ``gm`` as XLA programs (forward, backward).

    Example:
        >>> step = torch.compile(loss_fn, backend="tpu", fullgraph=True, dynamic=False)  # doctest: +SKIP
        >>> torch.compile(fn, backend="tpu", options={"on_missing_op": "graph_break"})    # doctest: +SKIP

    A graph with dynamic sizes becomes a :class:`tpudist.compile.dynamic.DynamicGraph`: static
    programs compiled per call for the sizes it meets, padded to ``options["buckets"]`` where that
    is safe (docs/compile_dynamic.md).

    Raises:
        MissingOpError: an op of the graph has no lowering (names the op and the model line).
        UnsupportedGraph: inputs on another device, ...
    """
    opts = Options.from_dict(options)
    _lower_dynamo_prims()
    if mode not in (None, "default"):
        warnings.warn(f"torch.compile(backend='tpu') ignores mode={mode!r}", stacklevel=2)
    check_devices(gm, example_inputs)
    if is_dynamic(gm, example_inputs):
        return DynamicGraph(gm, example_inputs, functools.partial(_static, opts=opts), opts.buckets,
                            name=_graph_name(gm))
    return _static(gm, example_inputs, opts)


def _static(gm: torch.fx.GraphModule, example_inputs: list, opts: Options):
    """XLA programs for a graph of static shapes (forward, backward)."""
    check_static(gm, example_inputs)
    try:
        return _aot(gm, example_inputs, opts)
    except MissingOpError as e:
        if opts.on_missing_op != "graph_break":
            raise
        return _split(gm, example_inputs, e, opts)


def _graph_name(gm: torch.fx.GraphModule) -> str:
    inputs = [_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return f"graph({', '.join(inputs[:4])}{', ...' if len(inputs) > 4 else ''})"


@functools.cache
def _lower_dynamo_prims() -> None:
    """Lowerings of the ops Dynamo itself writes into graphs from ``torch._inductor.inductor_prims``.

    torch 2.13's Dynamo traces ``addcmul(x, t1, t2, value=v)`` as ``prims.fma(t1 * t2, v, x)`` (every
    compiled Adam/AdamW step has it). That op is defined by ``torch._inductor.inductor_prims``, which
    ``tpudist.ops`` cannot name at import without loading Inductor; it joins the table here, as
    the table's addcmul (``c + a * b``, rounded as torch's CPU addcmul rounds: the eager step it
    stands for)."""
    import torch._inductor.inductor_prims  # noqa: F401 - defines torch.ops.prims.fma

    from tpudist.ops import lowering_for, lowers

    addcmul = lowering_for(torch.ops.aten.addcmul.default)

    @lowers(torch.ops.prims.fma.default)
    def fma(a, b, c):
        return addcmul(c, a, b)


def check_devices(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """UnsupportedGraph naming the first input on a device other than the CPU and "tpu"."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example_inputs):
        if isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "tpu"):
            raise UnsupportedGraph(
                f"torch.compile(backend='tpu') takes CPU or 'tpu' device tensors: input {_source_name(node)} is on "
                f"device={x.device}; move it with .cpu() or .to('tpu')")


def check_static(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """UnsupportedGraph naming the first dynamic input dimension of a graph the static path was given.

    Dynamic graphs go to :class:`DynamicGraph`, which hands this path static graphs only: this is
    the check that it did."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    advice = ("the backend compiles dynamic graphs through tpudist.compile.dynamic (one static program per "
              "bucket or size); a dynamic size reaching the static path is a bug in it. Pass dynamic=False "
              "to torch.compile to avoid dynamic graphs altogether")
    for node, x in zip(placeholders, example_inputs):
        source = _source_name(node)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UnsupportedGraph(f"torch.compile(backend='tpu'): input {source} is dynamic ({x}) in a static "
                                   f"program; {advice}")
        if isinstance(x, torch.Tensor):
            for dim, size in enumerate(x.shape):
                if isinstance(size, torch.SymInt) and not _is_concrete(size):
                    raise UnsupportedGraph(
                        f"torch.compile(backend='tpu'): input {source} dim {dim} is dynamic (size={size}, "
                        f"shape={tuple(x.shape)}) in a static program; {advice}")


def _is_concrete(size) -> bool:
    try:
        return size.node.is_constant() or size.node.maybe_as_int() is not None
    except AttributeError:
        return False


def _source_name(node: torch.fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None or not hasattr(source, "name"):
        return node.name
    base, idx = getattr(source, "base", None), getattr(source, "idx", None)
    if base is not None and isinstance(idx, int) and "size" in str(getattr(source, "prop", "size")).lower():
        return f"{base.name} dim {idx}"  # a size Dynamo passes as its own input: L['x'].size()[0]
    return source.name


# -- AOTAutograd ------------------------------------------------------------------------------------
def missing_ops(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Nodes whose op has neither a lowering nor a torch decomposition (checked before tracing)."""
    from tpudist.ops import decomposition_for, lowering_for

    missing = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
            continue
        if target.namespace == "_c10d_functional":
            continue
        if lowering_for(target) is None and decomposition_for(target) is None:
            missing.append(node)
    return missing


def raise_if_missing(graph: torch.fx.Graph) -> None:
    nodes = missing_ops(graph)
    if nodes:
        error = MissingOpError(nodes[0].target, user_line(nodes[0]),
                               [(n.target, user_line(n)) for n in nodes])
        error.dynamo_nodes = set().union(*(dynamo_sources(n) for n in nodes))
        raise error


def _partition(joint, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from tpudist.compile.program import host_constants, mark_saved

    raise_if_missing(joint.graph)  # forward and backward ops, before anything is compiled
    graphs = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    for gm in graphs:
        host_constants(gm)
    mark_saved(*graphs, kwargs["num_fwd_outputs"])
    return graphs


def _compiler(kind: str, opts: Options):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list):
        from tpudist.compile import collectives
        from tpudist.compile.program import GraphProgram

        raise_if_missing(gm.graph)
        return GraphProgram(gm, list(example_inputs), name=kind, collectives=collectives.for_graph(gm),
                            xla_options=dict(opts.xla_options))

    return compile_graph


def _aot(gm: torch.fx.GraphModule, example_inputs: list, opts: Options):
    from torch._dynamo.backends.common import aot_autograd

    compiler = aot_autograd(
        fw_compiler=_compiler("forward", opts),
        bw_compiler=_compiler("backward", opts),
        inference_compiler=_compiler("inference", opts),
        partition_fn=_partition,
        decompositions=decompositions(fused_attention=True),
    )
    # effect tokens (torch.linalg.inv's error check runs under with_effects) made and sunk inside the
    # graph, as inductor has them: lifted, they are program inputs that arrive as None at run time
    with (attention_as_eager(gm), corrected_decompositions(),  # the joint graph (forward and backward) is traced here
          torch._functorch.config.patch(unlift_effect_tokens=True)):  # noqa: SLF001
        return compiler(gm, example_inputs)


# -- graph_break: split around the code that needs a missing op ------------------------------------
def _split(gm: torch.fx.GraphModule, example_inputs: list, error: MissingOpError, opts: Options):
    from torch.fx.passes.split_module import split_module

    eager_names = set(getattr(error, "dynamo_nodes", set()))
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if not eager_names & {n.name for n in calls}:
        raise UnsupportedGraph(f"{error}\n(on_missing_op='graph_break' could not tell which torch call needs "
                               "the op; it cannot split this graph)") from error
    warnings.warn(f"torch.compile(backend='tpu'): running {sorted(eager_names & {n.name for n in calls})} "
                  f"eagerly in torch (on_missing_op='graph_break'): {error.ops_and_lines}", stacklevel=3)
    partition, kinds, current, previous = {}, {}, 0, None
    for node in calls:
        eager = node.name in eager_names
        if previous is not None and eager != previous:
            current += 1
        partition[node.name] = current
        kinds[current] = eager
        previous = eager
    split = split_module(gm, None, lambda n: partition[n.name], keep_original_order=True)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)  # noqa: SLF001

    class _CompileSubmodules(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            sub = self.fetch_attr(target)
            index = int(target.rsplit("_", 1)[1])
            if kinds[index]:
                return sub(*args, **kwargs)
            # AOTAutograd wants tuple outputs; split_module returns a lone value bare.
            out_node = next(n for n in sub.graph.nodes if n.op == "output")
            single = not isinstance(out_node.args[0], (tuple, list))
            if single:
                out_node.args = ((out_node.args[0],),)
                sub.recompile()
            compiled = backend(sub, list(args), {"on_missing_op": opts.on_missing_op})
            setattr(self.module, target, _Compiled(compiled, single))
            result = sub(*args, **kwargs)
            return result[0] if single else result

    if fake_mode is None:
        fake_mode = torch._subclasses.FakeTensorMode()  # noqa: SLF001
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: SLF001

    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
             for x in example_inputs]
    with fake_mode:
        _CompileSubmodules(split).run(*fakes)
    return split


class _Compiled(torch.nn.Module):
    def __init__(self, fn, single: bool):
        super().__init__()
        self.fn = fn
        self.single = single

    def forward(self, *args):
        out = self.fn(*args)
        return out[0] if self.single else out
