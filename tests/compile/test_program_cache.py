"""tpudist.runtime.program_cache: one store for traced programs, shareable by every process and host.

Unit tests of the store (atomic writes under concurrent writers, corrupt and foreign entries,
eviction at the size bound, fsspec URLs), then processes sharing one cache folder: two emulated
hosts (separate processes, separate JAX runtimes) where the second traces and compiles nothing the
first did, the two ranks of one "tpu" world, where rank 1 traces nothing rank 0 traced, and two
worlds of 2 ranks with programs of every kind (Fused steps, compiled graphs, collectives), where
the second traces nothing and compiles only what docs/cache.md says cannot be shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from tpudist.runtime import program_cache
from tpudist.runtime.program_cache import CacheEntryWarning, ProgramCache


def _no_cache_warnings():
    return warnings.catch_warnings(record=True)


# -- the store ----------------------------------------------------------------------------------------
def test_put_get_round_trip_and_counters(tmp_path):
    cache = ProgramCache(tmp_path, max_bytes=1 << 20)
    assert cache.get("compile-a") is None
    assert cache.put("compile-a", b"\x00program bytes\xff", {"num_keys": 2})
    entry = cache.get("compile-a")
    assert entry.data == b"\x00program bytes\xff" and entry.meta == {"num_keys": 2}
    assert cache.stats.snapshot() == {"hits": 1, "misses": 1, "writes": 1, "evictions": 0, "corrupt": 0,
                                      "foreign": 0, "errors": 0}
    assert [p.name for p in tmp_path.iterdir()] == ["compile-a.tpc"]  # no temporary file left behind


def test_key_names_kind_and_changes_with_every_part():
    a = program_cache.key_of("fused", ("graph", (2, 3), "float32"))
    assert a.startswith("fused-") and a == program_cache.key_of("fused", ("graph", (2, 3), "float32"))
    assert a != program_cache.key_of("fused", ("graph", (2, 4), "float32"))
    assert a != program_cache.key_of("compile", ("graph", (2, 3), "float32"))
    with pytest.raises(ValueError, match="kind='a/b' must be an identifier"):
        program_cache.key_of("a/b", ())


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_entry_is_skipped_with_a_warning_and_rewritten(tmp_path, damage):
    cache = ProgramCache(tmp_path, max_bytes=1 << 20)
    cache.put("k", bytes(range(256)) * 40)
    path = tmp_path / "k.tpc"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x01  # one bit of the payload
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]  # what a non-atomic writer's reader could see
    else:
        raw = bytearray(b"not an entry at all")
    path.write_bytes(bytes(raw))
    with pytest.warns(CacheEntryWarning, match="skipping corrupt entry .*k.tpc"):
        assert cache.get("k") is None
    assert cache.stats.corrupt == 1 and cache.stats.misses == 1 and cache.stats.hits == 0
    cache.put("k", b"fresh")
    with _no_cache_warnings() as caught:
        assert cache.get("k").data == b"fresh"
    assert not [w for w in caught if issubclass(w.category, CacheEntryWarning)]


def test_entry_of_other_versions_is_skipped_with_a_warning(tmp_path, monkeypatch):
    cache = ProgramCache(tmp_path, max_bytes=1 << 20)
    ours = program_cache.versions()
    monkeypatch.setattr(program_cache, "versions", lambda: {**ours, "jaxlib": "0.0.1"})
    cache.put("k", b"written by an older jaxlib")
    monkeypatch.undo()
    with pytest.warns(CacheEntryWarning, match=r"written by versions=.*'jaxlib': '0.0.1'"):
        assert cache.get("k") is None
    assert cache.stats.foreign == 1 and cache.stats.corrupt == 0


def test_eviction_keeps_the_bound_and_removes_least_recently_used(tmp_path):
    cache = ProgramCache(tmp_path, max_bytes=10_000)
    for i in range(8):
        cache.put(f"e{i}", bytes(1000))
        os.utime(tmp_path / f"e{i}.tpc", (1000 + i, 1000 + i))  # e0 oldest, e7 newest
    assert cache.stats.evictions == 0
    cache.get("e0")  # read now: the most recently used
    cache.put("e8", bytes(1000))
    cache.put("e9", bytes(1000))  # each entry is 1000 bytes + its header: the 10th crosses the bound
    assert cache.total_bytes() <= 10_000
    kept = cache.keys()
    assert "e0" in kept and "e9" in kept and "e1" not in kept, kept
    assert cache.stats.evictions == 10 - len(kept) > 0
    assert cache.total_bytes() <= 9_000 + 1100  # freed down to 90% of the bound once over


def test_puts_list_the_folder_only_past_half_the_bound(tmp_path, monkeypatch):
    """A put listed the whole folder to evict (~115 ms for 50,000 entries): now the first put lists, later
    ones add their size to that total, and the folder is listed again once the total passes half the bound
    (then every put lists, as before) or the listing is older than ``_RELIST_SECONDS``."""
    cache = ProgramCache(tmp_path, max_bytes=20_000)  # an entry of 1000 bytes is 1218 with its header
    listings = []
    real = cache._storage.listing  # noqa: SLF001
    monkeypatch.setattr(cache._storage, "listing", lambda: listings.append(1) or real())  # noqa: SLF001
    for i in range(8):
        cache.put(f"a{i}", bytes(1000))  # 9744 bytes: under half the bound
    assert len(listings) == 1
    other = ProgramCache(tmp_path, max_bytes=20_000)  # another process: its first put lists
    other.put("b0", bytes(1000))
    assert len(other.keys()) == 9
    cache.put("a8", bytes(1000))  # cache's own total (b0 unseen) passes half the bound: it lists
    assert len(listings) == 2
    cache.put("a9", bytes(1000))  # past half the bound: every put lists
    assert len(listings) == 3 and cache.stats.evictions == 0
    for i in range(10, 18):
        cache.put(f"a{i}", bytes(1000))
    assert len(listings) == 11 and cache.stats.evictions > 0 and cache.total_bytes() <= 20_000
    far = ProgramCache(tmp_path, max_bytes=1 << 30)
    monkeypatch.setattr(far._storage, "listing", lambda: listings.append(1) or real())  # noqa: SLF001
    listings.clear()
    far.put("c0", bytes(10))
    far.put("c1", bytes(10))
    assert len(listings) == 1
    monkeypatch.setattr(program_cache, "_RELIST_SECONDS", 0.0)  # a stale listing: every put lists
    far.put("c2", bytes(10))
    assert len(listings) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="the folder lock is a POSIX flock")
def test_eviction_lists_and_removes_under_the_folder_lock(tmp_path, monkeypatch):
    """Under concurrent writers a listing (names, then a stat each) saw 0 of 10 entries: others removed
    them in between, so the lister called the folder small and put past the bound without listing again.
    Evictions now list and remove holding a flock on the folder: another holder is refused meanwhile."""
    import fcntl

    cache = ProgramCache(tmp_path, max_bytes=5_000)
    for i in range(4):
        cache.put(f"e{i}", bytes(1000))
    seen = []

    def locked_elsewhere():
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # releases a lock it did get
        return False

    storage = cache._storage  # noqa: SLF001
    real_listing, real_remove = storage.listing, storage.remove
    monkeypatch.setattr(storage, "listing", lambda: seen.append(("list", locked_elsewhere())) or real_listing())
    monkeypatch.setattr(storage, "remove", lambda name: seen.append(("remove", locked_elsewhere())) or real_remove(name))
    cache.put("e4", bytes(1000))  # crosses the bound: lists, removes the oldest
    assert seen and seen[0][0] == "list" and ("remove", True) in seen, seen
    assert all(held for _, held in seen), seen
    assert not locked_elsewhere()  # released after the eviction
    assert cache.total_bytes() <= 5_000 and cache.stats.evictions > 0


def test_entry_larger_than_the_bound_is_not_stored(tmp_path):
    cache = ProgramCache(tmp_path, max_bytes=500)
    assert not cache.put("big", bytes(1000))
    assert cache.keys() == [] and cache.stats.writes == 0


def test_max_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TPUDIST_CACHE_MAX_BYTES", "1.5K")
    assert program_cache.max_bytes_from_env() == 1536
    monkeypatch.setenv("TPUDIST_CACHE_MAX_BYTES", "2G")
    assert program_cache.max_bytes_from_env() == 2 * 2**30
    monkeypatch.setenv("TPUDIST_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="TPUDIST_CACHE_MAX_BYTES='lots' is not a size"):
        program_cache.max_bytes_from_env()


def test_fsspec_memory_url():
    pytest.importorskip("fsspec", reason="URL cache roots need fsspec")
    cache = ProgramCache(f"memory://tpudist-test-{os.getpid()}/programs", max_bytes=5_000)
    cache.put("a", b"payload", {"x": 1})
    assert cache.get("a") == (b"payload", {"x": 1})
    fs = cache._storage.fs  # noqa: SLF001
    path = cache.location("a")
    fs.pipe_file(path, fs.cat_file(path)[:-3])  # truncated
    with pytest.warns(CacheEntryWarning, match="corrupt"):
        assert cache.get("a") is None
    for i in range(6):
        cache.put(f"b{i}", bytes(1000))
    assert cache.total_bytes() <= 5_000 and cache.stats.evictions > 0
    assert not [n for n in fs.ls(cache._storage.path, detail=False) if ".tmp-" in n]  # noqa: SLF001


def test_file_url_is_the_local_folder(tmp_path):
    pytest.importorskip("fsspec", reason="URL cache roots need fsspec")
    ProgramCache(f"file://{tmp_path}").put("a", b"x")
    assert ProgramCache(tmp_path).get("a").data == b"x"


# Writers rewrite one key with payloads of different sizes while a reader reads it: every read is
# one whole payload (never half of one, never a corrupt entry).
_WRITER = textwrap.dedent("""
    import sys, time
    from tpudist.runtime import program_cache
    program_cache.versions = lambda: {"test": "1"}  # the store alone: no jax/torch import per process
    root, me, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cache = program_cache.ProgramCache(root, max_bytes=1 << 30)
    for i in range(rounds):
        cache.put("shared", bytes([me]) * (200_000 + 150_000 * me + i))
    print(cache.stats.writes, cache.stats.errors)
