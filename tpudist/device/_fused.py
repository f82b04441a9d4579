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

A graph's dots and convolutions run at one float32 matmul precision, torch's when its first such op
was recorded (``tpudist.matmul_precision``): an op recorded at another one runs the pending graph
first, as a sync point does, and the precision is part of the program's key.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import weakref

import jax
import numpy as np

from tpudist import matmul_precision as precision
from tpudist.device import _hoist, _oom, _storage
from tpudist.device import _runtime as rt
from tpudist.device._core import result_of
from tpudist.device._storage import _ATTR, X64, Lazy, Shaped, _source_fingerprint
from tpudist.device._storage import outputs as _outputs

_CAP_ENV = "TPUDIST_FUSED_MAX_OPS"
assert _ATTR == "_tpudist_buffer"  # record() sets the storage's buffer under this name
_PROGRAMS: dict = {}


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


_graph: Graph | None = None


def max_ops() -> int:
    return int(os.environ.get(_CAP_ENV, "20000"))


def record(kernel, leaves, buffers, scalars):
    global _graph
    g = _graph
    if kernel.matmul:
        g = _graph_at(precision.current())
    elif g is None:
        g = _graph = Graph()
    refs = []
    for b in buffers:
        v = b.value
        if v.__class__ is Shaped:
            v = _storage.concrete(b)
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
    return fresh[0] if kernel.single_result else result_of(kernel, leaves, fresh)


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


def _program(nodes, live):
    def run(inputs, sc):
        env = []
        for kernel, refs, base in nodes:
            arrays = [None if r is None else (env[r] if r >= 0 else inputs[-1 - r]) for r in refs]
            try:
                env.extend(kernel.trace(arrays, sc, base))
            except Exception as e:
                raise type(e)(f"{kernel.op} (in a fused program): {e}") from e
        return [env[i] for i in live]

    return jax.jit(run)


def _program_key(g: Graph, live) -> tuple:
    """What decides a graph's traced program, as tpudist's program cache keys it (the cache adds the
    jax/jaxlib/torch/tpudist versions). No device id and no process index: the ``jax.export`` module
    names no device, so every rank and host that records the same graph shares one entry, and a rank
    runs another rank's module on its own device (tests/compile/test_program_cache.py)."""
    device = rt.device()
    return (_source_fingerprint(), str(device.platform), device.device_kind, os.environ.get("XLA_FLAGS", ""),
            tuple(k.stable_id for k, _, _ in g.nodes), tuple(refs for _, refs, _ in g.nodes), tuple(live),
            tuple((tuple(a.shape), str(a.dtype)) for a in g.inputs), len(g.scalars), g.precision)


# Each op rounds its result to its dtype, as in Strict mode and on the CPU. XLA's default lets a
# fused chain of bf16/f16 ops keep f32 between them (xla_allow_excess_precision): a bf16
# ((x * y + x) * 1.7 - y).exp() * x differed from CPU eager in 40% of its elements in Fused mode and
# in none in Strict.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def _load_or_compile(g: Graph, live, sc):
    """A fused program: its XLA executable from tpudist's program cache if any rank of any host
    compiled an identical graph before, else its traced module from there, else traced; compiled
    and both stored (``tpudist.program_cache``, ``<TPUDIST_CACHE_DIR>/programs``).

    Tracing hundreds of kernels into one program dominates a warm start, and JAX's persistent
    cache, which holds XLA's compile, is written only by JAX process 0 on multi-process CPU, with
    the device in its key: rank r > 0 of the next run would compile every program again. The
    executable names no device in its key (it is loaded onto this rank's device), so every rank
    and host shares one entry. Without a cache root the program is traced and compiled, not stored.
    """
    from jax import export

    from tpudist import program_cache

    cached = program_cache.default_cache() is not None
    key = _program_key(g, live) if cached else None
    module_from_cache = [False]

    def jitted():
        if not cached:
            return _program(g.nodes, live)

        def trace():
            with jax.enable_x64(True):
                return export.export(_program(g.nodes, live))(g.inputs, sc)

        loaded = program_cache.load_or_export("fused", key, trace)
        if loaded.exported is None:  # jax.export refuses the program (host callbacks)
            return _program(g.nodes, live)
        module_from_cache[0] = loaded.from_cache
        return jax.jit(loaded.exported.call)

    # traced (and exported) under the graph's matmul precision; a graph without dots has none to set
    with jax.enable_x64(True), precision.scope(g.precision) if g.precision else contextlib.nullcontext():
        compiled, _, loaded = program_cache.load_or_compile("fused_xla", key, jitted, (g.inputs, sc), [rt.device()],
                                                            compiler_options=COMPILER_OPTIONS)
    if loaded or module_from_cache[0]:
        rt.stats["programs_from_disk"] += 1
    return compiled


