"""Collective lowerings: each c10d op is a small jitted ``shard_map`` program over a group's mesh.

Every program takes the global array whose row ``i`` is group rank ``i``'s local tensor (sharded
along the one mesh axis ``AXIS``) and returns a global array whose row ``i`` is rank ``i``'s result.
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
class Compiled:
    """A built program with what each call needs ready: no per-call sharding or aval work.

    Every program first exchanges :mod:`~tpudist.process_group.envelope` rows (fingerprints, and
    the data itself when it fits); ``fn`` is None when that exchange is the whole collective.
    """

    plan: envelope.Plan
    envelope_fn: Callable[[Any], Any]  # rows -> rows received (shared by a group's small ops)
    fn: Callable[[Any, Any], Any] | None  # (data, rows) -> (result, fingerprints); None: small
    fingerprint_host: np.ndarray  # what the key decides; a call adds its group and sequence number
    envelope_aval: Any
    aval: Any
    sharding: Any
    device: Any
    x64: bool  # JAX truncates 64-bit types unless x64 is on for the call (FACTS.md)

    def to_global(self, block: np.ndarray) -> Any:
        """The global array whose row i is group rank i's block; ours aliases ``block`` (no copy).

        ``batched_device_put`` builds it in ~3 us, against ~70 us for device_put followed by
        make_array_from_single_device_arrays (measured here, jax 0.10.2).
        """
        return xla_batched_put(self.aval, self.sharding, block, self.device)

    def call_fingerprint(self, group_code: int, seq: int) -> np.ndarray:
        """The key's fingerprint plus the call's group and per-group sequence number: ranks that
        skipped a collective, or issued two groups' collectives in different orders, differ here."""
        return np.concatenate([self.fingerprint_host, np.array([group_code, seq], np.int32)])

    def run(self, block: np.ndarray, fingerprint: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Runs on our block; returns (our result, every rank's fingerprint). The result is None
        when the fingerprints disagree (then no data moved)."""
        rows = envelope.pack(self.plan, block, fingerprint)
        x_rows = xla_batched_put(self.envelope_aval, self.sharding, rows, self.device)
        if self.fn is None:
            got = np.asarray(self.envelope_fn(x_rows)._arrays[0])[0]
            fps = envelope.fingerprints(got)
            return (envelope.finish(self.plan, got) if (fps == fps[0]).all() else None), fps
        import jax

        with jax.enable_x64(self.x64):
            out, fps = self.fn(self.to_global(block), x_rows)
            return np.asarray(out._arrays[0])[0], np.asarray(fps._arrays[0])[0]


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
    """What a rank is about to run, as 4 int32: op, reduce and dtype, element count, and a hash of
    the rest. Ranks compare it inside the program before any data moves (see :func:`_build`)."""
    ops, dtypes = sorted(LOWERINGS), sorted(_DTYPE_NAMES)
    reduce_code = _REDUCES.index(key.reduce) + 1 if key.reduce else 0
    numel = int(np.prod(key.shape, dtype=np.int64))
    digest = zlib.crc32(repr((key.op, key.shape, key.dtype, key.reduce, key.static)).encode())
    return np.array([ops.index(key.op), reduce_code * 256 + dtypes.index(key.dtype),
                     numel & 0x7FFFFFFF, digest - 2**31], np.int32)


def describe_fingerprint(fp: np.ndarray, group_names: dict[int, str] | None = None) -> str:
    """E.g. "all_reduce sum of 4 x float32 (#3 on group 0)"."""
    ops, dtypes = sorted(LOWERINGS), sorted(_DTYPE_NAMES)
    reduce_code, dtype_code = divmod(int(fp[1]), 256)
    reduce = f" {_REDUCES[reduce_code - 1]}" if reduce_code else ""
    group = (group_names or {}).get(int(fp[4]), f"with code {int(fp[4])}")
    return f"{ops[int(fp[0])]}{reduce} of {int(fp[2])} x {dtypes[dtype_code]} (#{int(fp[5])} on group {group})"


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
    fn = None
    if not (small and envelope.fits(key)):
        body = LOWERINGS[key.op](key)

        def unchecked(x, rows):
            fps = envelope.fingerprints(rows[0])
            return body(x[0])[None], jnp.broadcast_to(fps[0], fps.shape)[None]

        def checked(x, rows):
            out_shape = jax.eval_shape(body, x[0])  # inside shard_map: the axis name is bound
            fps = envelope.fingerprints(_exchange(rows[0]))
            agree = jnp.all(fps == fps[0:1])
            out = jax.lax.cond(agree, lambda v: body(v[0]),
                               lambda v: jnp.zeros(out_shape.shape, out_shape.dtype), x)
            return out[None], fps[None]

        fn = jax.jit(jax.shard_map(checked if verify else unchecked, mesh=mesh,
                                   in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS)),
                                   check_vma=False))
    rt = runtime.current()
    fp = fingerprint(key)
    return Compiled(envelope.plan(key, key.group.index(rt.process_id), carries_data=fn is None),
                    _envelope_program(key.group), fn, fp,
                    core.ShapedArray((n, n, envelope.WORDS), np.int32),
                    core.ShapedArray((n, *key.shape), np.dtype(key.dtype)),
                    NamedSharding(mesh, P(AXIS)), rt.local_device, key.dtype in _WIDE)


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


# -- lowerings: key -> body(local block) -> local result ------------------------------------------
LOWERINGS: dict[str, Callable[[ProgramKey], Callable[[Any], Any]]] = {}


def _lowering(op: str):
    def register(fn):
        LOWERINGS[op] = fn
        return fn
    return register


def _is_low_precision(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


def _fold_rows(rows, key: ProgramKey):
    """Reduces ``rows`` (one per rank, rank order) with ``key.reduce``; as envelope.fold does."""
    import jax.numpy as jnp

    reduce = key.reduce
    if reduce in (SUM, AVG, PREMUL_SUM):
        # XLA:CPU reduces 16-bit floats ~10x slower than float32 (FACTS.md); float32 is also exact-er.
        wide = rows.astype(jnp.float32) if _is_low_precision(key.dtype) else rows
        if reduce == PREMUL_SUM:
            wide = wide * jnp.asarray(key.static[0], dtype=wide.dtype)
        total = functools.reduce(jnp.add, [wide[i] for i in range(wide.shape[0])])
        if reduce == AVG:
            total = total / wide.shape[0]
        return total.astype(rows.dtype)
    fn = {MIN: jnp.minimum, MAX: jnp.maximum}.get(reduce) or getattr(jnp, _FOLDED[reduce])
    return functools.reduce(fn, [rows[i] for i in range(rows.shape[0])])


def _reduce_scatter_rows(x, key: ProgramKey):
    """Block ``(n, *chunk)`` -> chunk ``i`` of the reduction on rank ``i``, as one all_to_all and a
    local fold: each rank sends (n-1)/n of its data once, in one round of direct sends. XLA:CPU's
    own reduce-scatter copies the input and runs gloo's halving-doubling: 1.5-3x slower (measured)."""
    import jax

    return _fold_rows(jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True), key)


def _all_reduce(x, key: ProgramKey):
    import jax
    import jax.numpy as jnp

    reduce, n = key.reduce, len(key.group)
    if reduce == MIN:
        return jax.lax.pmin(x, AXIS)
    if reduce == MAX:
        return jax.lax.pmax(x, AXIS)
    if reduce in _FOLDED:
        # No XLA all-reduce for bitwise ops or exact products in rank order: reduce-scatter by
        # all_to_all, fold, all-gather (each rank sends 2(n-1)/n of its data, as a ring does).
        flat = x.reshape(-1)
        pad = -flat.shape[0] % n
        rows = jnp.pad(flat, (0, pad)).reshape(n, -1)
        part = _reduce_scatter_rows(rows, key)
        full = jax.lax.all_gather(part, AXIS, axis=0, tiled=True)
        return full[:flat.shape[0]].reshape(x.shape)
    wide = x.astype(jnp.float32) if _is_low_precision(key.dtype) else x
    if reduce == PREMUL_SUM:
        wide = wide * jnp.asarray(key.static[0], dtype=wide.dtype)
    total = jax.lax.psum(wide, AXIS)
    if reduce == AVG:
        total = total / n
    return total.astype(x.dtype)


@_lowering("all_reduce")
def _lower_all_reduce(key: ProgramKey):
    return lambda x: _all_reduce(x, key)


@_lowering("reduce_scatter")
def _lower_reduce_scatter(key: ProgramKey):
    """Block ``(n, *chunk)`` -> chunk ``i`` of the reduction on rank ``i``."""
    return lambda x: _reduce_scatter_rows(x, key)


@_lowering("all_gather")
def _lower_all_gather(key: ProgramKey):
    import jax

    return lambda x: jax.lax.all_gather(x, AXIS, axis=0, tiled=False)


@_lowering("all_to_all")
def _lower_all_to_all(key: ProgramKey):
    """Block ``(n, *chunk)``: row ``j`` goes to rank ``j``; result row ``i`` came from rank ``i``."""
    import jax

    return lambda x: jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)


