"""One program cache for tpudist, shareable by every process and host that compiles the same programs.

The device's fused programs, the compile backend's graphs and the kernels are traced JAX programs.
Tracing (interpreting hundreds of ATen ops through ``tpudist.ops``) is what a warm start spends
most of its time on, and its result, a ``jax.export`` module (StableHLO), does not depend on the
process, the device or the host that traced it. So it is kept here, keyed by what decides the
program (graph, shapes, dtypes, options, library versions and tpudist's lowering sources), and
any process of any host that would trace the same program reads it instead: the second host of a
pod traces nothing the first traced.

XLA executables are kept here too (:func:`load_or_compile`): the device's Fused programs and host
readers, compiled graphs, eager collectives and ``tpudist.sharding``'s programs. A single-device
executable names no device in its key and is loaded onto the caller's device, so every rank of
every host shares one entry; one over several devices is keyed by their ids and serves every rank
of its world (and of the next world with the same layout). Loading one takes 2-3 ms, where tracing
and compiling a collective takes 0.1-0.2 s on CPU and a Fused step seconds. The Strict and Debug
kernels are left to JAX's persistent compilation cache (``tpudist.runtime.jax_cache``), in the same root:
on XLA:CPU its key holds the device assignment and only JAX process 0 writes it, so there rank
r > 0 of a multi-process world compiles them again (docs/cache.md).

Where: ``$TPUDIST_CACHE_DIR`` (default ``~/.cache/tpudist``), a path or, with ``fsspec``
installed, any fsspec URL (``file://``, ``memory://``, ``s3://``, ...); entries live under
``<root>/programs``. ``TPUDIST_CACHE_DIR=0`` turns every cache off. ``TPUDIST_CACHE_MAX_BYTES``
bounds the entries' total size (default 8 GiB; ``K``/``M``/``G`` suffixes); past it the least
recently used entries are removed.

Entries are written to a temporary name in the same folder and renamed into place, so concurrent
writers race harmlessly and a reader never opens half a file; on a local or mounted folder one
process at a time evicts (a ``flock`` on the folder), so the size bound holds after the last put of
processes sharing it. Each carries a header (format,
library versions, payload size and SHA-256): a corrupt entry, or one written by other versions,
is skipped with a :class:`CacheEntryWarning` and recomputed (then overwritten).

Example::

    from tpudist.runtime import program_cache

    loaded = program_cache.load_or_export(
        "fused", (graph_key, shapes), lambda: jax.export.export(jitted)(*args))
    run = jax.jit(loaded.exported.call) if loaded.exported is not None else jitted
    program_cache.stats("fused")  # CacheStats(hits=..., misses=..., writes=..., evictions=..., ...)
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from tpudist.runtime._cache_settings import cache_root, max_bytes_from_env, parse_bytes  # noqa: F401 - parse_bytes: also offered here
from tpudist.runtime._cache_storage import TMP_PREFIX, storage_for
from tpudist._version import __version__

log = logging.getLogger(__name__)

_MAGIC = b"TPUDIST-PROGRAM\x01"  # the format; a new layout bumps the last byte
_SUFFIX = ".tpc"
_STALE_TMP_SECONDS = 3600  # a temporary file this old was left by a writer that died
_EVICT_TO = 0.9  # eviction frees down to this share of the bound, so the next puts do not evict again
# A put lists the folder (to evict) only when the last listing is older than this or this process's
# running total since (that listing's total plus its own puts) passes half the bound: a folder of 50,000
# entries took ~115 ms to list, on every put. Past half the bound every put lists, as before, so the bound
# holds after the last put of processes sharing the folder (eviction frees down to _EVICT_TO, not below
# half); under it, other processes' puts count from the next listing, and only more than half the bound
# written by others within these seconds could pass it in between.
_RELIST_SECONDS = 60.0
_UNLISTED_SHARE = 0.5


class CacheEntryWarning(UserWarning):
    """A cache entry was skipped: corrupt, truncated, or written by other library versions."""


@dataclass(slots=True)
class CacheStats:
    """What one process's program cache did (tests and benchmarks read it)."""

    hits: int = 0
    misses: int = 0  # lookups that found no usable entry (the caller then traced the program)
    writes: int = 0
    evictions: int = 0  # entries this process removed to stay under the size bound
    corrupt: int = 0  # entries skipped as unreadable (bad header, size or checksum)
    foreign: int = 0  # entries skipped as written by other jax/jaxlib/torch/tpudist versions
    errors: int = 0  # reads or writes the storage refused (the program was still built)

    def snapshot(self) -> dict:
        return asdict(self)


