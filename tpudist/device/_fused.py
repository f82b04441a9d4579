"""Fused mode: ops are recorded and run as one XLA program at a sync point.

Each recorded op is a ``Kernel`` (the same one Strict mode jits per op) plus where its storages come
from: a program input (a concrete array), an earlier op's output (``Lazy``), or nothing (an unwritten
storage). At a sync point (``.item()``, ``.cpu()``, printing, the end of ``optimizer.step()``, the
graph-size cap, a mode change) the graph runs as one ``jax.jit`` program whose outputs are the latest
values of the storages still alive. Programs are cached by a structural key: the kernel ids and
their input wiring plus which values are live. Python floats (lr, AdamW's bias corrections) and RNG
counters are one float64 input vector, so a steady-state training step compiles nothing. The ops that
make storages outliving the sync from constants (an optimizer's first-step state) run as a program of
their own (``_hoist``), so a training loop's step 1 and step 2 share their program.

The first op of a backward pass runs the pending graph, the forward's, as its own program
(``TPUDIST_FUSED_SPLIT_BACKWARD=0``: not): the device computes the forward while the host records the
backward and the optimizer. The values that cross from it to the backward's graph (the saved
activations) leave it in their own shape (``Shaped``) and the backward's program takes them so: on a
TPU a reshape between a flat array and an N-d one is a copy of the whole tensor.

A graph's dots and convolutions run at one float32 matmul precision, torch's when its first such op
was recorded (``tpudist.matmul_precision``): an op recorded at another one runs the pending graph
first, as a sync point does, and the precision is part of the program's key.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import torch

from tpudist import matmul_precision as precision
from tpudist._switches import switch
from tpudist.device import _hoist, _oom, _parts, _storage, views
from tpudist.device import _runtime as rt
from tpudist.device._core import result_of
from tpudist.device._storage import _ATTR, X64, Lazy, Shaped, _source_fingerprint
from tpudist.device._storage import outputs as _outputs
from tpudist.ops import host_checks

_CAP_ENV = "TPUDIST_FUSED_MAX_OPS"
_SPLIT_ENV = "TPUDIST_FUSED_SPLIT_BACKWARD"
_CHUNK_ENV = "TPUDIST_FUSED_FORWARD_CHUNK"
_BACKWARD_CHUNK_ENV = "TPUDIST_FUSED_BACKWARD_CHUNK"
assert _ATTR == "_tpudist_buffer"  # record() sets the storage's buffer under this name
_PROGRAMS: dict = {}
_HOST_CHECKS: set = set()  # keys of the programs that check values on the host (tpudist.ops.host_checks)
_STATS_LOCK = threading.Lock()  # programs are built in threads (_cached_all): their counts add up under it


class Graph:
    def __init__(self):
        self.nodes: list = []      # (kernel, refs, scalar base): with the live values, the structural key
        self.inputs: list = []     # concrete jax.Arrays the program reads
        self.input_of: dict = {}   # id(array) -> input index
        self.scalars: list = []
        self.written: list = []    # weakrefs to buffers whose value is (or was) a Lazy of this graph
        self.num_values = 0
        self.cap = max_ops()       # read once per graph, not per op (an environment read is ~3 us)
        self.precision = None      # torch's float32 matmul precision of its dots (None: it has none yet)
        self.shaped_inputs = []    # (input index, shape) of the inputs read in their own shape (Shaped)
        in_backward = _graph_task_id() != -1
        # recorded outside a backward pass: the first backward op runs it (split_backward)
        self.forward = split_backward() and not in_backward
        # runs every ``chunk`` ops (0: at a sync, or the forward at the backward's first op): a forward
        # under autograd, or a graph begun in a backward pass (the backward, then the optimizer step)
        self.chunk = (forward_chunk() if self.forward and torch.is_grad_enabled()
                      else backward_chunk() if in_backward else 0)
        # the ops a chunk counts: not those whose results read no array (an optimizer's first-step state,
        # which _hoist splits off), so step 1 is cut at the ops step 2 is and its chunks' programs are step 2's
        self.counted = 0


_graph: Graph | None = None


def max_ops() -> int:
    return int(os.environ.get(_CAP_ENV, "20000"))


def split_backward() -> bool:
    """Whether a backward pass's first op runs the pending (forward's) graph (``TPUDIST_FUSED_SPLIT_BACKWARD``)."""
    return switch(_SPLIT_ENV, "1", "a backward pass's first op runs the forward's graph, the default",
                  "forward, backward and optimizer step record into one graph")


def forward_chunk() -> int:
    """``TPUDIST_FUSED_FORWARD_CHUNK``: a forward recorded under autograd runs every that many ops (0, the
    default: it runs at the backward's first op), so the device starts on it while the host records the
    rest. A count of ops, not a time: every step is cut at the same ops and reuses its programs."""
    return _ops_env(_CHUNK_ENV)


def backward_chunk() -> int:
    """``TPUDIST_FUSED_BACKWARD_CHUNK``: a graph begun in a backward pass (the backward, and the optimizer
    step recorded after it) runs every that many ops (0, the default: at the next sync), so the device
    is not left idle once the forward's programs are done while the host records the rest."""
    return _ops_env(_BACKWARD_CHUNK_ENV)


def _ops_env(name: str) -> int:
    value = os.environ.get(name, "0")
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} must be a number of ops (0: no chunks, the default)")
    return int(value)


