"""Collective programs: each c10d op is a small jitted ``shard_map`` program over a group's mesh.

Every program input is a global array whose row ``i`` is group rank ``i``'s local piece (sharded
along the one mesh axis ``AXIS``), and so is every output. A :class:`Lowering` says how a rank's
block becomes the inputs and the outputs its result: one of each for most ops, one per peer for the
direct lowerings of all_to_all, all_gather, reduce_scatter and all_reduce (see
:mod:`~tpudist.process_group.lowerings`).
Programs are cached in memory by :class:`~tpudist.process_group.keys.ProgramKey`; :func:`cache_stats` makes the hit rate
observable. Their XLA executables are also kept in tpudist's program cache
(:func:`tpudist.runtime.program_cache.load_or_compile`), keyed by the program and its devices: a rank
loads what any rank of any run compiled (2-3 ms instead of a 100-220 ms compile).
Every collective first runs its group's exchange of fixed-shape envelope rows
(:mod:`~tpudist.process_group.envelope`): the ranks' fingerprints, and the data itself when it
fits, in which case that exchange is the whole collective and the result is finished on the host;
otherwise the op's data program follows, if every rank's fingerprint agrees.

Ops that only move data (all_gather, all_to_all, broadcast, scatter, permute) run on raw bytes, so
they are bit-exact for every dtype (``-0.0``, NaN payloads, bool, complex) and share programs across
dtypes of the same size.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tpudist.process_group import envelope, runtime
from tpudist.process_group.keys import DTYPE_NAMES, ProgramKey
from tpudist.process_group.lowerings import (  # noqa: F401 - the ReduceOp names are used via programs.*
    AVG, AXIS, BAND, BOR, BXOR, LOWERINGS, MAX, MIN, PREMUL_SUM, PRODUCT, REDUCES, SUM, Lowering)
from tpudist.process_group.runtime import GLOO_LOOP
from tpudist.process_group.switch import Switch

_WIDE = frozenset({"int64", "uint64", "float64", "complex128"})


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    xla_compiles: int = 0  # executables compiled in this process
    xla_loaded: int = 0  # executables read from tpudist's program cache instead

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Executable:
    """A cached program and the cheapest measured way to call it and read this rank's outputs.

    With tpudist's program cache on, the program is compiled (or its executable loaded from the
    cache) at its first call, which then puts the ``jax.stages.Compiled`` in its place: calling
    that costs what the jitted call does (7.8-8.8 us against 7.5-9.0 us for a 1-input program,
    measured here).

    Measured per call in main-thread CPU, a 2-output program on one CPU device (jax 0.10.2,
    issue 15): the jitted call plus ``np.asarray(out._arrays[0])`` 17-22 us; the compiled
    executable's ``execute_sharded`` saves 2-4 us in the call but its outputs cost ~10 us more to
    reach (``disassemble_into_single_device_arrays`` builds a sharding per output in Python):
    23-30 us. So the jitted call it is.
    """

    __slots__ = ("program",)

    def __init__(self, jitted: Callable[..., Any], mesh: Any = None, parts: tuple = ()):
        from tpudist.runtime import program_cache

        cached = mesh is not None and program_cache.default_cache() is not None
        self.program = _FirstCall(self, jitted, list(mesh.devices.flat), parts) if cached else jitted

    def __call__(self, *args: Any) -> list[np.ndarray]:
        """This rank's block of each output (host views, no copies)."""
        return [_local_block(o) for o in self.program(*args)]

    def first(self, *args: Any) -> np.ndarray:
        """This rank's block of the first output alone (a prepared small all_reduce's one output)."""
        return _local_block(self.program(*args)[0])


def _local_block(output: Any) -> np.ndarray:
    """This rank's block of a program's output, a host view (its one local shard, without the
    sharding JAX's public ``addressable_data`` builds per call)."""
    return np.asarray(output._arrays[0])[0]  # noqa: SLF001 - the local shard