def _build(g: Graph, live: list, sc):
    """The program of a graph seen for the first time: compiled (or loaded) whole, or, where the graph
    creates outliving constant storages (an optimizer's first step), as _hoist splits it."""
    split = _hoist.split(g.nodes, live, len(g.scalars))
    if split is None:
        rt.stats["programs"] += 1
        return _load_or_compile(g, live, sc)
    rt.stats["hoisted_ops"] += len(split.init_nodes)
    return _SplitProgram(split, _like(g, (), [], ()))


def _like(g: Graph, nodes, inputs: list, scalars) -> Graph:
    """A graph of ``nodes`` reading ``inputs``, with ``g``'s other settings (whatever besides its ops
    decides its program and key)."""
    sub = copy.copy(g)
    sub.nodes, sub.inputs, sub.scalars = list(nodes), inputs, list(scalars)
    sub.input_of, sub.written, sub.num_values = {}, [], 0
    return sub


def _cached(template: Graph, nodes, inputs: list, live, sc):
    """The program of a split-off graph: this process's if a graph recorded as this one ran before,
    else compiled or loaded; keyed as ``flush`` keys a recorded graph."""
    sub = _like(template, nodes, inputs, sc)
    key = _key(sub, live)
    program = _PROGRAMS.get(key)
    if program is None:
        program = _PROGRAMS[key] = _load_or_compile(sub, live, sc)
        rt.stats["programs"] += 1
    return program


class _SplitProgram:
    """A graph run as its split-off ops, each alone, then its main program reading their results.

    A split-off op's program is keyed by its kernel: shared by every graph that makes a storage with
    it (the ``zeros_like`` of every parameter of one shape). The programs are looked up at the first
    run, when the main program's inputs exist: it is the next step's whole program. ``template``: the
    graph's settings, without its ops or inputs (holding those would keep step 1's arrays alive)."""

    def __init__(self, split, template: Graph):
        self.split, self.template, self.inits, self.main = split, template, None, None

    def __call__(self, inputs, sc):
        s, t = self.split, self.template
        if self.main is None:
            self.inits = [_cached(t, (node,), [], range(node[0].num_written + len(node[0].outputs)), sc[at])
                          for node, at in zip(s.init_nodes, s.init_scalars)]
        made = [v for program, at in zip(self.inits, s.init_scalars) for v in program([], sc[at])]
        args = s.main_args(inputs, made)
        main_sc = sc[s.main_scalars]
        if self.main is None:
            self.main = _cached(t, s.main_nodes, args, s.main_live, main_sc)
        return s.outputs(self.main(args, main_sc), made)


def _first(pair):
    return pair[0]


def _key(g: Graph, live) -> tuple:
    """The in-memory key of a graph's program. Kernels hash by identity, as their ids did; the device
    too: a program from the program cache is an executable of this device, and a new world (a new JAX
    backend) has new devices; and the float32 matmul precision its dots are traced at."""
    return tuple(g.nodes), tuple(live), rt.device(), g.precision


def flush() -> None:
    """Run the pending graph (a sync point); a no-op when nothing is pending."""
    global _graph
    with rt.LOCK:
        g = _graph
        if g is None:
            return
        _graph = None
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
        key = _key(g, live)
        rt.stats["graph_key_s"] += time.perf_counter() - t0
        sc = np.asarray(g.scalars, np.float64) if g.scalars else np.zeros((0,), np.float64)
        t1 = time.perf_counter()
        program = _PROGRAMS.get(key)
        compiling = program is None
        try:
            if compiling:
                program = _PROGRAMS[key] = _build(g, live, sc)
            prev = X64.swap_local(True)
            try:
                outs = program(g.inputs, sc)
            finally:
                X64.set_local(prev)
        except Exception as e:
            # the graph did not run: storages it wrote go back to their values before it (as at the last
            # sync), storages it made stay unwritten; nothing is left pending
            for b, ref in zip(bufs, _hoist.held_before(g.nodes, live)):
                b.value = None if ref is None else g.inputs[-1 - ref]
            _oom.raise_if_oom(e, f"the fused program of {len(g.nodes)} ops (run at this sync point)",
                              _oom.buffer_bytes(bufs))
            ops = ", ".join(sorted({str(k.op) for k, _, _ in g.nodes}))
            raise type(e)(f"the fused program of {len(g.nodes)} ops failed at the sync point: {e} "
                          f"(ops in the program: {ops}; set_eager_mode('debug') raises at the faulty op)") from e
        if compiling:
            rt.stats["compile_s"] += time.perf_counter() - t1
        rt.stats["syncs"] += 1
        rt.stats["fused_ops"] += len(g.nodes)
        for b, value in zip(bufs, outs):
            b.value = value
        if rt.get_mode() == "debug":
            jax.block_until_ready(outs)


def pending_ops() -> int:
    return 0 if _graph is None else len(_graph.nodes)


_storage.on_flush(flush)  # a storage read (value_of) or an op on a pending value runs the graph through it