class Entry(NamedTuple):
    data: Any  # the stored bytes, or what ``get``'s ``parse`` made of them
    meta: dict


@functools.cache
def versions() -> dict:
    """The library versions an entry's program depends on: an entry with other ones is foreign."""
    import jax
    import jaxlib
    import torch

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "torch": torch.__version__,
            "tpudist": __version__}


def key_of(kind: str, parts: Any) -> str:
    """The entry name of a program: ``kind`` (``"fused"``, ``"compile"``, ...) and a SHA-256 of
    ``repr(parts)`` and :func:`versions`. ``parts`` must hold everything that decides the program
    and nothing process-local that does not (a device id only where the program names it)."""
    if not kind.isidentifier():
        raise ValueError(f"kind={kind!r} must be an identifier (it starts the entry's file name)")
    digest = hashlib.sha256(repr((sorted(versions().items()), parts)).encode()).hexdigest()
    return f"{kind}-{digest[:40]}"


# -- the cache -----------------------------------------------------------------------------------------
class ProgramCache:
    """Bytes by key in a folder shared by every process that uses it (see the module docstring).

    Args:
        root: a path or an fsspec URL; entries live directly in it.
        max_bytes: bound on the entries' total size; the least recently used go first.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        self.root = os.fspath(root)
        self.max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
        self._storage = storage_for(self.root)
        self.stats = CacheStats()  # every kind of entry
        self.by_kind: dict[str, CacheStats] = {}  # "fused", "compile", "collective", ...
        self._lock = threading.Lock()
        self._total = None  # the entries' total at the last listing plus this process's puts since
        self._listed_at = 0.0

    def __repr__(self) -> str:
        return f"ProgramCache({self.root!r}, max_bytes={self.max_bytes})"

    def location(self, key: str) -> str:
        return self._storage.join(key + _SUFFIX)

    def get(self, key: str, parse: Callable[[bytes, dict], Any] | None = None) -> Entry | None:
        """The entry stored under ``key``, or None (missing, corrupt or foreign: those warn).
        ``parse(data, meta)`` turns the bytes into the entry's ``data``; an entry it raises on is
        skipped as corrupt."""
        name = key + _SUFFIX
        try:
            raw = self._storage.read(name)
        except OSError as e:
            self._count("errors", key=key)
            log.warning("tpudist.runtime.program_cache: cannot read %s (%s)", self.location(key), e)
            raw = None
        if raw is None:
            self._count("misses", key=key)
            return None
        entry = self._decode(key, raw, parse)
        if entry is None:
            self._count("misses", key=key)
            return None
        self._storage.touch(name)
        self._count("hits", key=key)
        return entry

    def put(self, key: str, data: bytes, meta: dict | None = None) -> bool:
        """Stores ``data`` (and a small JSON-able ``meta``) under ``key``; False where the storage
        refused (the caller has its program anyway: the cache is an optimisation)."""
        blob = _encode(data, meta or {})
        if len(blob) > self.max_bytes:
            log.info("tpudist.runtime.program_cache: %s (%d bytes) exceeds the bound %d; not stored", key,
                     len(blob), self.max_bytes)
            return False
        try:
            self._storage.write_atomic(key + _SUFFIX, blob)
        except OSError as e:
            self._count("errors", key=key)
            log.warning("tpudist.runtime.program_cache: cannot write %s (%s)", self.location(key), e)
            return False
        self._count("writes", key=key)
        with self._lock:
            known = self._total is not None and time.monotonic() - self._listed_at < _RELIST_SECONDS
            if known:
                self._total += len(blob)
                known = self._total <= self.max_bytes * _UNLISTED_SHARE
        if not known:  # other processes' puts since the last listing count from the next one
            self.evict()
        return True

    def evict(self) -> int:
        """Removes the least recently used entries until the total is within the bound (down to
        90% of it once over); returns how many. Temporary files of writers that died go too."""
        with self._storage.exclusive():  # one process lists and removes at a time (Local.exclusive)
            return self._evict_listed()

    def _evict_listed(self) -> int:
        try:
            listing = self._storage.listing()
        except OSError as e:
            self._count("errors")
            log.warning("tpudist.runtime.program_cache: cannot list %s (%s)", self.root, e)
            return 0
        now = time.time()
        entries, total = [], 0
        for name, size, mtime in listing:
            if name.startswith(TMP_PREFIX):
                if now - mtime > _STALE_TMP_SECONDS:
                    self._storage.remove(name)
            elif name.endswith(_SUFFIX):
                entries.append((mtime, name, size))
                total += size
        removed = 0
        if total > self.max_bytes:
            for _, name, size in sorted(entries):
                if total <= self.max_bytes * _EVICT_TO:
                    break
                if self._storage.remove(name):
                    removed += 1
                total -= size
            self._count("evictions", removed)
        with self._lock:
            self._total, self._listed_at = total, time.monotonic()
        return removed

    def total_bytes(self) -> int:
        return sum(size for name, size, _ in self._storage.listing() if name.endswith(_SUFFIX))

    def keys(self) -> list[str]:
        return sorted(name[:-len(_SUFFIX)] for name, _, _ in self._storage.listing() if name.endswith(_SUFFIX))

    def _count(self, field: str, n: int = 1, key: str | None = None) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + n)
            if key is not None:
                kind = self.by_kind.setdefault(key.split("-", 1)[0], CacheStats())
                setattr(kind, field, getattr(kind, field) + n)

    def _decode(self, key: str, raw: bytes, parse: Callable[[bytes, dict], Any] | None) -> Entry | None:
        where = self.location(key)
        header, payload, problem = _split(raw)
        if problem is None and header.get("versions") == versions() and parse is not None:
            try:
                payload = parse(payload, header.get("meta", {}))
            except Exception as e:  # noqa: BLE001 - intact bytes the reader cannot use: rebuild, say so
                problem = f"cannot be read ({type(e).__name__}: {e})"
        if problem is not None:
            self._count("corrupt", key=key)
            warnings.warn(f"tpudist program cache: skipping corrupt entry {where}: {problem}; the program is "
                          "rebuilt and the entry rewritten", CacheEntryWarning, stacklevel=3)
            return None
        ours = versions()
        if header.get("versions") != ours:
            self._count("foreign", key=key)
            theirs = header.get("versions")
            warnings.warn(f"tpudist program cache: skipping entry {where} written by versions={theirs}, "
                          f"this process has {ours}; the program is rebuilt", CacheEntryWarning, stacklevel=3)
            return None
        return Entry(payload, header.get("meta", {}))


def _encode(data: bytes, meta: dict) -> bytes:
    header = json.dumps({"versions": versions(), "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "meta": meta}, sort_keys=True).encode()
    return b"".join((_MAGIC, len(header).to_bytes(4, "big"), header, data))


def _split(raw: bytes) -> tuple[dict, bytes, str | None]:
    """(header, payload, None) or ({}, b"", what is wrong)."""
    if not raw.startswith(_MAGIC):
        return {}, b"", "not a tpudist program entry (or another format version)"
    start = len(_MAGIC) + 4
    size = int.from_bytes(raw[len(_MAGIC):start], "big")
    try:
        header = json.loads(raw[start:start + size])
    except ValueError:
        return {}, b"", "unreadable header"
    payload = raw[start + size:]
    if not isinstance(header, dict):
        return {}, b"", "unreadable header"
    if header.get("size") != len(payload):
        return {}, b"", f"payload of {len(payload)} bytes, header says {header.get('size')}"
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return {}, b"", "checksum mismatch"
    return header, payload, None


# -- the process's cache, and the jax.export layer ----------------------------------------------------
_default: list = []  # [ProgramCache | None] once resolved
_default_lock = threading.Lock()


def default_cache() -> ProgramCache | None:
    """The process's cache at ``<TPUDIST_CACHE_DIR>/programs`` (None when caching is off), built on
    first use from the environment; :func:`reset` makes the next call read it again."""
    if _default:
        return _default[0]
    with _default_lock:
        if not _default:
            root = cache_root()
            _default.append(None if root is None else ProgramCache(_join(root, "programs")))
    return _default[0]


def reset() -> None:
    """Forget the process's cache (tests that change ``TPUDIST_CACHE_DIR``)."""
    with _default_lock:
        _default.clear()


