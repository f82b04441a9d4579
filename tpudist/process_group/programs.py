"""Collective lowerings: each c10d op is a small jitted ``shard_map`` program over a group's mesh.

Every program takes the global array whose row ``i`` is group rank ``i``'s local tensor (sharded
along the one mesh axis ``AXIS``) and returns a global array whose row ``i`` is rank ``i``'s result.
Programs are cached by :class:`ProgramKey`; :func:`cache_stats` makes the hit rate observable.

Ops that only move data (all_gather, all_to_all, broadcast, scatter, permute) run on raw bytes, so
they are bit-exact for every dtype (``-0.0``, NaN payloads, bool, complex) and share programs across
dtypes of the same size.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

AXIS = "ranks"

# ReduceOp names (lower case) as they appear in keys and errors.
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = (
    "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_REDUCES = (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM)
_DTYPE_NAMES = ("bfloat16", "bool", "complex128", "complex64", "float16", "float32", "float64",
                "int16", "int32", "int64", "int8", "uint8")
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
    """A built program with what each call needs ready: no per-call sharding or aval work."""

    fn: Callable[[Any, Any], Any]  # (data, fingerprints) -> (result, all fingerprints)
    fingerprint_host: np.ndarray  # what the key decides; a call adds its group and sequence number
    fingerprint_aval: Any
    aval: Any
    sharding: Any
    device: Any

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

    def run(self, block: np.ndarray, fingerprint: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Runs on our block; returns (our result, every rank's fingerprint)."""
        fps = xla_batched_put(self.fingerprint_aval, self.sharding, fingerprint, self.device)
        out, fingerprints = self.fn(self.to_global(block), fps)
        return np.asarray(out._arrays[0])[0], np.asarray(fingerprints._arrays[0])[0]  # noqa: SLF001


_cache: dict[tuple[ProgramKey, bool], Compiled] = {}
# Ranks compare fingerprints before moving data (see _build). TPUDIST_VERIFY=0 drops that second
# collective: tiny collectives then take about half the time, and a rank that issues a different
# collective than its peers corrupts data or hangs, as with NCCL. Must be the same on every rank.
_verify = os.environ.get("TPUDIST_VERIFY", "1") != "0"


@contextlib.contextmanager
def verify_collectives(enabled: bool):
    """Scoped switch of the cross-rank fingerprint check (every rank must use the same setting)."""
    global _verify
    saved, _verify = _verify, enabled
    try:
        yield
    finally:
        _verify = saved
_meshes: dict[tuple[int, ...], Any] = {}
_stats = CacheStats()
_lock = threading.Lock()


def cache_stats() -> CacheStats:
    """Counts of program cache hits and misses (misses = programs built) in this process."""
    return _stats


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _meshes.clear()


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
    entry = (key, _verify)
    fn = _cache.get(entry)
    if fn is not None:
        _stats.hits += 1
        return fn
    with _lock:
        fn = _cache.get(entry)
        if fn is None:
            fn = _cache[entry] = _build(key, _verify)
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