class CachedProgram:
    """A jitted program whose XLA executable comes from tpudist's program cache: loaded (or
    compiled and stored) at its first call, keyed by ``parts`` (what decides the program), this
    package's source and ``devices`` (the device assignment, in the program's mesh order).

    For programs of the collectives that are not :class:`Executable` s: the device tensors' read,
    collective and write programs (``device_arrays``), compiled graphs' fingerprint check
    (``tpudist.compile.collectives``), and DTensor's redistribute and SPMD programs
    (``tpudist.sharding``). Without a cache the jitted program runs as it is.
    """

    __slots__ = ("program",)

    def __init__(self, jitted: Callable[..., Any], devices: list, parts: tuple):
        from tpudist.runtime import program_cache

        self.program = _FirstCall(self, jitted, devices, parts) if program_cache.default_cache() is not None else jitted

    def __call__(self, *args: Any) -> Any:
        return self.program(*args)


class _FirstCall:
    """An :class:`Executable`'s or :class:`CachedProgram`'s program until its first call, which
    loads or compiles it and puts the ``jax.stages.Compiled`` in its place."""

    __slots__ = ("owner", "jitted", "devices", "parts")

    def __init__(self, owner: Executable | CachedProgram, jitted: Callable[..., Any], devices: list, parts: tuple):
        self.owner, self.jitted, self.devices, self.parts = owner, jitted, devices, parts

    def __call__(self, *args: Any) -> Any:
        from tpudist.runtime import program_cache

        compiled, _, loaded = program_cache.load_or_compile("collective", (*self.parts, _source_digest()),
                                                            self.jitted, args, self.devices)
        with _lock:
            if loaded:
                _stats.xla_loaded += 1
            else:
                _stats.xla_compiles += 1
        self.owner.program = compiled  # later calls go straight to XLA
        return compiled(*args)