def stats(kind: str | None = None) -> CacheStats:
    """The process's cache counters, of every entry or of one kind's (``"fused"``, ``"compile"``,
    ``"collective"``); all zero when caching is off."""
    cache = default_cache()
    if cache is None:
        return CacheStats()
    return cache.stats if kind is None else cache.by_kind.get(kind, CacheStats())


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if "://" in root else str(Path(root) / name)


@functools.cache
def _can_serialize() -> bool:
    """``jax.export`` serialization needs ``flatbuffers``."""
    import importlib.util

    return importlib.util.find_spec("flatbuffers") is not None


class Loaded(NamedTuple):
    exported: Any  # jax.export.Exported, or None: jit the program as it is (see load_or_export)
    meta: dict
    from_cache: bool


def _unexportable(e: Exception) -> bool:
    """Whether ``jax.export`` refused a program it traced: host callbacks (runtime asserts), or
    custom calls without compatibility guarantees. Errors of the tracing itself are not these."""
    text = str(e)
    return ((isinstance(e, NotImplementedError) and "host_callbacks" in text)
            or (isinstance(e, ValueError) and "custom calls whose targets have no compatibility" in text))


def load_or_export(kind: str, key_parts: Any, export_fn: Callable[[], Any],
                   meta_fn: Callable[[], dict] | None = None, *,
                   cache: ProgramCache | None = None) -> Loaded:
    """The ``jax.export`` module of a program: read from the cache, or ``export_fn()`` (which traces
    it) and stored. ``meta_fn()``, called after ``export_fn``, adds what the caller must know to run
    the module (e.g. how many random keys it draws); it comes back as ``meta``.

    ``key_parts`` must decide the program (see :func:`key_of`). An entry that does not deserialize
    counts as corrupt: it is traced again and overwritten. ``exported`` is None, and ``export_fn``
    not called or its module dropped, where the caller should jit the program itself: caching is
    off, ``flatbuffers`` (which serialization needs) is missing, or ``jax.export`` refuses the
    program (host callbacks, custom calls without compatibility guarantees). Other errors of
    ``export_fn`` propagate.
    """
    from jax import export

    cache = default_cache() if cache is None else cache
    if cache is None or not _can_serialize():
        return Loaded(None, {}, False)
    key = key_of(kind, key_parts)
    entry = cache.get(key, lambda data, meta: export.deserialize(bytearray(data)))
    if entry is not None:
        return Loaded(entry.data, entry.meta, True)
    try:
        exported = export_fn()
    except (NotImplementedError, ValueError) as e:
        if not _unexportable(e):
            raise
        log.info("tpudist.runtime.program_cache: %s program not serializable, not cached (%s)", kind, str(e)[:200])
        return Loaded(None, {}, False)
    meta = meta_fn() if meta_fn else {}
    cache.put(key, bytes(exported.serialize()), meta)
    return Loaded(exported, meta, False)