_graph_task_id = torch._C._current_graph_task_id  # noqa: SLF001 - -1 outside a backward pass (~0.1 us)


def record(kernel, leaves, buffers, scalars):
    global _graph
    g = _graph
    if g is not None and g.forward and _graph_task_id() != -1:
        rt.stats["backward_splits"] += 1
        flush(shaped=True)  # a backward pass began: the forward's graph runs while it is recorded
        g = None
    if kernel.matmul:
        g = _graph_at(precision.current())
    elif g is None:
        g = _graph = Graph()
    refs = []
    for b in buffers:
        v = b.value
        shaped = v.__class__ is Shaped
        if shaped:
            v = v.array
        if v is None:
            refs.append(None)
        elif v.__class__ is Lazy:
            if v.graph is not g:
                raise AssertionError("a value of an older fused graph is still pending")
            refs.append(v.index)
        else:
            idx = g.input_of.get(id(v))
            if idx is None:
                idx = g.input_of[id(v)] = len(g.inputs)
                g.inputs.append(v)
                if shaped:
                    g.shaped_inputs.append((idx, v.shape))
            refs.append(-1 - idx)
    nodes = g.nodes
    nodes.append((kernel, tuple(refs), len(g.scalars)))
    if scalars:
        g.scalars.extend(scalars)
    index = g.num_values
    written = g.written
    if kernel.num_written:
        for slot in kernel.written_slots:
            b = buffers[slot]
            b.value = Lazy(g, index)
            written.append(_weakref(b))
            index += 1
    outputs = kernel.outputs
    fresh = _outputs(outputs, None, g, index, written)
    g.num_values = index + len(outputs)
    if len(nodes) >= g.cap:
        flush()
    elif g.chunk and not _uncounted and not _hoist.array_free(kernel, len(scalars)):
        count_op(g)
    return fresh[0] if kernel.single_result else result_of(kernel, leaves, fresh)


def count_op(g: Graph) -> None:
    """One more op for ``g``'s chunk: it runs once it holds ``g.chunk`` of them."""
    g.counted += 1
    if g.counted >= g.chunk:
        flush(shaped=True)


_uncounted = 0  # > 0: the ops being recorded are parts of one op (_groups), counted once, after them


@contextlib.contextmanager
def counted_as_one():
    """The ops recorded inside count as one op for the chunks, after them (a foreach op recorded range
    by range, ``_groups``): chunks cut a step where they did with the op recorded whole."""
    global _uncounted
    _uncounted += 1
    try:
        yield
    finally:
        _uncounted -= 1
    g = _graph
    if not _uncounted and g is not None and g.chunk:
        count_op(g)


_weakref = weakref.ref


def _graph_at(matmul_precision: str) -> Graph:
    """The graph to record a dot or convolution at ``matmul_precision`` in: the pending one unless its
    dots run at another precision (then it runs now, and a new graph starts)."""
    global _graph
    g = _graph
    if g is not None and g.precision is not None and g.precision != matmul_precision:
        flush()
        g = None
    if g is None:
        g = _graph = Graph()
    g.precision = matmul_precision
    return g


def _program(nodes, live, shapes=None):
    """The jitted program of a graph: ``inputs`` are flat storages or Shaped arrays (read flat), the
    results are the ``live`` values, flat or of their ``shapes`` (None: all flat)."""
    def run(inputs, sc):
        inputs = [a.reshape(-1) if a.ndim > 1 else a for a in inputs]
        env = []
        for kernel, refs, base in nodes:
            arrays = [None if r is None else (env[r] if r >= 0 else inputs[-1 - r]) for r in refs]
            try:
                env.extend(kernel.trace(arrays, sc, base))
            except Exception as e:
                raise type(e)(f"{kernel.op} (in a fused program): {e}") from e
        if shapes is None:
            return [env[i] for i in live]
        return [env[i] if shape is None else env[i].reshape(shape) for i, shape in zip(live, shapes)]

    return jax.jit(run)