""")

_READER = textwrap.dedent("""
    import json, os, sys
    from tpudist.runtime import program_cache
    program_cache.versions = lambda: {"test": "1"}
    root, stop = sys.argv[1], sys.argv[2]
    cache = program_cache.ProgramCache(root, max_bytes=1 << 30)
    seen = []
    while not os.path.exists(stop) or len(seen) < 20:
        entry = cache.get("shared")
        if entry is not None:
            data = entry.data
            me = data[0]
            assert data == bytes([me]) * len(data), "mixed payload"
            seen.append((me, len(data)))
    print(json.dumps({"reads": len(seen), "writers": sorted({m for m, _ in seen}), **cache.stats.snapshot()}))
""")


def test_concurrent_writers_and_a_reader_never_see_half_a_file(tmp_path):
    root, stop = tmp_path / "cache", tmp_path / "stop"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(root), str(stop)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(me), "60"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in (1, 2, 3)]
    try:
        for w in writers:
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, err
            assert out.split() == ["60", "0"], out
        stop.touch()
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
    finally:
        for p in (*writers, reader):
            if p.poll() is None:
                p.kill()
    got = json.loads(out)
    assert got["corrupt"] == 0 and got["foreign"] == 0 and got["errors"] == 0, got
    assert got["reads"] >= 20 and got["hits"] == got["reads"], got
    assert [p.name for p in root.iterdir()] == ["shared.tpc"]  # every temporary file renamed into place


# Writers store distinct keys under a small bound while a reader reads them: eviction by one process
# never makes another's read or write fail or see a corrupt entry, and the bound holds at the end.
_EVICTING_WRITER = textwrap.dedent("""
    import sys
    from tpudist.runtime import program_cache
    program_cache.versions = lambda: {"test": "1"}
    root, me, bound = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cache = program_cache.ProgramCache(root, max_bytes=bound)
    for i in range(40):
        cache.put(f"w{me}-{i}", bytes([me]) * (20_000 + i))
    print(cache.stats.writes, cache.stats.errors, cache.stats.evictions)