# -- the XLA executable layer (programs over several processes' devices) ---------------------------------
_jax_cache_hits = [0]


@functools.cache
def _listen_to_jax_cache() -> None:
    import jax

    def listener(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _jax_cache_hits[0] += 1

    jax.monitoring.register_event_listener(listener)


def load_or_compile(kind: str, key_parts: Any, jitted: Any, args: tuple, devices: list, *,
                    compiler_options: dict | None = None, meta_fn: Callable[[], dict] | None = None,
                    cache: ProgramCache | None = None) -> tuple[Any, dict, bool]:
    """An XLA executable of ``jitted`` for ``args`` (concrete or abstract arrays with shardings):
    loaded from the cache onto ``devices`` (the device assignment, in the order of the program's
    mesh), or compiled and stored; returns (the ``jax.stages.Compiled``, its meta, whether it was
    loaded). ``meta_fn()``, called after compiling, adds what a caller must know to run it.
    ``jitted`` may also be a function of no arguments that returns the jitted program: it is then
    called only where the executable is compiled (a loaded one needs no tracing either).

    For programs whose tracing is cheap next to XLA's compile, as the collectives' small
    ``shard_map`` programs are (tracing 20-60 ms, compiling 100-220 ms, loading 2-3 ms: measured on
    2 ranks, jax 0.10.2), for programs over several processes' devices, whose tracing every rank
    needs anyway, and for single-device programs JAX's persistent cache cannot share (on CPU its
    key holds the device and only JAX process 0 writes it). An executable over several devices is
    compiled for their assignment: the key holds the devices' ids, their platform and kind, the
    world's device and process counts and XLA_FLAGS besides ``key_parts``; an entry written by one
    process serves every process of the program (measured: rank 1 runs rank 0's all_reduce
    executable). A single-device executable names no device in its key (platform, kind and
    XLA_FLAGS only): it is loaded onto ``devices[0]``, whichever device it was compiled for, so
    every rank and host shares one entry. Only executables compiled here are stored: XLA:CPU
    serializes one that JAX's own cache loaded without its kernels. Executables with host callbacks
    are compiled and not stored. Program outputs must be tuples and lists of arrays (nested or not).
    """
    import jax
    from jax.experimental import serialize_executable

    cache = default_cache() if cache is None else cache

    def compile_it() -> Any:
        program = jitted if hasattr(jitted, "lower") else jitted()
        if len(devices) != 1:
            return program.lower(*args).compile(compiler_options=compiler_options)
        with jax.default_device(devices[0]):  # a program of no committed argument runs there too
            return program.lower(*args).compile(compiler_options=compiler_options)

    if cache is None:
        compiled = compile_it()
        return compiled, meta_fn() if meta_fn else {}, False
    options = sorted((compiler_options or {}).items())
    if len(devices) == 1:
        placement = ("one device", devices[0].platform, devices[0].device_kind, os.environ.get("XLA_FLAGS", ""),
                     options)
    else:
        placement = (tuple(d.id for d in devices), devices[0].platform, devices[0].device_kind,
                     jax.device_count(), jax.process_count(), os.environ.get("XLA_FLAGS", ""), options)
    key = key_of(kind, (key_parts, placement))
    in_tree = jax.tree.structure((tuple(args), {}))

    def load(data: bytes, meta: dict) -> Any:
        out_tree = jax.tree.structure(_tree_from_json(meta["out"]))
        if len(devices) == 1 and meta.get("device_ids", [devices[0].id]) != [devices[0].id]:
            return _load_on(devices[0], meta["device_ids"][0], data, in_tree, out_tree, compiler_options)
        return serialize_executable.deserialize_and_load(data, in_tree, out_tree, execution_devices=devices)

    entry = cache.get(key, load)
    if entry is not None:
        return entry.data, entry.meta, True
    _listen_to_jax_cache()
    hits = _jax_cache_hits[0]
    compiled = compile_it()
    meta = meta_fn() if meta_fn else {}
    out = _tree_to_json(jax.tree.unflatten(compiled.out_tree, range(compiled.out_tree.num_leaves)))
    if (_jax_cache_hits[0] == hits and compiled.in_tree == in_tree and out is not None
            and jax.tree.structure(_tree_from_json(out)) == compiled.out_tree and not has_host_callbacks(compiled)):
        try:
            payload, _, _ = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError, TypeError) as e:
            log.info("tpudist.runtime.program_cache: %s not serializable (%s)", key, e)
        else:
            cache.put(key, bytes(payload), {**meta, "out": out, "device_ids": [d.id for d in devices]})
    return compiled, meta, False