def result_shapes(nodes, live) -> list:
    """The shape each ``live`` value can leave its program in (None: flat): that of the view its op
    wrote or made, where that view is its whole storage, row-major, of more than one dimension."""
    shape_of = {}
    index = 0
    for kernel, _, _ in nodes:
        for slot in kernel.written_slots:
            shape_of[index] = _written_shape(kernel, slot)
            index += 1
        for out in kernel.outputs:
            shape = out[0]
            shape_of[index] = shape if len(out) == 3 and len(shape) > 1 and out[2] else None
            index += 1
    return [shape_of[i] for i in live]


def _written_shape(kernel, slot):
    numel, dtype = kernel.slots[slot]
    specs = [kernel.leaf_specs[leaf] for leaf in kernel.targets if kernel.leaf_specs[leaf][1] == slot]
    if len(specs) != 1 or specs[0][0] != "T":
        return None
    _, _, sizes, strides, offset, view_dtype = specs[0]
    sizes = tuple(sizes)
    if (len(sizes) < 2 or offset or view_dtype != dtype or math.prod(sizes) != numel or not numel
            or not views.is_contiguous(sizes, strides)):  # a size-1 dim's stride is never used: any will do
        return None
    return sizes


def _program_key(g: Graph, live, shapes=None) -> tuple:
    """What decides a graph's traced program, as tpudist's program cache keys it (the cache adds the
    jax/jaxlib/torch/tpudist versions). No device id and no process index: the ``jax.export`` module
    names no device, so every rank and host that records the same graph shares one entry, and a rank
    runs another rank's module on its own device (tests/compile/test_program_cache.py)."""
    device = rt.device()
    return (_source_fingerprint(), str(device.platform), device.device_kind, os.environ.get("XLA_FLAGS", ""),
            tuple(k.stable_id for k, _, _ in g.nodes), tuple(refs for _, refs, _ in g.nodes), tuple(live),
            tuple((tuple(a.shape), str(a.dtype)) for a in g.inputs), len(g.scalars), g.precision,
            None if shapes is None else tuple(shapes))


# Each op rounds its result to its dtype, as in Strict mode and on the CPU. XLA's default lets a
# fused chain of bf16/f16 ops keep f32 between them (xla_allow_excess_precision): a bf16
# ((x * y + x) * 1.7 - y).exp() * x differed from CPU eager in 40% of its elements in Fused mode and
# in none in Strict.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def _load_or_compile(g: Graph, live, sc, shapes=None):
    """A fused program: its XLA executable from tpudist's program cache if any rank of any host
    compiled an identical graph before, else its traced module from there, else traced; compiled
    and both stored (``tpudist.runtime.program_cache``, ``<TPUDIST_CACHE_DIR>/programs``).

    Tracing hundreds of kernels into one program dominates a warm start, and JAX's persistent
    cache, which holds XLA's compile, is written only by JAX process 0 on multi-process CPU, with
    the device in its key: rank r > 0 of the next run would compile every program again. The
    executable names no device in its key (it is loaded onto this rank's device), so every rank
    and host shares one entry. Without a cache root the program is traced and compiled, not stored.
    """
    from jax import export

    from tpudist.runtime import program_cache

    cached = program_cache.default_cache() is not None
    key = _program_key(g, live, shapes) if cached else None
    module_from_cache = [False]

    def jitted():
        if not cached:
            return _program(g.nodes, live, shapes)

        def trace():
            with jax.enable_x64(True):
                return export.export(_program(g.nodes, live, shapes))(g.inputs, sc)

        loaded = program_cache.load_or_export("fused", key, trace)
        if loaded.exported is None:  # jax.export refuses the program (host callbacks)
            return _program(g.nodes, live, shapes)
        module_from_cache[0] = loaded.from_cache
        return jax.jit(loaded.exported.call)

    # traced (and exported) under the graph's matmul precision; a graph without dots has none to set
    with jax.enable_x64(True), precision.scope(g.precision) if g.precision else contextlib.nullcontext():
        compiled, _, loaded = program_cache.load_or_compile("fused_xla", key, jitted, (g.inputs, sc), [rt.device()],
                                                            compiler_options=COMPILER_OPTIONS)
    if loaded or module_from_cache[0]:
        with _STATS_LOCK:
            rt.stats["programs_from_disk"] += 1
    return compiled