""")

_EVICTION_READER = textwrap.dedent("""
    import json, os, sys
    from tpudist.runtime import program_cache
    program_cache.versions = lambda: {"test": "1"}
    root, stop = sys.argv[1], sys.argv[2]
    cache = program_cache.ProgramCache(root, max_bytes=1 << 30)  # reads only: it never evicts
    found = 0
    while not os.path.exists(stop):
        for me in (1, 2, 3):
            for i in range(0, 40, 7):
                entry = cache.get(f"w{me}-{i}")
                if entry is not None:
                    assert entry.data == bytes([me]) * (20_000 + i), "wrong payload"
                    found += 1
    print(json.dumps({"found": found, **cache.stats.snapshot()}))
""")


def test_concurrent_writers_under_the_size_bound(tmp_path):
    root, stop, bound = tmp_path / "cache", tmp_path / "stop", 200_000
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reader = subprocess.Popen([sys.executable, "-c", _EVICTION_READER, str(root), str(stop)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writers = [subprocess.Popen([sys.executable, "-c", _EVICTING_WRITER, str(root), str(me), str(bound)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in (1, 2, 3)]
    try:
        evictions = 0
        for w in writers:
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, err
            writes, errors, evicted = map(int, out.split())
            assert writes == 40 and errors == 0, out
            evictions += evicted
        stop.touch()
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
    finally:
        for p in (*writers, reader):
            if p.poll() is None:
                p.kill()
    got = json.loads(out)
    assert got["corrupt"] == 0 and got["foreign"] == 0 and got["errors"] == 0, got
    cache = ProgramCache(root, max_bytes=bound)
    assert cache.total_bytes() <= bound, (cache.total_bytes(), bound)
    assert 0 < len(cache.keys()) < 120 and evictions >= 120 - len(cache.keys()), (len(cache.keys()), evictions)
    assert not [p.name for p in root.iterdir() if not p.name.endswith(".tpc")]  # no temporary file left


# -- the jax.export layer -------------------------------------------------------------------------------
def test_load_or_export_traces_once_and_skips_an_unreadable_module(tmp_path):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs it")
    import jax
    import jax.numpy as jnp
    import numpy as np

    cache = ProgramCache(tmp_path, max_bytes=1 << 24)
    traces = []

    def export_fn():
        def f(x):
            traces.append(1)
            return jnp.sin(x) * 2
        return jax.export.export(jax.jit(f))(jax.ShapeDtypeStruct((3,), np.float32))

    first = program_cache.load_or_export("test", ("sin2", 3), export_fn, lambda: {"traces": len(traces)}, cache=cache)
    second = program_cache.load_or_export("test", ("sin2", 3), export_fn, cache=cache)
    assert not first.from_cache and second.from_cache and len(traces) == 1
    assert second.meta == {"traces": 1}
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(second.exported.call(x)), np.sin(x) * 2, rtol=1e-6)

    key = program_cache.key_of("test", ("sin2", 3))
    cache.put(key, b"intact bytes, but no jax.export module")
    with pytest.warns(CacheEntryWarning, match="cannot be read"):
        third = program_cache.load_or_export("test", ("sin2", 3), export_fn, cache=cache)
    assert not third.from_cache and len(traces) == 2 and cache.stats.corrupt == 1
    assert program_cache.load_or_export("test", ("sin2", 3), export_fn, cache=cache).from_cache  # rewritten


def test_load_or_compile_keeps_nested_outputs_and_needs_no_tracing_when_loaded(tmp_path):
    """An executable with nested outputs (the device collectives' read program returns
    ``(block, (pieces...))``) comes back from the cache with the same structure and values; a
    program given as a factory is not even built when its executable is loaded."""
    import jax
    import numpy as np

    cache = ProgramCache(tmp_path, max_bytes=1 << 24)
    salt = float(int.from_bytes(os.urandom(2), "big"))  # a program JAX's own cache cannot hold yet
    made = []

    def make():
        made.append(1)
        return jax.jit(lambda a, bs: (a * 2 + salt, (a + bs[0], [a - bs[1]])))

    x, y, z = (np.arange(4, dtype=np.float32) * k for k in (1, 2, 3))
    args, devices = (x, (y, z)), jax.local_devices()[:1]
    first = program_cache.load_or_compile("test", ("nested", salt), make, args, devices,
                                          meta_fn=lambda: {"made": len(made)}, cache=cache)
    second = program_cache.load_or_compile("test", ("nested", salt), make, args, devices, cache=cache)
    assert [loaded for _, _, loaded in (first, second)] == [False, True] and len(made) == 1
    assert second[1]["made"] == 1 and cache.stats.writes == 1 and cache.stats.hits == 1
    want, got = first[0](*args), second[0](*args)
    assert jax.tree.structure(got) == jax.tree.structure(want) == jax.tree.structure((0, (0, [0])))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(got[1][1][0]), x - z)


def test_load_or_compile_skips_an_unloadable_executable(tmp_path):
    """An entry whose bytes are intact but hold no executable is skipped with a warning, compiled
    again and overwritten."""
    import jax
    import numpy as np

    cache = ProgramCache(tmp_path, max_bytes=1 << 24)
    salt = float(int.from_bytes(os.urandom(2), "big"))
    args, devices = (np.arange(4, dtype=np.float32),), jax.local_devices()[:1]
    jitted = jax.jit(lambda a: (a * 3 + salt,))
    first = program_cache.load_or_compile("test", ("times3", salt), jitted, args, devices, cache=cache)
    assert not first[2] and cache.stats.writes == 1
    (key,) = cache.keys()
    meta = cache.get(key).meta
    cache.put(key, b"intact bytes, but no executable", meta)
    with pytest.warns(CacheEntryWarning, match="cannot be read"):
        again = program_cache.load_or_compile("test", ("times3", salt), jitted, args, devices, cache=cache)
    assert not again[2] and cache.stats.corrupt == 1
    np.testing.assert_array_equal(np.asarray(again[0](*args)[0]), args[0] * 3 + salt)
    assert program_cache.load_or_compile("test", ("times3", salt), jitted, args, devices, cache=cache)[2]


def test_load_or_compile_does_not_store_a_program_with_host_callbacks(tmp_path):
    """A program that calls back into Python (the device's runtime asserts do) runs, calls back, and
    is compiled each time rather than stored (the callback cannot be stored with it)."""
    import jax
    import numpy as np

    cache = ProgramCache(tmp_path, max_bytes=1 << 24)
    seen = []

    def f(a):
        jax.debug.callback(lambda v: seen.append(float(v)), a.sum())
        return (a * 2,)

    x = np.arange(3, dtype=np.float32)
    for _ in range(2):
        compiled, _, loaded = program_cache.load_or_compile("test", ("callback",), jax.jit(f), (x,),
                                                            jax.local_devices()[:1], cache=cache)
        assert not loaded
        np.testing.assert_array_equal(np.asarray(compiled(x)[0]), x * 2)
        jax.effects_barrier()
    assert seen == [3.0, 3.0] and cache.keys() == [] and cache.stats.writes == 0


# Two CPU devices in one process: an executable compiled for device 0 is loaded onto device 1 (one
# entry: single-device keys name no device), runs there on device 1's arrays and refuses device 0's.
_OTHER_DEVICE = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, numpy as np
    from tpudist.runtime import program_cache
    cache = program_cache.ProgramCache(sys.argv[1], max_bytes=1 << 24)
    d0, d1 = jax.devices()
    jitted = jax.jit(lambda a, s: (jax.numpy.tanh(a @ a) * s, [a.sum()]))
    out = {}
    with jax.enable_x64(True):
        for d in (d0, d1):
            x = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(4, 4) / (10 * (d.id + 1)), d)
            compiled, _, loaded = program_cache.load_or_compile("test", ("tanh-mm",), jitted, (x, np.float64(2)),
                                                                [d], cache=cache)
            y, (total,) = compiled(x, np.float64(2))
            want = jitted(x, np.float64(2))
            out[d.id] = {"loaded": loaded, "devices": sorted(str(e) for e in y.devices()),
                         "equal": np.array_equal(np.asarray(y), np.asarray(want[0]))
                         and float(total) == float(want[1][0])}
        try:
            compiled(jax.device_put(np.zeros((4, 4), np.float32), d0), np.float64(2))
            out["refused"] = False
        except ValueError:
            out["refused"] = True
    print(json.dumps({"runs": out, "keys": cache.keys(), **cache.stats.snapshot()}))
""")