def _build(key: ProgramKey, verify: bool) -> Compiled:
    """The program: agree on fingerprints first, and move data only if every rank agrees.

    Ranks that disagree (different op, shape, dtype or reduce op: legal to write, wrong to run)
    would otherwise exchange mismatched buffers: garbage or a hang. The check is one all_gather of
    16 bytes per rank inside the same program; the data collective runs under a ``lax.cond`` that
    every rank evaluates identically.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    body = LOWERINGS[key.op](key)
    n = len(key.group)

    def unchecked(x, fp):
        return body(x[0])[None], jnp.broadcast_to(fp, (1, n, *fp.shape[1:]))

    def checked(x, fp):
        out_shape = jax.eval_shape(body, x[0])  # inside shard_map: the axis name is bound
        fps = jax.lax.all_gather(fp[0], AXIS, axis=0, tiled=False)
        agree = jnp.all(fps == fps[0:1])
        out = jax.lax.cond(agree, lambda v: body(v[0]),
                           lambda v: jnp.zeros(out_shape.shape, out_shape.dtype), x)
        return out[None], fps[None]

    mesh = mesh_of(key.group)
    mapped = jax.shard_map(checked if verify else unchecked, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                           out_specs=(P(AXIS), P(AXIS)), check_vma=False)
    from jax._src import core
    from jax.sharding import NamedSharding

    from tpudist.process_group import runtime

    sharding, device = NamedSharding(mesh, P(AXIS)), runtime.current().local_device
    fp = fingerprint(key)
    return Compiled(jax.jit(mapped), fp, core.ShapedArray((n, fp.shape[0] + 2), fp.dtype),
                    core.ShapedArray((n, *key.shape), np.dtype(key.dtype)), sharding, device)


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


def _gather_fold(x, reduce: str):
    """Reduces by gathering every rank's block and folding in rank order (as gloo does)."""
    import jax
    import jax.numpy as jnp

    rows = jax.lax.all_gather(x, AXIS, axis=0, tiled=False)
    return functools.reduce(getattr(jnp, _FOLDED[reduce]), [rows[i] for i in range(rows.shape[0])])


def _all_reduce(x, key: ProgramKey):
    import jax
    import jax.numpy as jnp

    reduce, n = key.reduce, len(key.group)
    if reduce in _FOLDED:
        return _gather_fold(x, reduce)
    if reduce == MIN:
        return jax.lax.pmin(x, AXIS)
    if reduce == MAX:
        return jax.lax.pmax(x, AXIS)
    # XLA:CPU reduces 16-bit floats ~10x slower than float32 (FACTS.md); float32 is also more exact.
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
    import jax
    import jax.numpy as jnp

    def body(x):
        if key.reduce in (SUM, AVG, PREMUL_SUM):
            wide = x.astype(jnp.float32) if _is_low_precision(key.dtype) else x
            if key.reduce == PREMUL_SUM:
                wide = wide * jnp.asarray(key.static[0], dtype=wide.dtype)
            out = jax.lax.psum_scatter(wide, AXIS, scatter_dimension=0, tiled=False)
            if key.reduce == AVG:
                out = out / len(key.group)
            return out.astype(x.dtype)
        full = _all_reduce(x, key)
        return jax.lax.dynamic_index_in_dim(full, jax.lax.axis_index(AXIS), axis=0, keepdims=False)
    return body


@_lowering("all_gather")
def _lower_all_gather(key: ProgramKey):
    import jax

    return lambda x: jax.lax.all_gather(x, AXIS, axis=0, tiled=False)


@_lowering("all_to_all")
def _lower_all_to_all(key: ProgramKey):
    """Block ``(n, *chunk)``: row ``j`` goes to rank ``j``; result row ``i`` came from rank ``i``."""
    import jax

    return lambda x: jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)


def _only_root(x, root: int):
    import jax
    import jax.numpy as jnp

    return jnp.where(jax.lax.axis_index(AXIS) == root, x, jnp.zeros_like(x))


@_lowering("broadcast")
def _lower_broadcast(key: ProgramKey):
    """A binomial tree of ``ppermute`` s from the root: ceil(log2 n) rounds, each moving the raw bits
    once per edge. (A masked psum also works, but XLA:CPU reduces it: 4-10x slower than gloo.)"""
    import jax
    import jax.numpy as jnp

    n, root = len(key.group), key.static[0]

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
    """Block ``(n, *chunk)`` on the root; a psum_scatter of raw bits where only the root adds."""
    import jax

    return lambda x: jax.lax.psum_scatter(_only_root(x, key.static[0]), AXIS, scatter_dimension=0,
                                          tiled=False)


@_lowering("permute")
def _lower_permute(key: ProgramKey):
    """``static`` is the permutation as (source, destination) group-index pairs."""
    import jax

    return lambda x: jax.lax.ppermute(x, AXIS, perm=list(key.static))


@_lowering("barrier")
def _lower_barrier(key: ProgramKey):
    import jax

    return lambda x: jax.lax.psum(x, AXIS)
