"""One ATen graph -> one XLA program: interpret the FX graph through ``tpudist.ops``, trace once
with ``jax.jit``, compile ahead of time, then run it on torch tensors.

A :class:`GraphProgram` is what the backend hands AOTAutograd for a forward or backward graph: a
boxed callable (``_boxed_call``: it takes the argument list and clears it, so inputs can be freed
early). Every call crosses the boundary without copies (``boundary``), runs the executable and
waits for it (inputs may be freed or resized by FSDP2 right after), then returns torch views of
XLA's result buffers, each in the dtype ``node.meta["val"]`` records.

Programs are cached in memory by their key (the graph's code, its input shapes and dtypes, its
constants and the collective groups it names) and on disk in tpudist's program cache
(``tpudist.runtime.program_cache``): XLA's executable, keyed by the program and its devices (a
single-device graph's by its platform only: any rank loads it onto its own device), so a rank of a
later world or another host with the same layout neither traces nor compiles; and for programs
without collectives also the traced program as a ``jax.export`` module, which names no device: any
rank or host that would trace the same graph reads it and only compiles. JAX's persistent
compilation cache (``tpudist.runtime.jax_cache``) serves XLA's compile where the executable is missing.

Dots and convolutions run at torch's float32 matmul precision of the call (``tpudist.matmul_precision``).
Dynamo guards on cuBLAS's ``allow_tf32`` only, which "high" and "medium" share (torch 2.13), so a
GraphProgram reads the setting at each call and keeps one program per setting, the setting part of
the program's key.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx

from tpudist import _strides
from tpudist import matmul_precision as precision
from tpudist._switches import shaped_storage
from tpudist.compile import boundary, device_io
from tpudist.compile.errors import UnsupportedGraph, missing_op_error, user_line
from tpudist.ops import host_checks


@dataclass(slots=True)
class Stats:
    """What the backend did in this process (tests and benchmarks read it)."""

    graphs: int = 0  # GraphPrograms built (forward and backward count separately)
    programs_compiled: int = 0  # programs traced here (memory-cache misses the program cache lacked)
    memory_hits: int = 0
    disk_hits: int = 0  # traced programs read from the program cache
    xla_compiles: int = 0  # XLA compilations JAX's persistent cache did not serve
    compile_seconds: float = 0.0  # tracing + lowering + XLA (or loading from disk)
    calls: int = 0
    shaped_results: int = 0  # saved activations device programs returned in their own shape (SAVED_META)
    shaped_inputs: int = 0  # ... and took so, without a reshape
    # bytes of N-d values that crossed a device program's edge flat (parameters, gradients, the caller's
    # results): on a TPU each such reshape is a relayout copy inside the program
    flat_edge_bytes: int = 0
    # Seconds per program name ("forward", "backward", "inference") since the process started:
    # whole calls (boundary crossings included), and the XLA program alone (dispatch until its
    # results are ready; CPU programs only). Benchmarks read where a compiled step's time goes.
    call_seconds: dict = field(default_factory=dict)
    program_seconds: dict = field(default_factory=dict)
    # The same spans in CPU seconds of the calling thread (time.thread_time): on a loaded machine
    # wall time mostly measures waiting for a core. XLA:CPU runs a program's first thunks on the
    # calling thread and hands ready ones to its own pool, whose CPU the caller does not see.
    call_cpu_seconds: dict = field(default_factory=dict)
    program_cpu_seconds: dict = field(default_factory=dict)
    # whether calls fill the two above: off unless a benchmark turns it on. Reading a thread's CPU clock is a
    # system call; with XLA's threads busy on a 2-core machine it took 9 us (median) to 1.6 ms a read, and the
    # four reads of a compiled forward and backward 0.3-0.6 ms of host time a step (2026-12-07)
    cpu_times: bool = False
    # per program with collectives: (graph name, the XLA collective instructions its HLO holds)
    collective_programs: list = field(default_factory=list)

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in ("graphs", "programs_compiled", "memory_hits", "disk_hits",
                                               "xla_compiles", "compile_seconds", "calls")}


STATS = Stats()
_cache: dict[str, "_Executable"] = {}
# gm.meta key of a Saved record: the activations a forward graph computes and saves for its backward,
# set on both graphs by the backend's partition (mark_saved). They leave the forward row-major (torch's
# strides matter to the caller's results only), and a device program returns and takes them in their
# own shape, where everything else crosses its edge flat.
SAVED_META = "tpudist_saved_activations"


@dataclass(frozen=True)
class Saved:
    names: frozenset  # the saved nodes (the forward's names, the backward's placeholders)
    first: int | None  # the forward's first output position that is saved (None on the backward)


def mark_saved(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int) -> None:
    """Marks on both graphs the tensors ``forward`` computes that ``backward`` takes (AOTAutograd names
    the backward's inputs after the forward's saved nodes and returns them after the caller's
    ``num_fwd_outputs``). An input the forward passes through (a parameter saved for the backward) is
    not its result: it crosses as its storage holds it."""
    out = next(n for n in forward.graph.nodes if n.op == "output")
    computed = {a.name for a in out.args[0] if isinstance(a, torch.fx.Node) and a.op != "placeholder"}
    names = frozenset(computed & {n.name for n in backward.graph.nodes if n.op == "placeholder"})
    forward.meta[SAVED_META], backward.meta[SAVED_META] = Saved(names, num_fwd_outputs), Saved(names, None)


_lock = threading.Lock()
_listening = []


def clear_cache() -> None:
    """Forget every compiled program held in memory (the disk caches stay)."""
    with _lock:
        _cache.clear()


@dataclass(frozen=True, slots=True)
class _Executable:
    compiled: Any  # jax.stages.Compiled
    num_keys: int  # random keys the program draws (0: no torch RNG is consumed)
    host_checks: bool = False  # it checks values on the host (an assert: tpudist.ops.host_checks)


_jax_cache_hits = [0]


def _count_jax_cache_hits() -> None:
    import jax

    def listener(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _jax_cache_hits[0] += 1

    jax.monitoring.register_event_listener(listener)


@dataclass(frozen=True, slots=True)
class _Output:
    kind: str  # "array" (index into the program's outputs), "input" (pass-through), "none", "value"
    index: int = 0
    dtype: torch.dtype | None = None
    value: Any = None


def _is_tensor_val(val: Any) -> bool:
    return isinstance(val, torch.Tensor)


class GraphProgram:
    """A compiled ATen graph, callable with AOTAutograd's boxed arguments."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, *, name: str,
                 collectives: Any = None, xla_options: dict | None = None):
        import jax

        from tpudist.runtime.jax_cache import enable_persistent_cache

        enable_persistent_cache()
        self._boxed_call = True  # on the instance: torch._dynamo.disable's wraps() copies __dict__ only
        self.name = name
        self._gm = gm
        self._collectives = collectives  # collectives.GraphCollectives or None
        self._xla_options = dict(xla_options or {})
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise AssertionError(f"{name}: {len(placeholders)} placeholders, {len(example_inputs)} inputs")
        self._tensor_at = []
        for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(x, torch.Tensor):
                self._tensor_at.append(i)
            elif isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise UnsupportedGraph(f"{name}: input {node.name} is a symbolic size ({x}) in a static program: "
                                       "tpudist.compile.dynamic specializes dynamic graphs, so this is a bug "
                                       "there (dynamic=False avoids dynamic graphs)")
        from tpudist.ops import to_jax_dtype

        self._avals = [jax.core.ShapedArray(tuple(example_inputs[i].shape), to_jax_dtype(example_inputs[i].dtype))
                       for i in self._tensor_at]
        self._constants = [(n.target, _fetch_attr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"]
        self._outputs, self._output_nodes = self._plan_outputs(gm, placeholders)
        # A device tensor in or out makes it a device program (a graph may move a CPU input with
        # .to("tpu") or make a device tensor from nothing); CPU inputs are then copied in, and each
        # output comes back on the device its node records.
        self._on_device = (any(device_io.is_device_tensor(example_inputs[i]) for i in self._tensor_at)
                           or any(device_io.is_device_tensor(n.meta["val"]) for n in self._output_nodes))
        if self._on_device and collectives is not None:
            raise UnsupportedGraph(f"{name} graph: collectives on 'tpu' device tensors inside compiled graphs "
                                   "are not supported yet; compile with CPU tensors")
        if self._on_device:
            self._device = device_io.jax_device()
            self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        elif collectives is not None:
            self._device, self._sharding = collectives.device, collectives.input_sharding
        else:
            self._device = jax.local_devices()[0]
            self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        if self._device.platform == "cpu":
            # Single-threaded Eigen inside our programs: faster on the few shared cores of CPU
            # emulation (one process per rank), measured 0.86-1.06x vs 0.92-1.12x of eager (fwd+bwd,
            # d64) and 0.50x vs 0.59x (d256); pass xla_options={"xla_cpu_multi_thread_eigen": True} to undo.
            # XLA's own dot emitter instead of YNNPACK fusions: the fp32 forward and backward programs
            # ran 5-19% faster at d64 and 2-8% at d256 (bf16 within noise; 2026-12-01, interleaved);
            # xla_options={"xla_cpu_experimental_ynn_fusion_type": <XLA's default>} undoes it.
            self._xla_options = {"xla_cpu_multi_thread_eigen": False, "xla_cpu_experimental_ynn_fusion_type": "",
                                 **self._xla_options}
        # the caller's results torch lays out densely but not row-major (a transposed result, channels_last)
        # leave the program in that physical order and come back with torch's strides; saved activations
        # leave row-major and, from device programs, in their own shape (not flat), as backwards take them
        saved = gm.meta.get(SAVED_META, Saved(frozenset(), None))
        positions = [p for p, o in enumerate(self._outputs) if o.kind == "array"]
        for_backward = [saved.first is not None and p >= saved.first for p in positions]
        self._orders = [None if kept else _dense_order(n.meta["val"])
                        for n, kept in zip(self._output_nodes, for_backward)]
        # with TPUDIST_SHAPED_STORAGE every N-d value enters and leaves in its own shape (parameters, gradients)
        nd = shaped_storage() if self._on_device else False
        self._shaped_in = tuple(self._on_device and (placeholders[i].name in saved.names
                                                     or (nd and placeholders[i].meta["val"].dim() > 1))
                                for i in self._tensor_at)
        self._shaped_out = tuple(self._on_device and ((kept and n.name in saved.names)
                                                      or (nd and order is None and n.meta["val"].dim() > 1))
                                 for n, kept, order in zip(self._output_nodes, for_backward, self._orders))
        self._num_shaped = (sum(self._shaped_in), sum(self._shaped_out))
        edges = [*zip(((a.shape, a.dtype) for a in self._avals), self._shaped_in),
                 *zip(((n.meta["val"].shape, n.meta["val"].dtype) for n in self._output_nodes), self._shaped_out)]
        self._flat_edge_bytes = (sum(_nbytes(*value) for value, shaped in edges if len(value[0]) > 1 and not shaped)
                                 if self._on_device else 0)
        self._const_arrays = None
        self._result_types = [(_physical_shape(n.meta["val"].shape, order), n.meta["val"].dtype)
                              for n, order in zip(self._output_nodes, self._orders)]
        self._fresh = self._plan_fresh() if self._on_device else None
        self._precision = precision.current()
        self.key = self._key()
        STATS.graphs += 1
        self._exe = self._executable()
        self._programs = {self._precision: (self.key, self._exe)}  # torch's matmul precision -> (key, executable)

    # -- building ---------------------------------------------------------------------------------
    @staticmethod
    def _plan_outputs(gm, placeholders):
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        where = {n: i for i, n in enumerate(placeholders)}
        plan, computed = [], []
        for arg in out_node.args[0]:
            if arg is None:
                plan.append(_Output("none"))
            elif isinstance(arg, torch.fx.Node) and arg in where:
                plan.append(_Output("input", where[arg]))
            elif isinstance(arg, torch.fx.Node) and _is_tensor_val(arg.meta.get("val")):
                plan.append(_Output("array", len(computed), arg.meta["val"].dtype))
                computed.append(arg)
            elif isinstance(arg, torch.fx.Node):
                raise UnsupportedGraph(f"graph output {arg.name} is not a tensor ({arg.meta.get('val')!r}) in a "
                                       "static program: tpudist.compile.dynamic specializes dynamic graphs, so "
                                       "this is a bug there (dynamic=False avoids dynamic graphs)")
            else:
                plan.append(_Output("value", value=arg))
        return plan, computed

    def _computed(self, outs: list) -> list[torch.Tensor]:
        """torch tensors of the computed outputs (CPU programs), in ``_output_nodes`` order."""
        # One buffer per result. Packing results into one buffer per dtype was measured slower:
        # the concatenate inside the program cost more (8 of 33 ms of a dim-256 forward) than the
        # hand-overs it saved (~4 us each).
        return boundary.results(outs, self._result_types, self._device.id)

    def _key(self) -> str:
        h = hashlib.sha256()
        code = self._gm.code
        h.update((code if self._collectives is None else self._collectives.canonical(code)).encode())
        h.update(repr([(a.shape, str(a.dtype)) for a in self._avals]).encode())
        h.update(b"device" if self._on_device else b"cpu")
        h.update(repr((self._shaped_in, self._shaped_out, self._orders)).encode())
        h.update(repr(sorted(self._xla_options.items())).encode())
        for name, value in self._constants:
            h.update(name.encode())
            h.update(repr((tuple(value.shape), str(value.dtype))).encode())
            h.update(_bytes_of(value))
        if self._collectives is not None:
            h.update(self._collectives.key.encode())
        import jax

        h.update(repr((jax.__version__, torch.__version__, os.environ.get("XLA_FLAGS", ""),
                       self._device.platform)).encode())
        h.update(_table_digest().encode())
        h.update(_lowerings_digest(self._gm).encode())
        h.update(f"float32 matmul precision {self._precision}".encode())
        return h.hexdigest()[:32]

    def _at_current_precision(self) -> None:
        """Points ``key`` and ``_exe`` at the program of torch's float32 matmul precision now, built
        the first time the setting is seen (Dynamo keeps the graph from "high" to "medium")."""
        now = precision.current()
        if now == self._precision:
            return
        self._precision = now
        entry = self._programs.get(now)
        if entry is None:
            self.key = self._key()
            entry = self._programs[now] = (self.key, self._executable())
        self.key, self._exe = entry

    def _executable(self) -> _Executable:
        with _lock:
            exe = _cache.get(self.key)
        if exe is not None:
            STATS.memory_hits += 1
            return exe
        start = time.perf_counter()
        exe = self._compile()
        STATS.compile_seconds += time.perf_counter() - start
        with _lock:
            _cache[self.key] = exe
        return exe

    def _compile(self) -> _Executable:
        """Traces the program (or reads it from the program cache) and compiles it (or reads it)."""
        import jax

        from tpudist.runtime import program_cache
        from tpudist.ops import KeySource, keys

        num_keys = [0]

        def program(key_data, consts, *arrays):
            source = KeySource(key_data)
            with keys(source):
                outs = interpret(self._gm, list(arrays), consts, self._output_nodes, self._collectives)
            num_keys[0] = source.num_drawn
            return [o if order is None else jax.numpy.transpose(o, order) for o, order in zip(outs, self._orders)]

        key_aval = jax.ShapeDtypeStruct((2,), np.uint32)
        const_avals = [jax.ShapeDtypeStruct(tuple(v.shape), _jax_dtype(v.dtype)) for _, v in self._constants]
        avals = list(self._avals)
        fn = program
        if self._on_device:  # a storage's array enters and leaves as it is: flat, or shaped (saved activations)
            shapes, shaped_in, shaped_out = [a.shape for a in avals], self._shaped_in, self._shaped_out

            def fn(key_data, consts, *arrays):  # noqa: F811
                outs = program(key_data, consts, *[a.reshape(s) for a, s in zip(arrays, shapes)])
                return [o if shaped else o.reshape(-1) for o, shaped in zip(outs, shaped_out)]

            avals = [jax.ShapeDtypeStruct(a.shape if shaped else (math.prod(a.shape),), a.dtype)
                     for a, shaped in zip(avals, shaped_in)]
        if self._collectives is not None:
            fn = self._collectives.wrap(program, len(avals))
            key_aval, const_avals, avals = (self._collectives.global_aval(key_aval),
                                            [self._collectives.global_aval(a) for a in const_avals],
                                            [self._collectives.global_aval(a) for a in avals])
        if not _listening:
            _count_jax_cache_hits()
            _listening.append(True)
        hits = _jax_cache_hits[0]
        args = (key_aval, const_avals, *avals)
        options = self._xla_options or None
        devices = list(self._collectives.mesh.devices.flat) if self._collectives is not None else [self._device]
        module_from_cache = [False]

        def jitted():
            """The program to compile: over several processes' devices it is traced (every rank
            traces it anyway); on one device, its module is read from the program cache (any rank
            or host may have traced it) or traced and stored."""
            if self._collectives is not None:
                return jax.jit(fn)
            loaded = self._load_or_export(jax.jit(fn), args, num_keys)
            module_from_cache[0] = loaded.from_cache
            if loaded.exported is None:
                return jax.jit(fn)
            num_keys[0] = loaded.meta.get("num_keys", num_keys[0])
            return jax.jit(loaded.exported.call)

        with jax.enable_x64(True), precision.scope(self._precision):
            # XLA's executable, keyed by the program and its devices, from the program cache: this
            # rank of a later world or another host with the same layout neither traces nor compiles.
            # Single-device executables are kept here too, not only in JAX's cache, which on CPU
            # only JAX process 0 writes (docs/cache.md).
            compiled, meta, loaded = program_cache.load_or_compile(
                "compile_xla", self.key, jitted, args, devices,
                compiler_options=options, meta_fn=lambda: {"num_keys": num_keys[0]})
            num_keys[0] = meta.get("num_keys", num_keys[0])
            if loaded or module_from_cache[0]:
                STATS.disk_hits += 1
            else:
                STATS.programs_compiled += 1
        if _jax_cache_hits[0] == hits and not loaded:
            STATS.xla_compiles += 1
        if self._collectives is not None:
            text = compiled.as_text()
            found = sorted({op for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                          "collective-permute") if f" {op}(" in text or f"{op}-start(" in text})
            STATS.collective_programs.append((self.name, tuple(found)))
        return _Executable(compiled, num_keys[0], program_cache.has_host_callbacks(compiled))

    def _load_or_export(self, traced, args: tuple, num_keys: list):
        """The traced program as a ``jax.export`` module, from tpudist's program cache where any
        process or host stored it (the module names no device, the key no process-local part);
        its ``exported`` is None where the program is jitted as it is (see ``load_or_export``)."""
        from jax import export

        from tpudist.runtime import program_cache

        return program_cache.load_or_export("compile", self.key, lambda: export.export(traced)(*args),
                                            lambda: {"num_keys": num_keys[0]})

    def _plan_fresh(self) -> tuple:
        """A device program's device results as ``device_io.new_tensors`` makes them in one call: their
        (shape, dtype, numel[, strides]) and which computed outputs they are. Results on the CPU (a step
        count's new value) are made one by one."""
        specs, where = [], []
        for o in self._outputs:
            val = self._output_nodes[o.index].meta["val"] if o.kind == "array" else None
            if val is None or val.device.type == "cpu":
                continue
            shape = tuple(int(s) for s in val.shape)
            strides = () if self._orders[o.index] is None else (tuple(int(s) for s in val.stride()),)
            specs.append((shape, o.dtype, math.prod(shape), *strides))
            where.append(o.index)
        return tuple(specs), where

    # -- running ----------------------------------------------------------------------------------
    def _key_data(self) -> np.ndarray:
        if not self._exe.num_keys:
            return np.zeros(2, np.uint32)
        # Drawn from torch's default generator: torch.manual_seed(s) gives the same masks every run.
        seed = torch.randint(0, 2 ** 31 - 1, (2,), dtype=torch.int64)
        return seed.numpy().astype(np.uint32)

    def _device_key(self):
        """The program's random key on its device: drawn for each call of a program that draws, else
        one zero key, put on the device once (a host-to-device copy before every dispatch otherwise)."""
        import jax

        if self._exe.num_keys:
            return jax.device_put(self._key_data(), self._device)
        key = _ZERO_KEYS.get(self._device)
        if key is None:
            key = _ZERO_KEYS[self._device] = jax.device_put(np.zeros(2, np.uint32), self._device)
        return key

    def _consts(self) -> list:
        if self._const_arrays is None:
            keep: list = []
            self._const_arrays = (boundary.to_jax([v for _, v in self._constants],
                                                  [_aval_of(v) for _, v in self._constants],
                                                  self._sharding, self._device, keep), keep)
        return self._const_arrays[0]

    def _run(self, arrays: list, key_data=None) -> list:
        import jax

        key_data = self._key_data() if key_data is None else key_data
        consts = self._consts()
        start, start_cpu = time.perf_counter(), _thread_time()
        outs = self._exe.compiled(key_data, consts, *arrays)
        if self._exe.host_checks:
            host_checks.raise_failed()
        jax.block_until_ready(outs)  # inputs (and temporaries in keep) are read by now
        _add(STATS.program_seconds, self.name, time.perf_counter() - start)
        if STATS.cpu_times:
            _add(STATS.program_cpu_seconds, self.name, time.thread_time() - start_cpu)
        return outs

    def _run_on_device(self, tensors: list) -> list:
        try:
            outs = self._exe.compiled(self._device_key(), self._consts(),
                                      *[device_io.program_input(t, self._device, shaped)
                                        for t, shaped in zip(tensors, self._shaped_in)])
            if self._exe.host_checks:
                host_checks.raise_failed()
            return outs
        except Exception as e:
            results = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self._result_types)
            device_io.raise_if_oom(e, f"the compiled {self.name} graph's program", results)
            raise

    def __call__(self, args: list) -> list:
        import jax

        start, start_cpu = time.perf_counter(), _thread_time()
        self._at_current_precision()
        tensors = [args[i] for i in self._tensor_at]
        passthrough = {o.index: args[o.index] for o in self._outputs if o.kind == "input"}
        args.clear()
        keep: list = []
        STATS.calls += 1
        with jax.enable_x64(True):
            if self._collectives is not None:
                outs = self._collectives.run(self, tensors, keep)  # this rank's blocks: (1, *shape)
            elif self._on_device:
                outs = self._run_on_device(tensors)
                STATS.shaped_inputs += self._num_shaped[0]
                STATS.shaped_results += self._num_shaped[1]
                STATS.flat_edge_bytes += self._flat_edge_bytes
            else:
                arrays = boundary.to_jax(tensors, self._avals, self._sharding, self._device, keep)
                outs = self._computed(self._run(arrays))
        del keep, tensors
        results = []
        if self._on_device:
            specs, where = self._fresh
            fresh = dict(zip(where, device_io.new_tensors(specs, [outs[i] for i in where])))
        for o in self._outputs:
            if o.kind == "array" and self._on_device:
                made = fresh.get(o.index)
                if made is None:  # a result on the CPU
                    val = self._output_nodes[o.index].meta["val"]
                    made = device_io.new_tensor(outs[o.index], val.shape, o.dtype, host=True)
                results.append(made)
            elif o.kind == "array" and self._collectives is None:
                results.append(self._with_strides(outs[o.index], o.index))
            elif o.kind == "array":
                out = boundary.to_torch(outs[o.index], o.dtype)
                results.append(self._with_strides(boundary.drop_leading(out, self._collectives.num_block_dims),
                                                  o.index))
            elif o.kind == "input":
                results.append(passthrough[o.index])
            elif o.kind == "none":
                results.append(None)
            else:
                results.append(o.value)
        _add(STATS.call_seconds, self.name, time.perf_counter() - start)
        if STATS.cpu_times:
            _add(STATS.call_cpu_seconds, self.name, time.thread_time() - start_cpu)
        return results


    def _with_strides(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """A result in its physical order (``_orders``) as a tensor of torch's shape and strides over the
        same memory."""
        if self._orders[index] is None:
            return t
        val = self._output_nodes[index].meta["val"]
        return boundary.over_memory_of(t, val.shape, val.stride())


_ZERO_KEYS: dict = {}  # device -> the zero key of programs that draw nothing (_device_key)


def _dense_order(val) -> tuple[int, ...] | None:
    """The dim order of a result whose strides torch lays out densely but not row-major (a transposed
    result, channels_last), or None (row-major, or a layout with gaps or overlaps: those come out
    contiguous, as the device makes them)."""
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    shape, strides = tuple(val.shape), tuple(val.stride())
    if _strides.is_contiguous(shape, strides):
        return None
    order = _strides.permuted_order(shape, strides)
    return None if order is None or order == tuple(range(len(shape))) else order


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * (dtype.itemsize if isinstance(dtype, torch.dtype) else np.dtype(dtype).itemsize)


def _physical_shape(shape, order) -> tuple[int, ...]:
    return tuple(shape) if order is None else tuple(shape[d] for d in order)


def _thread_time() -> float:
    """The calling thread's CPU seconds where ``STATS.cpu_times`` asks for them, else 0."""
    return time.thread_time() if STATS.cpu_times else 0.0


def _add(seconds: dict, name: str, value: float) -> None:
    seconds[name] = seconds.get(name, 0.0) + value


# -- the interpreter ---------------------------------------------------------------------------------
def interpret(gm: torch.fx.GraphModule, inputs: list, consts: list, output_nodes: list,
              collectives: Any = None) -> list:
    """Runs ``gm``'s nodes on JAX values (tracers inside ``jax.jit``); the values of ``output_nodes``."""
    from tpudist import ops
    from tpudist.ops import to_jax_dtype

    env: dict[torch.fx.Node, Any] = {}
    it = iter(inputs)
    const_it = iter(consts)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            env[node] = next(it) if (val is None or isinstance(val, torch.Tensor)) else val
        elif node.op == "get_attr":
            env[node] = next(const_it)
        elif node.op == "call_function":
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            try:
                env[node] = _call(node, args, kwargs, collectives, ops)
            except ops.UnsupportedOp as e:
                raise missing_op_error(e.op, node) from e
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and hasattr(env[node], "dtype"):
                want = to_jax_dtype(val.dtype)
                if env[node].dtype != want:
                    env[node] = env[node].astype(want)
        elif node.op == "output":
            break
        else:
            raise UnsupportedGraph(f"node {node.name} ({node.op} {node.target}) at {user_line(node)}: the tpu "
                                   "backend interprets ATen graphs of call_function nodes only")
    return [env[n] for n in output_nodes]


def _call(node, args, kwargs, collectives, ops):
    target = node.target
    if target is operator.getitem:
        return args[0][args[1]]
    if target is torch.ops.higher_order.with_effects:
        # AOTAutograd threads a token through ops with side effects (torch.linalg.inv's
        # _linalg_check_errors): (token, op, *args) -> (token, *op's results); the lowering's own
        # effect (a host callback) keeps its place in the program
        token, op, *op_args = args
        result = ops.call(op, *op_args, **kwargs)
        return (token, *(() if result is None else result if isinstance(result, (tuple, list)) else (result,)))
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        namespace = target.namespace
        if namespace == "_c10d_functional":
            if collectives is None:
                raise UnsupportedGraph(f"{target} at {user_line(node)} outside a collective-aware program")
            return collectives.lower(target, args, kwargs, node)
        if ops.reads_contiguity(target):  # the op's torch kernel depends on its input's strides
            val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            kwargs = {**kwargs, "input_contiguous": not isinstance(val, torch.Tensor) or val.is_contiguous()}
        return ops.call(target, *args, **kwargs)
    raise UnsupportedGraph(f"node {node.name} calls {target!r} at {user_line(node)}: not an ATen op overload; "
                           "the tpu backend lowers ATen graphs (run it through aot_autograd first)")


@functools.cache
def _table_digest() -> str:
    """The lowering table's and this backend's source: a program cached on disk by an older tpudist
    (a lowering fixed since) must not be reused."""
    import tpudist.ops

    h = hashlib.sha256()
    for root in (Path(tpudist.ops.__file__).parent, Path(__file__).parent):  # the table, then tpudist.compile
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _lowerings_digest(gm: torch.fx.GraphModule) -> str:
    """The code of lowerings registered from outside tpudist.ops (custom kernels) the graph uses."""
    from tpudist.ops import lowering_for

    h = hashlib.sha256()
    for node in gm.graph.nodes:
        fn = lowering_for(node.target) if isinstance(node.target, torch._ops.OpOverload) else None  # noqa: SLF001
        code = getattr(fn, "__code__", None)
        if code is not None and not getattr(fn, "__module__", "").startswith("tpudist.ops"):
            h.update(str(node.target).encode())
            h.update(code.co_code)
            h.update(repr(code.co_consts).encode())
    return h.hexdigest()


def host_constants(gm: torch.fx.GraphModule) -> None:
    """Replaces ``gm``'s tensor constants with their host copies (:func:`_fetch_attr`), in place.

    AOTAutograd deep-copies the backward graph module before compiling it, and deep-copying a "tpu"
    tensor goes through a device storage copy that torch 2.13 cannot make for a Python device (it
    crashes the process). The programs read constants as host data anyway."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            value = _fetch_attr(gm, node.target)
            setattr(gm.get_submodule(owner) if owner else gm, name, value)


def _fetch_attr(gm, target: str) -> torch.Tensor:
    """A graph constant (``get_attr``: ``torch.tensor([...])`` in a forward, a lifted buffer) as a
    contiguous CPU tensor of its own: the program takes it as an input, placed once per program.

    AOTAutograd calls the graph compilers with its FakeTensorMode active, where any op on the real
    constant (even ``detach``) asserts; the copy is made with the mode switched off. A "tpu" device
    constant is read to the host here, once, so one path serves both devices (and the program key
    hashes its bytes)."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise UnsupportedGraph(f"graph attribute {target} is a {type(obj).__name__}, not a tensor")
    if isinstance(obj, FakeTensor):
        raise UnsupportedGraph(f"graph attribute {target} is a FakeTensor (shape={tuple(obj.shape)}, "
                               f"dtype={obj.dtype}) with no value; the tpu backend needs real constants")
    with unset_fake_temporarily(), torch.no_grad():
        return obj.detach().to("cpu", copy=True).contiguous()


def _jax_dtype(dtype: torch.dtype):
    from tpudist.ops import to_jax_dtype

    return to_jax_dtype(dtype)


def _aval_of(t: torch.Tensor):
    import jax

    return jax.core.ShapedArray(tuple(t.shape), _jax_dtype(t.dtype))


def _bytes_of(t: torch.Tensor) -> bytes:
    arr, _owner = boundary.numpy_view(t)
    return arr.tobytes()