def _build(g: Graph, live: list, sc, shaped: bool):
    """The program of a graph seen for the first time: compiled (or loaded) whole, or, where the graph
    creates outliving constant storages (an optimizer's first step), as _hoist splits it; its results
    (the main program's, when split) in their own shapes where ``shaped``."""
    split = _hoist.split(g.nodes, live, len(g.scalars))
    if split is None:
        return _whole_or_parts(g, live, sc, shaped)
    rt.stats["hoisted_ops"] += len(split.init_nodes)
    return _SplitProgram(split, _like(g, (), [], ()), shaped)


def _whole_or_parts(g: Graph, live: list, sc, shaped: bool):
    """The program of a graph (no op of it split off): one, or, where its ops fall into independent
    repeated parts (an optimizer step recorded a layer at a time: ``_groups``), one per part (``_parts``)."""
    parts = _parts.split(g.nodes, live, len(g.scalars)) if _parts.enabled() else None
    with _STATS_LOCK:
        rt.stats["programs" if parts is None else "parted_graphs"] += 1
    if parts is None:
        return _load_or_compile(g, live, sc, result_shapes(g.nodes, live) if shaped else None)
    return _PartsProgram(parts, _like(g, (), [], ()), shaped, len(live))


def _like(g: Graph, nodes, inputs: list, scalars) -> Graph:
    """A graph of ``nodes`` reading ``inputs``, with ``g``'s other settings (whatever besides its ops
    decides its program and key)."""
    sub = copy.copy(g)
    sub.nodes, sub.inputs, sub.scalars = list(nodes), inputs, list(scalars)
    sub.input_of, sub.written, sub.num_values = {}, [], 0
    sub.shaped_inputs = [(i, a.shape) for i, a in enumerate(inputs) if a.ndim > 1]
    return sub


def _cached(template: Graph, nodes, inputs: list, live, sc, shaped: bool = False):
    """The program of a split-off graph: this process's if a graph recorded as this one ran before,
    else compiled or loaded; keyed as ``flush`` keys a recorded graph."""
    return _cached_all([(template, nodes, inputs, live, sc, shaped)])[0]


def _cached_all(graphs) -> list:
    """``_cached`` of several graphs (its arguments each), those not built yet compiled at once, in
    threads: XLA's compile releases the GIL, so the programs a split graph needs first (an optimizer's
    parts, its new state's) take about the longest one's time, not the sum of theirs."""
    keyed, todo = [], {}
    for template, nodes, inputs, live, sc, shaped in graphs:
        sub = _like(template, nodes, inputs, sc)
        key = _key(sub, live, shaped)
        keyed.append(key)
        if key not in _PROGRAMS and key not in todo:
            todo[key] = (sub, list(live), sc, shaped)
    if len(todo) > 1:
        with ThreadPoolExecutor(min(len(todo), _COMPILE_THREADS)) as pool:
            _PROGRAMS.update(zip(todo, pool.map(_whole_or_parts, *zip(*todo.values()))))
    else:
        for key, job in todo.items():
            _PROGRAMS[key] = _whole_or_parts(*job)
    return [_PROGRAMS[key] for key in keyed]


_COMPILE_THREADS = max(1, min(8, os.cpu_count() or 1))


class _SplitProgram:
    """A graph run as its split-off ops, each alone, then its main program reading their results.

    A split-off op's program is keyed by its kernel: shared by every graph that makes a storage with
    it (the ``zeros_like`` of every parameter of one shape). The programs are looked up at the first
    run, when the main program's inputs exist: it is the next step's whole program. ``template``: the
    graph's settings, without its ops or inputs (holding those would keep step 1's arrays alive)."""

    def __init__(self, split, template: Graph, shaped: bool):
        self.split, self.template, self.shaped, self.inits, self.main = split, template, shaped, None, None

    def __call__(self, inputs, sc):
        s, t = self.split, self.template
        if self.main is None:
            # in their own shape where the main program's results are: then the main program reads them as
            # the next step's reads the storages this step's program wrote, and is that program
            self.inits = _cached_all([(t, (node,), [], range(node[0].num_written + len(node[0].outputs)), sc[at],
                                       self.shaped) for node, at in zip(s.init_nodes, s.init_scalars)])
        made = [v for program, at in zip(self.inits, s.init_scalars) for v in program([], sc[at])]
        args = s.main_args(inputs, made)
        main_sc = sc[s.main_scalars]
        if self.main is None:
            self.main = _cached(t, s.main_nodes, args, s.main_live, main_sc, self.shaped)
        return s.outputs(self.main(args, main_sc), made)