@functools.cache
def _source_digest() -> str:
    """This package's source: a program written by another tpudist (a lowering fixed since) is not reused."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Compiled:
    """A built program with what each call needs ready: no per-call sharding or aval work.

    Every call first exchanges :mod:`~tpudist.process_group.envelope` rows (fingerprints, and
    the data itself when it fits; skipped for data programs when ``verify`` is off); ``fn`` is
    None when that exchange is the whole collective. A data program that recurs switches to its
    one-program form (``recurring``): the exchange at its head, the data under a ``lax.cond``.
    """

    plan: envelope.Plan
    envelope_fn: Executable  # rows -> rows received (shared by a group's programs)
    rows: np.ndarray  # the rows this rank sends, one buffer per group (see _rows_buffer)
    x_rows: Any  # the global array over ``rows``' memory, or None where XLA would not alias it
    fn: Executable | None  # *inputs -> outputs: the data program; None: small
    verify: bool  # the envelope exchange runs before ``fn`` (always where ``fn`` is None)
    lowering: Lowering | None  # None: small
    fingerprint_host: np.ndarray  # what the key decides; a call adds its group and sequence number
    envelope_aval: Any
    avals: tuple  # one per program input
    sharding: Any
    device: Any
    loop_idle: bool  # the gloo loop thread's policy for this program (see runtime.GlooLoop)
    x64: bool  # JAX truncates 64-bit types unless x64 is on for the call (FACTS.md)
    recurring: Recurring | None = None  # where the one-program form may take over (see Recurring)

    def call_fingerprint(self, group_code: int, seq: int) -> np.ndarray:
        """The key's fingerprint plus the call's group and per-group sequence number: ranks that
        skipped a collective, or issued two groups' collectives in different orders, differ here."""
        fp = self.fingerprint_host.copy()
        fp[-2:] = group_code, seq
        return fp

    def run(self, block: np.ndarray, fingerprint: np.ndarray,
            dest: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """Runs on our block; returns (our result, every rank's fingerprint). The result is None
        when the fingerprints disagree (then no data moved). ``dest``, the caller's output in the
        result's shape, receives the result where the lowering can assemble it there (the result
        is then ``dest``): one copy fewer. It is written only after every input has been read, so
        it may be the block's own memory."""
        recurring = self.recurring
        if recurring is not None and recurring.runs >= FUSE_AFTER:
            return self._run_fused(recurring.fused, block, fingerprint, dest)
        if self.verify:
            GLOO_LOOP.idle(True)  # the exchange is latency-bound
            got = self.envelope_fn(self._rows_in(block, fingerprint))[0]
            fps = envelope.fingerprints(got)
            if not all_agree(fps, fingerprint):
                return None, fps
            if recurring is not None:
                recurring.runs += 1  # every rank counts this call: every fingerprint agreed
        else:
            fps = np.broadcast_to(fingerprint, (len(self.plan.key.group), len(fingerprint)))
        if self.fn is None:
            result = envelope.finish(self.plan, got)
            if dest is not None and dest.shape == result.shape and dest.dtype == result.dtype:
                np.copyto(dest, result)  # the caller's output: nothing left to copy back
                return dest, fps
            return result, fps
        GLOO_LOOP.idle(self.loop_idle)
        return self.lowering.join(block, self._run_program(self.fn, block), dest), fps

    def _rows_in(self, block: np.ndarray, fingerprint: np.ndarray) -> Any:
        """The envelope rows of this call, packed, as the global array the exchange reads."""
        rows = envelope.pack(self.plan, block, fingerprint, self.rows)
        if self.x_rows is not None:
            return self.x_rows
        return xla_batched_put(self.envelope_aval, self.sharding, rows, self.device)

    def _run_fused(self, fused: Executable, block: np.ndarray, fingerprint: np.ndarray,
                   dest: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray]:
        """``run`` in the one-program form: the program exchanges the rows and moves data only
        where every rank's fingerprint agrees (its ``lax.cond`` decides alike on every rank)."""
        x_rows = self._rows_in(block, fingerprint)
        GLOO_LOOP.idle(self.loop_idle)  # idle: recurring programs are within IDLE_DATA_BYTES
        *outs, fps = self._run_program(fused, block, x_rows)
        if not all_agree(fps, fingerprint):
            return None, fps  # no rank moved data
        return self.lowering.join(block, outs, dest), fps

    def _run_program(self, fn: Executable, block: np.ndarray, *extra: Any) -> list[np.ndarray]:
        """``fn`` on the block's pieces, then ``extra`` (the one-program form's rows)."""
        if self.x64:  # JAX truncates 64-bit types unless x64 is on, in puts too (FACTS.md)
            import jax

            with jax.enable_x64(True):
                return self._put_and_run(fn, block, extra)
        return self._put_and_run(fn, block, extra)  # the context costs ~2 us: only where needed

    def _put_and_run(self, fn: Executable, block: np.ndarray, extra: tuple) -> list[np.ndarray]:
        # Each input aliases the block's memory where it is aligned (batched_device_put builds
        # the global array in ~3 us, against ~70 us for device_put followed by
        # make_array_from_single_device_arrays: measured here, jax 0.10.2).
        inputs = [xla_batched_put(aval, self.sharding, piece, self.device)
                  for aval, piece in zip(self.avals, self.lowering.split(block))]
        return fn(*inputs, *extra)  # the program has finished: inputs are read


# A data program whose call every rank verified this many times switches to its one-program form.
FUSE_AFTER = 8


@dataclass(slots=True)
class Recurring:
    """A data program's verified runs, and the one-program form it switches to at FUSE_AFTER.

    Both forms start with the same rows exchange. The separate pair (exchange program, then data
    program) costs one program and one wait more per call; the one-program form compiles 2.7x as
    long per new shape (issue 15, 2 ranks, no persistent cache: 276-301 ms against 105-110 ms for
    a first all_reduce). So a key pays for it only once it recurs, as a training loop's collectives
    do. A run counts only where every rank's fingerprint agreed, so every rank has counted the same
    calls and switches at the same one: ranks never run the two forms of one collective together.
    """

    fused: Executable  # (*inputs, rows) -> (*outputs, fingerprints); jitted, compiled on first call
    runs: int = 0


def all_agree(fingerprints: np.ndarray, ours: np.ndarray) -> bool:
    """Whether every rank's fingerprint is ours (bytes compared: ~3 us less than numpy's all())."""
    return fingerprints.tobytes() == ours.tobytes() * len(fingerprints)


_cache: dict[tuple[ProgramKey, bool, bool], Compiled] = {}
# Ranks compare fingerprints before moving data (see _build). TPUDIST_VERIFY=0 drops the rows
# exchange in front of collectives larger than the envelope (small ones travel in it anyway): one
# collective fewer per call, and a rank that issues a different collective than its peers corrupts
# data or aborts, as with NCCL. Must be the same on every rank.
VERIFY = Switch(os.environ.get("TPUDIST_VERIFY", "1") != "0")
verify_collectives = VERIFY.scoped  # (enabled): the cross-rank check, for a scope

# Collectives whose data fits the envelope finish in its exchange (see envelope.py); the switch
# exists so tests can run every op through its full program too. Same on every rank.
_SMALL = Switch(True)
small_collectives = _SMALL.scoped  # (enabled): the one-exchange path for small collectives


def small_enabled() -> bool:
    """Whether collectives that fit the envelope finish in its exchange (see small_collectives)."""
    return _SMALL.on


_meshes: dict[tuple[int, ...], Any] = {}
_envelope_programs: dict[tuple[int, ...], Any] = {}
_rows_buffers: dict[tuple[int, ...], tuple[np.ndarray, Any]] = {}
_stats = CacheStats()
_lock = threading.Lock()


def cache_stats() -> CacheStats:
    """Counts of program cache hits and misses (misses = programs built) in this process."""
    return _stats


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _meshes.clear()
        _envelope_programs.clear()
        _rows_buffers.clear()


runtime.on_teardown(clear_cache)  # the programs and meshes hold the world's devices


def mesh_of(group: tuple[int, ...]) -> Any:
    """The 1-D ``jax.sharding.Mesh`` over the devices of ``group`` (global ranks), in group order."""
    mesh = _meshes.get(group)
    if mesh is None:
        from jax.sharding import Mesh

        rt = runtime.current()
        mesh = _meshes[group] = Mesh(np.array([rt.device(r) for r in group]), (AXIS,))
    return mesh


def program(key: ProgramKey) -> Compiled:
    """The compiled program for ``key``, built on first use."""
    entry = (key, VERIFY.on, _SMALL.on)
    fn = _cache.get(entry)
    if fn is not None:
        _stats.hits += 1
        return fn
    with _lock:
        fn = _cache.get(entry)
        if fn is None:
            fn = _cache[entry] = _build(*entry)  # (key, verify, small)
            _stats.misses += 1
            _stats.by_op[key.op] = _stats.by_op.get(key.op, 0) + 1
        else:
            _stats.hits += 1
    return fn


def fingerprint(key: ProgramKey) -> np.ndarray:
    """What a rank is about to run, as 4 int32: op and root, reduce and dtype, element count, and a
    hash of the rest. Ranks compare it inside the program before any data moves (see :func:`_build`)."""
    ops, dtypes = sorted(LOWERINGS), sorted(DTYPE_NAMES)
    reduce_code = REDUCES.index(key.reduce) + 1 if key.reduce else 0
    root_code = 0 if key.root is None else key.root + 1
    numel = int(np.prod(key.shape, dtype=np.int64))
    digest = zlib.crc32(repr((key.op, key.shape, key.dtype, key.reduce, key.static, key.root)).encode())
    return np.array([root_code * 256 + ops.index(key.op), reduce_code * 256 + dtypes.index(key.dtype),
                     numel & 0x7FFFFFFF, digest - 2**31], np.int32)


def describe_fingerprint(fp: np.ndarray, group_names: dict[int, str] | None = None) -> str:
    """E.g. "all_reduce sum of 4 x float32 (#3 on group 0)", "reduce sum to rank 1 of 4 x ..."."""
    ops, dtypes = sorted(LOWERINGS), sorted(DTYPE_NAMES)
    root_code, op_code = divmod(int(fp[0]), 256)
    reduce_code, dtype_code = divmod(int(fp[1]), 256)
    op = ops[op_code]
    reduce = f" {REDUCES[reduce_code - 1]}" if reduce_code else ""
    if root_code:
        op = {"all_reduce": "reduce", "all_gather": "gather"}.get(op, op)
        reduce += f" to rank {root_code - 1}"
    group = (group_names or {}).get(int(fp[4]), f"with code {int(fp[4])}")
    return f"{op}{reduce} of {int(fp[2])} x {dtypes[dtype_code]} (#{int(fp[5])} on group {group})"


def group_code(name: str) -> int:
    return zlib.crc32(name.encode()) - 2**31


def _build(key: ProgramKey, verify: bool, small: bool) -> Compiled:
    """The programs of ``key``: the envelope exchange first, and the data program only if every
    rank agrees.

    Ranks that disagree (different op, shape, dtype or reduce op: legal to write, wrong to run)
    would otherwise exchange mismatched buffers: garbage, or a process abort in gloo. The rows
    exchange has one shape whatever the op (see :mod:`~tpudist.process_group.envelope`), and every
    rank decides from the same fingerprints whether to run the data program. Collectives whose data
    fits the envelope need no second program.

    The exchange is a program of its own at first. A data program that recurs (:class:`Recurring`)
    and runs with gloo's loop thread idle, as the exchange does (up to :data:`IDLE_DATA_BYTES` per
    rank), then switches to the exchange as its head and the data under a ``lax.cond``
    (:func:`checked_body`): one program per call. With the thread idle for both, that took
    0.80-0.93x the separate pair's time on 2 ranks (128 KB all_gather and reduce_scatter, 1 MiB
    all_reduce) and 0.87-1.02x on 4. Larger data programs keep the separate exchange, so the data
    can move with the thread at normal priority. Measurements: docs/design.md and benchmarks/RESULTS.md.
    """
    import jax
    from jax._src import core
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(key.group)
    mesh = mesh_of(key.group)
    rt = runtime.current()
    me = key.group.index(rt.process_id)
    sharding = NamedSharding(mesh, P(AXIS))
    envelope_aval = core.ShapedArray((n, n, envelope.WORDS), np.int32)
    fn = lowering = recurring = None
    avals: tuple = ()
    if not (small and envelope.fits(key)):
        lowering = LOWERINGS[key.op](key, me)
        # Shapes only: a zero-strided stand-in for the block (at most a padded chunk is allocated).
        stand_in = np.broadcast_to(np.zeros((), np.dtype(key.dtype)), key.shape)
        avals = tuple(core.ShapedArray((n, *p.shape), p.dtype) for p in lowering.split(stand_in))

        def jitted(body: Callable[..., tuple], inputs: int, form: str) -> Executable:
            return Executable(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * inputs,
                                                    out_specs=P(AXIS), check_vma=False)), mesh, (form, key))

        fn = jitted(_unchecked_body(lowering), len(avals), "data")
        if verify and loop_idle(key, False):
            recurring = Recurring(jitted(checked_body(lowering), len(avals) + 1, "checked"))
    fp = np.concatenate([fingerprint(key), np.zeros(2, np.int32)])  # + group code, call number
    rows, x_rows = _rows_buffer(key.group, envelope_aval, sharding, rt.local_device)
    return Compiled(envelope.plan(key, me, carries_data=fn is None), _envelope_program(key.group),
                    rows, x_rows, fn, verify or fn is None, lowering, fp, envelope_aval, avals, sharding,
                    rt.local_device, loop_idle(key, fn is None), key.dtype in _WIDE, recurring)