def test_single_device_executable_is_loaded_onto_another_device(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _OTHER_DEVICE, str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = got["runs"]["0"], got["runs"]["1"]
    assert not first["loaded"] and second["loaded"], got
    assert first["devices"] == ["cpu:0"] and second["devices"] == ["cpu:1"], got
    assert first["equal"] and second["equal"] and got["runs"]["refused"], got
    assert len(got["keys"]) == 1 and got["writes"] == 1 and got["hits"] == 1, got


# -- emulated hosts sharing one cache folder ------------------------------------------------------------
# One "host": a fresh process with its own JAX runtime compiling a model's forward and backward with
# the tpu backend, and a device-independent program through load_or_export (the fused path's use).
_HOST = textwrap.dedent("""
    import json, torch, torch.nn.functional as F
    import jax, jax.numpy as jnp, numpy as np
    from jax import monitoring
    from tpudist.runtime import program_cache
    from tpudist.compile.program import STATS

    events = {"hits": 0, "misses": 0}
    monitoring.register_event_listener(lambda e, **_: events.__setitem__("hits", events["hits"] + 1)
                                       if e == "/jax/compilation_cache/cache_hits" else None)
    monitoring.register_event_listener(lambda e, **_: events.__setitem__("misses", events["misses"] + 1)
                                       if e == "/jax/compilation_cache/cache_misses" else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    step = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="tpu", fullgraph=True, dynamic=False)
    loss = step(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    loss.backward()
    grad = model[0].weight.grad.norm().item()

    from tpudist.runtime.jax_cache import enable_persistent_cache
    enable_persistent_cache()
    spec = jax.ShapeDtypeStruct((4, 4), np.float32)
    loaded = program_cache.load_or_export("test_fused", ("matmul+tanh", (4, 4)),
                                          lambda: jax.export.export(jax.jit(lambda a: jnp.tanh(a @ a)))(spec))
    fused = jax.jit(loaded.exported.call)(np.eye(4, dtype=np.float32)).tolist()
    print(json.dumps({"loss": loss.item(), "grad": grad, "fused": fused, "compile": STATS.snapshot(),
                      "cache": program_cache.stats().snapshot(), "jax_cache": events}))
""")


def test_second_host_compiles_nothing_the_first_compiled(tmp_path):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs it")
    env = {**os.environ, "TPUDIST_CACHE_DIR": str(tmp_path / "shared"), "OMP_NUM_THREADS": "1"}
    hosts = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _HOST], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        hosts.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = hosts
    # The first host traced the forward, the backward and the fused-like program, and compiled them.
    # Misses and writes: 2 modules and 2 executables of the compiled graphs, 1 module of the other.
    assert first["compile"]["programs_compiled"] == 2 and first["cache"]["misses"] == 5, first
    assert first["cache"]["writes"] == 5 and first["compile"]["xla_compiles"] == 2, first
    # The second traced nothing and compiled nothing: the graphs' executables came from the program
    # cache (so their modules were not even read), the other program's from JAX's persistent cache.
    assert second["compile"]["programs_compiled"] == 0 and second["compile"]["disk_hits"] == 2, second
    assert second["cache"]["misses"] == 0 and second["cache"]["hits"] == 3, second
    assert second["compile"]["xla_compiles"] == 0 and second["jax_cache"]["misses"] == 0, second
    assert second["jax_cache"]["hits"] >= 1, second
    assert second["loss"] == first["loss"] and second["grad"] == first["grad"]
    assert second["fused"] == first["fused"]