class _PartsProgram:
    """A graph run as its parts (``_parts``), one after another, each a program that its repeats share;
    the programs are looked up at the first run, when their inputs exist."""

    def __init__(self, parts, template: Graph, shaped: bool, num_live: int):
        self.parts, self.template, self.shaped, self.num_live, self.programs = parts, template, shaped, num_live, None

    def __call__(self, inputs, sc):
        args = [([inputs[k] for k in p.inputs], sc[p.scalars]) for p in self.parts]
        if self.programs is None:
            self.programs = _cached_all([(self.template, p.nodes, a, p.live, s, self.shaped)
                                         for p, (a, s) in zip(self.parts, args)])
        outs = [None] * self.num_live
        for p, program, (a, s) in zip(self.parts, self.programs, args):
            for position, value in zip(p.positions, program(a, s)):
                outs[position] = value
        return outs


def _first(pair):
    return pair[0]


def _key(g: Graph, live, shaped: bool = False) -> tuple:
    """The in-memory key of a graph's program. Kernels hash by identity, as their ids did; the device
    too: a program from the program cache is an executable of this device, and a new world (a new JAX
    backend) has new devices; the float32 matmul precision its dots are traced at; the inputs it
    reads in their own shape; whether its results leave in theirs."""
    return tuple(g.nodes), tuple(live), rt.device(), g.precision, tuple(g.shaped_inputs), shaped


def flush(shaped: bool = False) -> None:
    """Run the pending graph (a sync point); a no-op when nothing is pending. ``shaped``: its results
    that are a whole storage's row-major N-d view leave it in that shape (``Shaped``), for the next
    graph to read so (a backward's graph its forward's saved activations)."""
    global _graph
    with rt.LOCK:
        g = _graph
        if g is None:
            return
        _graph = None
        shaped = shaped or _storage.shaped_storage()
        rt.stats["recorded_ops"] += len(g.nodes)  # counted per graph, not per op (cache_stats adds the pending)
        t0 = time.perf_counter()
        live, bufs, seen = [], [], set()
        for w in g.written:
            b = w()
            if b is None or id(b) in seen:
                continue
            v = b.value
            if isinstance(v, Lazy) and v.graph is g:
                seen.add(id(b))
                live.append(v.index)
                bufs.append(b)
        if live:  # in value order, not first-write order: a step whose state _hoist split off keys as the next
            live, bufs = map(list, zip(*sorted(zip(live, bufs), key=_first)))
        key = _key(g, live, shaped)
        rt.stats["graph_key_s"] += time.perf_counter() - t0
        sc = np.asarray(g.scalars, np.float64) if g.scalars else np.zeros((0,), np.float64)
        t1 = time.perf_counter()
        program = _PROGRAMS.get(key)
        compiling = program is None
        traced = host_checks.TRACED[0]  # moved by building a program that checks values on the host
        try:
            if compiling:
                program = _PROGRAMS[key] = _build(g, live, sc, shaped)
            prev = X64.swap_local(True)
            try:
                outs = program(g.inputs, sc)
            finally:
                X64.set_local(prev)
            if key in _HOST_CHECKS or host_checks.TRACED[0] != traced:  # an assert: its error comes out here
                _HOST_CHECKS.add(key)
                host_checks.raise_failed()
        except Exception as e:
            # the graph did not run: storages it wrote go back to their values before it (as at the last
            # sync), storages it made stay unwritten; nothing is left pending
            for b, ref in zip(bufs, _hoist.held_before(g.nodes, live)):
                b.value = None if ref is None else _as_value(g.inputs[-1 - ref])
            _oom.raise_if_oom(e, f"the fused program of {len(g.nodes)} ops (run at this sync point)",
                              _oom.buffer_bytes(bufs))
            ops = ", ".join(sorted({str(k.op) for k, _, _ in g.nodes}))
            raise type(e)(f"the fused program of {len(g.nodes)} ops failed at the sync point: {e} "
                          f"(ops in the program: {ops}; set_eager_mode('debug') raises at the faulty op)") from e
        if compiling:
            rt.stats["compile_s"] += time.perf_counter() - t1
        rt.stats["syncs"] += 1
        rt.stats["fused_ops"] += len(g.nodes)
        rt.stats["shaped_reads"] += len(g.shaped_inputs)
        if shaped:
            for b, value in zip(bufs, outs):
                b.value = _as_value(value)
        else:
            for b, value in zip(bufs, outs):
                b.value = value
        if rt.get_mode().checks:
            jax.block_until_ready(outs)


def _as_value(array):
    """A storage value of a program's input or result: flat, or N-d (then its storage holds it Shaped)."""
    return array if array.ndim == 1 else Shaped(array)


def pending_ops() -> int:
    return 0 if _graph is None else len(_graph.nodes)


_storage.on_flush(flush)  # a storage read (value_of) or an op on a pending value runs the graph through it
