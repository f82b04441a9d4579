"""Collective lowerings: each c10d op is a small jitted ``shard_map`` program over a group's mesh.

Every program input is a global array whose row ``i`` is group rank ``i``'s local piece (sharded
along the one mesh axis ``AXIS``), and so is every output. A :class:`Lowering` says how a rank's
block becomes the inputs and the outputs its result: one of each for most ops, one per peer for the
direct lowerings of all_to_all, all_gather, reduce_scatter and all_reduce (see ``_to_peers``).
Programs are cached by :class:`ProgramKey`; :func:`cache_stats` makes the hit rate observable.
Every program first exchanges fixed-shape envelope rows (:mod:`~tpudist.process_group.envelope`):
the ranks' fingerprints, and the data itself when it fits, in which case that exchange is the
whole program and the result is finished on the host.

Ops that only move data (all_gather, all_to_all, broadcast, scatter, permute) run on raw bytes, so
they are bit-exact for every dtype (``-0.0``, NaN payloads, bool, complex) and share programs across
dtypes of the same size.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tpudist.process_group import envelope
from tpudist.process_group.switch import Switch

AXIS = "ranks"

# ReduceOp names (lower case) as they appear in keys and errors.
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = (
    "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_REDUCES = (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM)
_DTYPE_NAMES = ("bfloat16", "bool", "complex128", "complex64", "float16", "float32", "float64",
                "int16", "int32", "int64", "int8", "uint8")
_WIDE = frozenset({"int64", "uint64", "float64", "complex128"})
_FOLDED = {PRODUCT: "multiply", BAND: "bitwise_and", BOR: "bitwise_or", BXOR: "bitwise_xor"}


@dataclass(frozen=True, slots=True)
class ProgramKey:
    """Everything that decides the compiled program: same key, same program on every rank."""

    op: str
    shape: tuple[int, ...]  # one rank's input block
    dtype: str  # numpy dtype name of the block
    group: tuple[int, ...]  # global ranks in group order: the mesh
    reduce: str | None = None
    static: tuple = ()  # op-specific: root, premul factor, permutation
    root: int | None = None  # reduce and gather: the program is the all_ form's, the result stays here


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(frozen=True, slots=True)
class Lowering:
    """How one op runs as a program over this rank's block.

    ``split`` cuts the block into the program's inputs (host views, no copies where rows are
    contiguous), ``body`` maps those local inputs to local outputs inside ``shard_map``, and
    ``join`` makes the op's result from the outputs (and the block, for the part of the result a
    rank keeps for itself), in ``dest`` when given one of the result's shape and it can. Most ops are one input and one output; the direct lowerings send each
    peer its piece as a separate ``ppermute`` and so need neither XLA's slicing of the input nor
    its concatenation of the output (``_direct``).
    """

    split: Callable[[np.ndarray], list[np.ndarray]]
    body: Callable[..., tuple]
    join: Callable[[np.ndarray, list[np.ndarray], np.ndarray | None], np.ndarray]


def _single(body: Callable[[Any], Any]) -> Lowering:
    """A lowering with one input (the block) and one output (the result)."""
    return Lowering(lambda block: [block], lambda x: (body(x),), lambda block, outs, dest: outs[0])


@dataclass(frozen=True, slots=True)
class Compiled:
    """A built program with what each call needs ready: no per-call sharding or aval work.

    Every program first exchanges :mod:`~tpudist.process_group.envelope` rows (fingerprints, and
    the data itself when it fits); ``fn`` is None when that exchange is the whole collective.
    """

    plan: envelope.Plan
    envelope_fn: Callable[[Any], Any]  # rows -> rows received (shared by a group's small ops)
    rows: np.ndarray  # the rows this rank sends, rewritten by every call (see _rows_buffer)
    x_rows: Any  # the global array over ``rows``' memory, or None where XLA would not alias it
    fn: Callable[..., Any] | None  # (*inputs, rows) -> (outputs, fingerprints); None: small
    lowering: Lowering | None  # None: small
    fingerprint_host: np.ndarray  # what the key decides; a call adds its group and sequence number
    envelope_aval: Any
    avals: tuple  # one per program input
    sharding: Any
    device: Any
    x64: bool  # JAX truncates 64-bit types unless x64 is on for the call (FACTS.md)

    def call_fingerprint(self, group_code: int, seq: int) -> np.ndarray:
        """The key's fingerprint plus the call's group and per-group sequence number: ranks that
        skipped a collective, or issued two groups' collectives in different orders, differ here."""
        return np.concatenate([self.fingerprint_host, np.array([group_code, seq], np.int32)])

    def run(self, block: np.ndarray, fingerprint: np.ndarray,
            dest: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """Runs on our block; returns (our result, every rank's fingerprint). The result is None
        when the fingerprints disagree (then no data moved). ``dest``, the caller's output in the
        result's shape, receives the result where the lowering can assemble it there (the result
        is then ``dest``): one copy fewer. It is written only after every input has been read, so
        it may be the block's own memory."""
        rows = envelope.pack(self.plan, block, fingerprint, self.rows)
        x_rows = self.x_rows
        if x_rows is None:
            x_rows = xla_batched_put(self.envelope_aval, self.sharding, rows, self.device)
        if self.fn is None:
            got = np.asarray(self.envelope_fn(x_rows)._arrays[0])[0]
            fps = envelope.fingerprints(got)
            return (envelope.finish(self.plan, got) if (fps == fps[0]).all() else None), fps
        import jax

        with jax.enable_x64(self.x64):
            # Each input aliases the block's memory where it is aligned (batched_device_put builds
            # the global array in ~3 us, against ~70 us for device_put followed by
            # make_array_from_single_device_arrays: measured here, jax 0.10.2).
            inputs = [xla_batched_put(aval, self.sharding, piece, self.device)
                      for aval, piece in zip(self.avals, self.lowering.split(block))]
            outs, fps = self.fn(*inputs, x_rows)
            fps = np.asarray(fps._arrays[0])[0]  # the program has finished: inputs are read
            if not (fps == fps[0]).all():
                return None, fps
            return self.lowering.join(block, [np.asarray(o._arrays[0])[0] for o in outs], dest), fps


_cache: dict[tuple[ProgramKey, bool, bool], Compiled] = {}
# Ranks compare fingerprints before moving data (see _build). TPUDIST_VERIFY=0 drops the rows
# exchange in front of collectives larger than the envelope (small ones travel in it anyway): one
# collective fewer per call, and a rank that issues a different collective than its peers corrupts
# data or aborts, as with NCCL. Must be the same on every rank.
_VERIFY = Switch(os.environ.get("TPUDIST_VERIFY", "1") != "0")
verify_collectives = _VERIFY.scoped  # (enabled): the cross-rank check, for a scope

# Collectives whose data fits the envelope finish in its exchange (see envelope.py); the switch
# exists so tests can run every op through its full program too. Same on every rank.
_SMALL = Switch(True)
small_collectives = _SMALL.scoped  # (enabled): the one-exchange path for small collectives

_meshes: dict[tuple[int, ...], Any] = {}
_envelope_programs: dict[tuple[int, ...], Any] = {}
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


def mesh_of(group: tuple[int, ...]) -> Any:
    """The 1-D ``jax.sharding.Mesh`` over the devices of ``group`` (global ranks), in group order."""
    mesh = _meshes.get(group)
    if mesh is None:
        from jax.sharding import Mesh

        from tpudist.process_group import runtime

        rt = runtime.current()
        mesh = _meshes[group] = Mesh(np.array([rt.device(r) for r in group]), (AXIS,))
    return mesh


def program(key: ProgramKey) -> Compiled:
    """The compiled program for ``key``, built on first use."""
    entry = (key, _VERIFY.on, _SMALL.on)
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
    ops, dtypes = sorted(LOWERINGS), sorted(_DTYPE_NAMES)
    reduce_code = _REDUCES.index(key.reduce) + 1 if key.reduce else 0
    root_code = 0 if key.root is None else key.root + 1
    numel = int(np.prod(key.shape, dtype=np.int64))
    digest = zlib.crc32(repr((key.op, key.shape, key.dtype, key.reduce, key.static, key.root)).encode())
    return np.array([root_code * 256 + ops.index(key.op), reduce_code * 256 + dtypes.index(key.dtype),
                     numel & 0x7FFFFFFF, digest - 2**31], np.int32)


def describe_fingerprint(fp: np.ndarray, group_names: dict[int, str] | None = None) -> str:
    """E.g. "all_reduce sum of 4 x float32 (#3 on group 0)", "reduce sum to rank 1 of 4 x ..."."""
    ops, dtypes = sorted(LOWERINGS), sorted(_DTYPE_NAMES)
    root_code, op_code = divmod(int(fp[0]), 256)
    reduce_code, dtype_code = divmod(int(fp[1]), 256)
    op = ops[op_code]
    reduce = f" {_REDUCES[reduce_code - 1]}" if reduce_code else ""
    if root_code:
        op = {"all_reduce": "reduce", "all_gather": "gather"}.get(op, op)
        reduce += f" to rank {root_code - 1}"
    group = (group_names or {}).get(int(fp[4]), f"with code {int(fp[4])}")
    return f"{op}{reduce} of {int(fp[2])} x {dtypes[dtype_code]} (#{int(fp[5])} on group {group})"


def group_code(name: str) -> int:
    return zlib.crc32(name.encode()) - 2**31


def _build(key: ProgramKey, verify: bool, small: bool) -> Compiled:
    """The program: exchange envelope rows first, and move data only if every rank agrees.

    Ranks that disagree (different op, shape, dtype or reduce op: legal to write, wrong to run)
    would otherwise exchange mismatched buffers: garbage, or a process abort in gloo. The rows
    exchange has one shape whatever the op (see :mod:`~tpudist.process_group.envelope`); the data
    collective runs under a ``lax.cond`` that every rank evaluates identically. Collectives whose
    data fits the envelope need no second program.
    """
    import jax
    import jax.numpy as jnp
    from jax._src import core
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpudist.process_group import runtime

    n = len(key.group)
    mesh = mesh_of(key.group)
    rt = runtime.current()
    me = key.group.index(rt.process_id)
    fn = lowering = None
    avals: tuple = ()
    if not (small and envelope.fits(key)):
        lowering = LOWERINGS[key.op](key, me)
        # Shapes only: a zero-strided stand-in for the block (at most a padded chunk is allocated).
        stand_in = np.broadcast_to(np.zeros((), np.dtype(key.dtype)), key.shape)
        avals = tuple(core.ShapedArray((n, *p.shape), p.dtype) for p in lowering.split(stand_in))

        def unchecked(*args):
            fps = envelope.fingerprints(args[-1][0])
            outs = lowering.body(*(x[0] for x in args[:-1]))
            return tuple(o[None] for o in outs), jnp.broadcast_to(fps[0], fps.shape)[None]

        def checked(*args):
            xs, rows = [x[0] for x in args[:-1]], args[-1]
            out_shapes = jax.eval_shape(lowering.body, *xs)  # inside shard_map: the axis is bound
            fps = envelope.fingerprints(_exchange(rows[0]))
            agree = jnp.all(fps == fps[0:1])
            outs = jax.lax.cond(agree, lambda vs: lowering.body(*vs),
                                lambda vs: tuple(jnp.zeros(o.shape, o.dtype) for o in out_shapes), xs)
            return tuple(o[None] for o in outs), fps[None]

        fn = jax.jit(jax.shard_map(checked if verify else unchecked, mesh=mesh,
                                   in_specs=(P(AXIS),) * (len(avals) + 1), out_specs=P(AXIS),
                                   check_vma=False))
    fp = fingerprint(key)
    sharding = NamedSharding(mesh, P(AXIS))
    envelope_aval = core.ShapedArray((n, n, envelope.WORDS), np.int32)
    rows, x_rows = _rows_buffer(n, envelope_aval, sharding, rt.local_device)
    return Compiled(envelope.plan(key, me, carries_data=fn is None), _envelope_program(key.group),
                    rows, x_rows, fn, lowering, fp, envelope_aval, avals, sharding, rt.local_device,
                    key.dtype in _WIDE)


def _rows_buffer(n: int, aval: Any, sharding: Any, device: Any) -> tuple[np.ndarray, Any]:
    """A program's envelope rows, 64-byte aligned, and the global array XLA reads them from.

    XLA:CPU takes an aligned numpy buffer as it is (no copy) and reads it when a program runs, so
    one global array serves every call: each call rewrites the rows, runs, and waits for the result
    before the next call can write (a process runs one collective at a time). That saves building
    the array per call (~20 of the ~140 us a small all_reduce costs in Python; measured here). Where
    XLA copies instead (the pointers differ), the array is built per call from the rows.
    """
    nbytes = n * envelope.WORDS * 4
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    rows = raw[start:start + nbytes].view(np.int32).reshape(n, envelope.WORDS)
    x_rows = xla_batched_put(aval, sharding, rows, device)
    if x_rows.addressable_data(0).unsafe_buffer_pointer() != rows.ctypes.data:
        x_rows = None
    return rows, x_rows


def _exchange(rows):
    """Row j of ours goes to group rank j; row r of the result came from group rank r."""
    import jax

    return jax.lax.all_to_all(rows, AXIS, split_axis=0, concat_axis=0, tiled=True)


def _envelope_program(group: tuple[int, ...]) -> Callable[[Any], Any]:
    """The rows exchange alone: the whole program of every collective that fits the envelope."""
    fn = _envelope_programs.get(group)
    if fn is None:
        import jax
        from jax.sharding import PartitionSpec as P

        fn = _envelope_programs[group] = jax.jit(jax.shard_map(
            lambda rows: _exchange(rows[0])[None], mesh=mesh_of(group), in_specs=P(AXIS),
            out_specs=P(AXIS), check_vma=False))
    return fn


def xla_batched_put(aval: Any, sharding: Any, block: np.ndarray, device: Any) -> Any:
    from jax._src.lib import xla_client

    return xla_client.batched_device_put(aval, sharding, [block[None]], [device], True)


# -- lowerings: (key, this rank's group index) -> Lowering ----------------------------------------
LOWERINGS: dict[str, Callable[[ProgramKey, int], Lowering]] = {}


def _lowering(op: str):
    def register(fn):
        LOWERINGS[op] = fn
        return fn
    return register


def _is_low_precision(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


def _fold(parts: list, key: ProgramKey):
    """Reduces ``parts`` (one per rank) with ``key.reduce``, as envelope.fold does on the host."""
    import jax.numpy as jnp

    reduce, dtype = key.reduce, parts[0].dtype
    if reduce in (SUM, AVG, PREMUL_SUM):
        # XLA:CPU reduces 16-bit floats ~10x slower than float32 (FACTS.md); float32 is also exact-er.
        wide = [p.astype(jnp.float32) for p in parts] if _is_low_precision(key.dtype) else parts
        if reduce == PREMUL_SUM:
            wide = [w * jnp.asarray(key.static[0], dtype=w.dtype) for w in wide]
        total = functools.reduce(jnp.add, wide)
        if reduce == AVG:
            total = total / len(parts)
        return total.astype(dtype)
    fn = {MIN: jnp.minimum, MAX: jnp.maximum}.get(reduce) or getattr(jnp, _FOLDED[reduce])
    return functools.reduce(fn, parts)


def _to_peers(pieces, n: int) -> tuple:
    """Direct sends: ``pieces[k - 1]`` goes to the rank ``k`` places after ours (one ``ppermute``
    each); output ``k - 1`` came from the rank ``k`` places before ours.

    The direct lowerings (all_to_all, all_gather, reduce_scatter, all_reduce) are built on this.
    XLA:CPU's own all_to_all slices its input into per-peer buffers and concatenates its output, two
    extra copies: at 64 MiB it took 98 ms on 2 ranks and 155 ms on 4, the ppermutes 37 and 63 (gloo
    32 and 45). Its all-reduce took 57 and 135 ms, a reduce-scatter and all-gather built from these
    sends 46 and 102 (gloo 45 and 120; benchmarks/collectives.py has the table).
    """
    import jax

    return tuple(jax.lax.ppermute(p, AXIS, perm=[(i, (i + k) % n) for i in range(n)])
                 for k, p in enumerate(pieces, start=1))


def _place(own: np.ndarray, outs: list[np.ndarray], me: int, rows: int,
           dest: np.ndarray | None) -> np.ndarray:
    """The result whose row ``me`` is ``own`` and row ``me - k`` output ``k - 1`` (see _to_peers),
    in ``dest`` if given. ``own`` may live in ``dest``'s memory: it is placed first."""
    result = np.empty((rows, *own.shape), own.dtype) if dest is None else dest
    result[me] = own
    for k, out in enumerate(outs, start=1):
        result[(me - k) % rows] = out
    return result


@_lowering("all_reduce")
def _lower_all_reduce(key: ProgramKey, me: int) -> Lowering:
    """A reduce-scatter and an all-gather of direct sends: rank j folds chunk j of every rank's
    tensor and sends the total to every other rank. Each rank sends 2(n-1)/n of its data, as a ring
    does, in two rounds instead of 2(n-1); every rank ends with the same bits."""
    n = len(key.group)
    numel = int(np.prod(key.shape, dtype=np.int64))
    width = max(1, -(-numel // n))  # chunk j is flat[j * width:(j + 1) * width], the last padded

    def split(block):
        flat = block.reshape(-1)
        pieces = [flat[j * width:(j + 1) * width] for j in ((me + k) % n for k in range(n))]
        return [p if p.shape[0] == width else np.concatenate([p, np.zeros(width - p.shape[0], p.dtype)])
                for p in pieces]

    def body(own, *pieces):
        total = _fold([own, *_to_peers(pieces, n)], key)
        return (total, *_to_peers([total] * (n - 1), n))

    def join(block, outs, dest):
        if dest is not None and numel == n * width:  # no padding: the chunks tile dest
            return _place(outs[0], outs[1:], me, n, dest.reshape(n, width)).reshape(key.shape)
        return _place(outs[0], outs[1:], me, n, None).reshape(-1)[:numel].reshape(key.shape)

    return Lowering(split, body, join)


@_lowering("reduce_scatter")
def _lower_reduce_scatter(key: ProgramKey, me: int) -> Lowering:
    """Block ``(n, *chunk)`` -> chunk ``i`` of the reduction on rank ``i``: row j goes straight to
    rank j, which folds what it receives. XLA:CPU's own reduce-scatter copies the input and runs
    gloo's halving-doubling: 1.5-3x slower (measured)."""
    n = len(key.group)
    return Lowering(lambda block: [block[(me + k) % n] for k in range(n)],
                    lambda own, *pieces: (_fold([own, *_to_peers(pieces, n)], key),),
                    lambda block, outs, dest: outs[0])


@_lowering("all_gather")
def _lower_all_gather(key: ProgramKey, me: int) -> Lowering:
    """Our block to every peer, one direct send each; the result's row ``i`` is rank ``i``'s block."""
    n = len(key.group)
    return Lowering(lambda block: [block] if n > 1 else [],
                    lambda *x: _to_peers(x * (n - 1), n),
                    lambda block, outs, dest: _place(block, outs, me, n, dest))


@_lowering("all_to_all")
def _lower_all_to_all(key: ProgramKey, me: int) -> Lowering:
    """Block ``(n, *chunk)``: row ``j`` goes to rank ``j``; result row ``i`` came from rank ``i``.
    Our own row never enters the program."""
    n = len(key.group)
    return Lowering(lambda block: [block[(me + k) % n] for k in range(1, n)],
                    lambda *pieces: _to_peers(pieces, n),
                    lambda block, outs, dest: _place(block[me], outs, me, n, dest))


@_lowering("broadcast")
def _lower_broadcast(key: ProgramKey, me: int) -> Lowering:
    """A binomial tree of ``ppermute`` s from the root: ceil(log2 n) rounds, each moving the raw bits
    once per edge. (A masked psum also works, but XLA:CPU reduces it: 4-10x slower than gloo.)"""
    import jax

    n, root = len(key.group), key.static[0]
    if n == 2:
        # One transfer; the root's result is never written back, so it needs no select (on XLA:CPU a
        # select over 64 MiB cost 70 ms, 2.5x the transfer itself: measured).
        return _single(lambda x: jax.lax.ppermute(x, AXIS, perm=[(root, 1 - root)]))

    def body(x):
        pos = (jax.lax.axis_index(AXIS) - root) % n  # position relative to the root
        have = x
        span = 1
        while span < n:  # round: positions [0, span) send to [span, 2 * span)
            perm = [((src + root) % n, (src + span + root) % n) for src in range(min(span, n - span))]
            got = jax.lax.ppermute(have, AXIS, perm=perm)
            # Each rank keeps one of the two buffers: a per-device cond moves one, where a select
            # reads both (64 MiB on 4 ranks, bare: 99-113 ms with jnp.where, 66-90 ms with cond).
            have = jax.lax.cond((pos >= span) & (pos < 2 * span), lambda a, b: a, lambda a, b: b,
                                got, have)
            span *= 2
        return have
    return _single(body)


@_lowering("scatter")
def _lower_scatter(key: ProgramKey, me: int) -> Lowering:
    """Block ``(n, *chunk)`` on the root: one all_to_all, each rank keeps the row from the root."""
    import jax

    root = key.static[0]
    return _single(lambda x: jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)[root])


@_lowering("permute")
def _lower_permute(key: ProgramKey, me: int) -> Lowering:
    """``static`` is the permutation as (source, destination) group-index pairs."""
    import jax

    return _single(lambda x: jax.lax.ppermute(x, AXIS, perm=list(key.static)))


@_lowering("barrier")
def _lower_barrier(key: ProgramKey, me: int) -> Lowering:
    import jax

    return _single(lambda x: jax.lax.psum(x, AXIS))
