import os
import sys

# Rank processes and this process share 2 cores: keep intra-op threads at one (FACTS.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests live in one folder per layer (tests/<layer>/). Modules import the shared modules of
# tests/helpers/ (rank functions, case tables, models) by top-level name, and test_device_opinfo
# imports test_ops_opinfo (whose cases it runs on the device); rank processes import the functions they
# run by module name too, with the sys.path RankPool hands them. pytest puts a test's own folder on
# sys.path (import mode prepend); these folders are put there for every pytest process (xdist workers
# included) however few tests it runs. Module names stay unique across tests/.
_IMPORTED_BY_NAME = ("helpers", "ops")
for _folder in _IMPORTED_BY_NAME:
    _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)


import pytest  # noqa: E402

from tpudist.testing import RankPool  # noqa: E402
from shards import shard_bounds  # noqa: E402  (tests/helpers)


def pytest_configure(config):
    """Build the tpu device's C++ libraries now (xdist's controller runs this before it starts workers), so no
    worker or rank process spends a test's timeout compiling them: the PrivateUse1 hooks and the per-op fast
    path. By file: importing tpudist.device would install the device in this process."""
    import importlib.util
    import warnings

    folder = importlib.util.find_spec("tpudist").submodule_search_locations[0]

    def by_file(name):
        spec = importlib.util.spec_from_file_location(f"_tpudist_build_{name}", os.path.join(folder, "device", name))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    if os.environ.get("TPUDIST_CHIP_SUITE") == "1":  # scripts/chip_suite.sh
        import jax

        if jax.devices()[0].platform == "tpu":
            # This process holds the chip, which takes one process at a time: the Python processes tests
            # start run JAX on the CPU, as in CI (JAX read this process's JAX_PLATFORMS at its import).
            os.environ["JAX_PLATFORMS"] = "cpu"
    hooks, fastpath = by_file("_hooks.py"), by_file("_fastpath.py")
    if hooks.enabled():
        try:
            hooks.build()
        except Exception as e:  # noqa: BLE001 - any failure: tests run on the Python hooks, and say so
            warnings.warn(f"the tpu device's C++ hooks did not build ({type(e).__name__}: {e}); tests of DDP "
                          "find_unused_parameters/static_graph and pin_memory=True will fail", stacklevel=1)
    if fastpath.enabled():
        try:
            hooks.build(fastpath._SOURCE, fastpath._NAME, fastpath.root())  # noqa: SLF001
        except Exception as e:  # noqa: BLE001 - the device then warns in every process and uses Python
            warnings.warn(f"the tpu device's C++ fast path did not build ({type(e).__name__}: {e})", stacklevel=1)


@pytest.fixture(scope="module")
def pool2():
    """Two "tpu" ranks shared by the tests of one module."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    """Four "tpu" ranks shared by the tests of one module."""
    with RankPool(4) as pool:
        yield pool


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Runs only the shard ``TPUDIST_TEST_SHARD`` names of the collected tests (scripts/chip_suite.sh's
    ``CHIP_SUITE_SHARD``: the chip runs the suite a slice per command)."""
    shard = os.environ.get("TPUDIST_TEST_SHARD")
    if not shard:
        return
    start, end = shard_bounds(shard, len(items))
    config.hook.pytest_deselected(items=items[:start] + items[end:])
    items[:] = items[start:end]


# -- memory: each pytest process's peak, and its rank processes', printed at the end of a run -------------
_MEMORY_KEY = "tpudist_memory"
_GROWTH: dict = {"peak": 0, "steps": []}  # this process's peak so far, and (bytes it grew, test) per test


def _peak_of_this_process() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pytest_sessionstart(session):
    _GROWTH["peak"] = _peak_of_this_process()  # what imports and collection took is no test's


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    """Where this process's peak grew: the tests that raised it most are named in the report."""
    peak = _peak_of_this_process()
    if peak > _GROWTH["peak"]:
        _GROWTH["steps"].append((peak - _GROWTH["peak"], nodeid))
        _GROWTH["peak"] = peak


# A worker that runs many modules keeps every kernel and program it compiled (and JAX its executables):
# 4.6 GB a worker by the end of a full run. Past this much resident memory at the end of a module, the
# caches go (the next module compiles again, from the persistent compile cache on disk where it can).
_RELEASE_ABOVE_BYTES = 1536 * 2**20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_compiled() -> None:
    import ctypes
    import gc

    if "tpudist.device" in sys.modules:
        import torch

        torch.tpu.clear_kernel_cache()  # the device's kernels and programs, and JAX's
    elif "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's fixtures are gone after its last test's teardown
    if (nextitem is None or nextitem.module is not item.module) and sys.platform.startswith("linux") \
            and _resident_bytes() > _RELEASE_ABOVE_BYTES:
        _release_compiled()


def _memory_of_this_process() -> dict:
    """This pytest process's peak resident bytes, the tests that raised it most, and the rank processes
    its pools closed, largest first (Linux's VmHWM of each, read as its pool closed it).

    Not RUSAGE_CHILDREN: a child forked from this process counts this process's resident pages as its
    own until it execs (Linux keeps the larger), so it reads as large as the parent, whatever it used."""
    from tpudist.testing import rank_peaks

    ranks = sorted(rank_peaks(), reverse=True)
    return {"self": _peak_of_this_process(), "grew": sorted(_GROWTH["steps"], reverse=True)[:3],
            "num_ranks": len(ranks), "ranks": [tuple(r) for r in ranks[:3]]}


def pytest_sessionfinish(session):
    report = _memory_of_this_process()
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints it
        import json

        session.config.workeroutput[_MEMORY_KEY] = json.dumps(report)
    else:
        session.config.stash.setdefault(_MEMORY_STASH, {})["main"] = report


_MEMORY_STASH = pytest.StashKey[dict]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    import json

    data = getattr(node, "workeroutput", {}).get(_MEMORY_KEY)
    if data is not None:
        node.config.stash.setdefault(_MEMORY_STASH, {})[node.gateway.id] = json.loads(data)


def pytest_terminal_summary(terminalreporter, config):
    reports = config.stash.get(_MEMORY_STASH, {})
    if not reports:
        return
    gb = 1024 ** 3
    terminalreporter.section("peak resident memory")
    for name, r in sorted(reports.items()):
        terminalreporter.write_line(f"{name}: pytest process {r['self'] / gb:.2f} GB, {r['num_ranks']} rank processes")
        for grew, during in r.get("grew", []):
            if grew >= 0.01 * gb:
                terminalreporter.write_line(f"    grew {grew / gb:.2f} GB during {during}")
        for peak, pid, world_size, during in r["ranks"]:
            terminalreporter.write_line(f"    rank pid {pid} ({world_size} ranks): {peak / gb:.2f} GB during "
                                        f"{during or 'no test'}")
    # a pool's ranks run one test at a time, each beside its own pytest process
    total = sum(r["self"] + sum(peak * world_size for peak, _, world_size, _ in r["ranks"][:1])
                for r in reports.values())
    terminalreporter.write_line(f"at most {total / gb:.2f} GB at once: each pytest process's peak and its largest "
                                "rank pool's (its largest rank times its ranks), added up; other subprocesses "
                                "(torchrun) not counted")