def has_host_callbacks(compiled: Any) -> bool:
    """Whether the executable calls back into this process's Python (``jax.debug.callback``, the
    device's runtime asserts): those functions cannot be stored with it (JAX's pickle refuses them)."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)  # noqa: SLF001 - what serialize reads
    return bool(getattr(unloaded, "host_callbacks", None))


def _load_on(device: Any, stored_id: int, data: bytes, in_tree: Any, out_tree: Any,
             compiler_options: dict | None) -> Any:
    """A single-device executable compiled for device ``stored_id``, loaded to run on ``device``.

    XLA:CPU's serialized executable keeps its compile-time device assignment (run on another
    device, it refuses the buffers: "replica is assigned to device cpu:0"), and JAX's pickle names
    the device in the input and output shardings; both are replaced by ``device``. Its code does not
    depend on the device (measured, jax 0.10.2: a program compiled on cpu:0 gives cpu:0's results on
    cpu:1 and on another process's device). Mirrors ``serialize_executable.deserialize_and_load``.
    """
    import io

    import jax
    import numpy as np
    from jax._src import compiler
    from jax.experimental import serialize_executable

    backend = device.client
    options = compiler.get_compile_options(1, 1, device_assignment=np.array([[device.id]]),
                                           env_options_overrides=compiler_options)

    class OnDevice(serialize_executable._JaxPjrtUnpickler):  # noqa: SLF001 - jax's own executable pickle
        def persistent_load(self, pid):
            if pid[0] == "device":
                if pid[1] != stored_id:
                    raise ValueError(f"the executable names device {pid[1]}, its entry device {stored_id}")
                return device
            if pid[0] == "exec":
                return backend.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                      compile_options=options)
            return super().persistent_load(pid)

    unloaded, args_info_flat, no_kwargs = OnDevice(io.BytesIO(data), backend, [device]).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                               no_kwargs=no_kwargs)


def _tree_to_json(node: Any) -> Any:
    """A program's output structure (tuples and lists over leaves numbered by ``range``) as JSON:
    ``"x"`` a leaf, ``["t", [...]]`` a tuple, ``["l", [...]]`` a list; None for other containers
    (dicts, named tuples, None), whose executables are not stored."""
    if type(node) is int:
        return "x"
    if type(node) in (tuple, list):
        children = [_tree_to_json(c) for c in node]
        return None if None in children else ["t" if type(node) is tuple else "l", children]
    return None


def _tree_from_json(node: Any) -> Any:
    if node == "x":
        return 0
    tag, children = node
    values = [_tree_from_json(c) for c in children]
    return tuple(values) if tag == "t" else values