def test_ranks_of_one_world_share_traced_programs(tmp_path):
    """Rank 1 of a "tpu" world reads what rank 0 traced, and runs it on its own device; it also
    loads the XLA executables of rank 0's Fused program and host reader (compiled for rank 0's
    device) onto its own device, and compiles nothing for them."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs it")
    import rank_fns_program_cache as fns
    from tpudist.testing import RankPool

    with RankPool(2, backend="tpu", timeout=240, env={"TPUDIST_CACHE_DIR": str(tmp_path / "shared")}) as pool:
        results = pool.run(fns.compile_in_turn)
    first, second = results
    assert first["compile"]["programs_compiled"] == 2 and first["cache"]["compile"]["misses"] == 2, first
    assert first["cache"]["test_fused"]["misses"] == 1, first
    assert second["compile"]["programs_compiled"] == 0 and second["compile"]["disk_hits"] == 2, second
    # Rank 1 loaded the graphs' executables, compiled for rank 0's device, so it read no module either.
    assert second["cache"]["compile_xla"] == {**second["cache"]["compile_xla"], "misses": 0, "hits": 2}, second
    assert second["cache"]["compile"] == {**second["cache"]["compile"], "misses": 0, "hits": 0}, second
    assert second["compile"]["xla_compiles"] == 0, second
    assert second["cache"]["test_fused"] == {**second["cache"]["test_fused"], "misses": 0, "hits": 1}, second
    assert first["device"] != second["device"]
    assert second["loss"] == first["loss"] and second["grad"] == first["grad"]
    assert second["fused"] == [2 * v for v in first["fused"]]  # rank 1 runs rank 0's module on its own inputs

    # The device's Fused program and reader: rank 0 compiled and stored them, rank 1 loaded both
    # (JAX's cache, keyed by the device and written by process 0 only, would have it compile them).
    import torch

    for rank, got in enumerate(results):
        a = torch.arange(12.0).reshape(3, 4) * (rank + 1)
        want = (torch.tanh(a @ a.T / 200) + a.sum()).ravel().tolist()
        assert sum(got["on_device"], []) == pytest.approx(want, rel=1e-6), got
    assert first["device_programs"] == second["device_programs"] >= 1, (first, second)
    assert first["cache"]["fused_xla"]["writes"] == first["device_programs"], first
    assert first["cache"]["reader"]["writes"] == first["readers"] >= 1, first
    assert "jit_call" in first["device_compiles"] or "jit_run" in first["device_compiles"], first
    assert second["cache"]["fused_xla"] == {**second["cache"]["fused_xla"], "hits": second["device_programs"],
                                            "misses": 0, "writes": 0}, second
    assert second["cache"]["reader"] == {**second["cache"]["reader"], "hits": second["readers"], "misses": 0}, second
    assert second["device_compiles"] == [], second


def test_the_next_world_compiles_nothing_the_first_compiled(tmp_path):
    """Two worlds of 2 ranks (the next run, or another group of hosts with the same layout) on one
    cache folder, each rank running a Fused step on the tpu device, a compiled step, a compiled
    graph with a functional all_reduce, eager collectives on CPU and tpu tensors, and
    ``tpudist.sharding``'s redistribute and spmd programs over the world's mesh. The second
    world traces nothing and no rank of it compiles any XLA program: the Fused programs and the
    host readers too come from the program cache (JAX's own cache, which on CPU only JAX process 0
    writes, would leave rank 1 compiling them). Every XLA compile of each process is counted, not
    timed."""
    import rank_fns_program_cache as fns
    import torch
    from tpudist.testing import RankPool

    env = {"TPUDIST_CACHE_DIR": str(tmp_path / "shared"), "OMP_NUM_THREADS": "1"}
    worlds = []
    for _ in range(2):
        with RankPool(2, backend="tpu", timeout=300, env=env) as pool:
            worlds.append(pool.run(fns.one_of_each))
    first, second = worlds
    graph = (sum(torch.sin(torch.linspace(-1, 1, 8) * (r + 1)) for r in range(2)) + 1).tolist()
    for rank in range(2):
        got, again = first[rank], second[rank]
        values = got["values"]
        assert values["fused"] == pytest.approx(values["compiled"], rel=1e-5), values
        assert values["graph"] == pytest.approx(graph, abs=1e-6), values
        assert values["big"] == [0.0, 3.0, 6.0] and values["small"] == 2, values
        assert values["on_device"] == [3.0 * i for i in range(6)], values
        assert values["gathered"] == [0.0] * 4 + [1.0] * 4, values
        full = torch.arange(20.0).reshape(5, 4)
        assert values["rows"] == full.tolist() and values["scaled"] == (full.T * 2).tolist(), values
        assert again["values"] == values, (rank, again["values"], values)

        # The first world did the work (a rank may read what its peer, a moment ahead, stored).
        # Fused: the forward's program (run at the backward's first op), the backward seed's (ones_like,
        # split off as a kept constant) and the backward's with the gradient norm
        assert got["fused_programs"] == 3 and got["graphs"]["graphs"] == 3, got
        programs = got["collectives"]["xla_compiles"] + got["collectives"]["xla_loaded"]
        assert programs >= 7, got  # CPU: data + envelope programs; tpu: read, collective, write per call

        # The second traced nothing: every module and executable came from the program cache.
        for kind, stats in again["cache"].items():
            assert stats["misses"] == 0 and stats["writes"] == 0 and stats["corrupt"] == 0, (rank, kind, again)
        assert again["fused_from_disk"] == again["fused_programs"] == 3, again
        assert again["graphs"]["programs_compiled"] == 0 and again["graphs"]["disk_hits"] == 3, again
        assert again["graphs"]["xla_compiles"] == 0, again
        assert again["collectives"] == {"xla_compiles": 0, "xla_loaded": programs}, (again, got)
        # ... and compiled no XLA program at all: no Fused program, no host reader, no compiled
        # graph, no collective, no redistribute or spmd program (whatever asked JAX for a compile
        # is counted).
        assert again["compiles"] == [], (rank, again["compiles"])
    for again in second:  # the Fused programs' executables and the readers came from the program cache
        assert again["cache"]["fused_xla"]["hits"] == again["fused_programs"], again
        assert again["cache"]["reader"]["hits"] >= 1, again