def _unchecked_body(lowering: Lowering) -> Callable[..., tuple]:
    """The data program's ``shard_map`` body: the lowering on this rank's pieces."""
    def body(*args):
        return tuple(o[None] for o in lowering.body(*(x[0] for x in args)))
    return body


def checked_body(lowering: Lowering) -> Callable[..., tuple]:
    """The one-program form's body: the envelope exchange at its head (its last input the rows, its
    last output every rank's fingerprint), then the data part under a ``lax.cond`` on whether every
    fingerprint agrees, which every rank evaluates alike from the same rows."""
    import jax
    import jax.numpy as jnp

    def body(*args):
        xs, rows = [x[0] for x in args[:-1]], args[-1]
        out_shapes = jax.eval_shape(lowering.body, *xs)  # inside shard_map: the axis is bound
        fps = envelope.fingerprints(exchange(rows[0]))
        agree = jnp.all(fps == fps[0:1])
        outs = jax.lax.cond(agree, lambda vs: lowering.body(*vs),
                            lambda vs: tuple(jnp.zeros(o.shape, o.dtype) for o in out_shapes), xs)
        return (*(o[None] for o in outs), fps[None])
    return body


# Data programs whose block is at most this size run with gloo's loop thread idle too (loop_idle).
IDLE_DATA_BYTES = 16 * 2**20