@_lowering("broadcast")
def _lower_broadcast(key: ProgramKey):
    """A binomial tree of ``ppermute`` s from the root: ceil(log2 n) rounds, each moving the raw bits
    once per edge. (A masked psum also works, but XLA:CPU reduces it: 4-10x slower than gloo.)"""
    import jax
    import jax.numpy as jnp

    n, root = len(key.group), key.static[0]
    if n == 2:
        # One transfer; the root's result is never written back, so it needs no select (on XLA:CPU a
        # select over 64 MiB cost 70 ms, 2.5x the transfer itself: measured).
        return lambda x: jax.lax.ppermute(x, AXIS, perm=[(root, 1 - root)])

    def body(x):
        me = (jax.lax.axis_index(AXIS) - root) % n  # position relative to the root
        have = x
        span = 1
        while span < n:  # round: positions [0, span) send to [span, 2 * span)
            perm = [((src + root) % n, (src + span + root) % n) for src in range(min(span, n - span))]
            got = jax.lax.ppermute(have, AXIS, perm=perm)
            have = jnp.where((me >= span) & (me < 2 * span), got, have)
            span *= 2
        return have
    return body


@_lowering("scatter")
def _lower_scatter(key: ProgramKey):
    """Block ``(n, *chunk)`` on the root: one all_to_all, each rank keeps the row from the root."""
    import jax

    root = key.static[0]
    return lambda x: jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)[root]


@_lowering("permute")
def _lower_permute(key: ProgramKey):
    """``static`` is the permutation as (source, destination) group-index pairs."""
    import jax

    return lambda x: jax.lax.ppermute(x, AXIS, perm=list(key.static))


@_lowering("barrier")
def _lower_barrier(key: ProgramKey):
    import jax

    return lambda x: jax.lax.psum(x, AXIS)