def loop_idle(key: ProgramKey, small: bool) -> bool:
    """Whether gloo's loop thread runs in SCHED_IDLE for this program (runtime.GlooLoop): for the
    envelope exchange, and for data programs of at most :data:`IDLE_DATA_BYTES` per rank.

    Issue 15 measured idle scheduling helping the latency-bound exchange (bare 4-byte psum
    0.85-30x -> 0.96-1.25x gloo) and slowing one-way bulk transfers (64 MiB ppermute 1.22x ->
    1.36x). Until 2026-12-01 every data program ran with the thread normal, from separate
    ``--loop-ab`` runs on a loaded machine in which no policy won at 1 MiB. Interleaved round by
    round in the same ranks instead (``GLOO_LOOP.force`` toggled, 10 rounds x 10 calls), always
    idle took, of the per-program policy's time: 2 ranks, 128 KB all_gather 0.53-0.72x,
    reduce_scatter 0.85-0.89x, 1 MiB all_reduce 0.85-0.89x, broadcast 0.86-0.91x, all_to_all
    0.67-0.78x; 4 ranks 0.80-1.01x; 4-16 MiB 0.89-1.08x (mostly below 1); 64 MiB 0.95-1.14x
    (reduce_scatter 1.14x). Hence the bound. The switch is one syscall (1-2 us), made only when
    consecutive programs differ.
    """
    if small:
        return True
    return int(np.prod(key.shape, dtype=np.int64)) * np.dtype(key.dtype).itemsize <= IDLE_DATA_BYTES


def _rows_buffer(group: tuple[int, ...], aval: Any, sharding: Any,
                 device: Any) -> tuple[np.ndarray, Any]:
    """The envelope rows every program of ``group`` sends from, 64-byte aligned, and the global
    array XLA reads them from.

    XLA:CPU takes an aligned numpy buffer as it is (no copy) and reads it when a program runs, so
    one global array serves every call: each call rewrites the rows, runs, and waits for the result
    before the next call can write (a process runs one collective at a time). That saves building
    the array per call (~20 of the ~140 us a small all_reduce costs in Python; measured here). Where
    XLA copies instead (the pointers differ), the array is built per call from the rows. One buffer
    per group, not per program: n x 4 KiB each, however many shapes a run uses.
    """
    cached = _rows_buffers.get(group)
    if cached is not None:
        return cached
    nbytes = len(group) * envelope.WORDS * 4
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    rows = raw[start:start + nbytes].view(np.int32).reshape(len(group), envelope.WORDS)
    x_rows = xla_batched_put(aval, sharding, rows, device)
    if x_rows.addressable_data(0).unsafe_buffer_pointer() != rows.ctypes.data:
        x_rows = None
    _rows_buffers[group] = rows, x_rows
    return rows, x_rows


def exchange(rows):
    """Row j of ours goes to group rank j; row r of the result came from group rank r."""
    import jax

    return jax.lax.all_to_all(rows, AXIS, split_axis=0, concat_axis=0, tiled=True)


def _envelope_program(group: tuple[int, ...]) -> Executable:
    """The rows exchange alone: the whole program of every collective that fits the envelope."""
    fn = _envelope_programs.get(group)
    if fn is None:
        import jax
        from jax.sharding import PartitionSpec as P

        mesh = mesh_of(group)
        jitted = jax.jit(jax.shard_map(lambda rows: (exchange(rows[0])[None],), mesh=mesh,
                                       in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
        fn = _envelope_programs[group] = Executable(jitted, mesh, ("envelope", envelope.WORDS))
    return fn


def xla_batched_put(aval: Any, sharding: Any, block: np.ndarray, device: Any) -> Any:
    from jax._src.lib import xla_client

    return xla_client.batched_device_put(aval, sharding, [block[None]], [device], True)
