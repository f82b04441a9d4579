"""pytest plugin: run a test on every rank of an emulated TPU slice.

Installed with tpudist (a ``pytest11`` entry point), so it loads in every pytest run; this module
imports only pytest and the standard library until a marked test runs.

Example::

    import pytest, torch, torch.distributed as dist

    @pytest.mark.tpudist(world_size=4, topology="v5p:2x2x1", timeout=60)
    def test_all_reduce():                 # runs once on each of 4 fresh rank processes
        t = torch.ones(3) * dist.get_rank()
        dist.all_reduce(t)                  # the "tpu" group is already initialised
        assert t.tolist() == [6.0] * 3

    def test_many_cases(tpudist_pool):      # a pool of ranks shared by a module's tests
        assert tpudist_pool.run(my_module.some_rank_fn) == [...]

Marker arguments: ``world_size`` (default 2), ``topology`` (``TPUDIST_TOPOLOGY`` in the ranks),
``backend`` (process group the ranks initialise first: "tpu" by default, "gloo", or None for
none), ``timeout`` (seconds the test may take on the ranks, default 120: then every rank is killed
and the test fails as timed out), ``env`` (extra environment variables). A marked test must be a
module-level function; its arguments (fixtures, parametrize values) are pickled to the ranks. A
failing rank fails the test with that rank's traceback; each rank process is ended by PID. Rank
processes are forked from a server that imported torch and JAX once per pytest process (see
``tpudist.testing._pool``; ``TPUDIST_POOL_START=fresh`` starts each as a new interpreter).

The ``tpudist_pool`` fixture is a :class:`~tpudist.testing.RankPool` shared by the tests of one
module, configured by a module-level ``tpudist_pool_options`` dict (the ``RankPool`` keyword
arguments, e.g. ``{"world_size": 4, "topology": "v5p:2x2x1"}``) or by indirect parametrization.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

MARKER = "tpudist"
_DEFAULTS = {"world_size": 2, "topology": None, "backend": "tpu", "timeout": 120.0, "env": None}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=2, topology=None, backend='tpu', timeout=120, env=None): run the test "
        "function on every rank of an emulated TPU slice (fresh processes, hard timeout)")


def marker_options(marker: Any) -> dict[str, Any]:
    """The marker's arguments over the defaults, checked: unknown names and bad values raise."""
    if marker.args:
        raise TypeError(f"@pytest.mark.{MARKER} takes keyword arguments only "
                        f"({', '.join(_DEFAULTS)}), got positional {marker.args!r}")
    unknown = sorted(set(marker.kwargs) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"@pytest.mark.{MARKER}: unknown argument(s) {unknown}; it takes "
                        f"{', '.join(_DEFAULTS)}")
    options = {**_DEFAULTS, **marker.kwargs}
    world_size, timeout = options["world_size"], options["timeout"]
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"@pytest.mark.{MARKER}: world_size={world_size!r} must be an int >= 1")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"@pytest.mark.{MARKER}: timeout={timeout!r} must be a positive number of "
                         "seconds")
    return options


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    options = marker_options(marker)
    fn = pyfuncitem.obj
    if inspect.ismethod(fn) or "." in fn.__qualname__ or inspect.iscoroutinefunction(fn):
        raise TypeError(f"@pytest.mark.{MARKER} test {pyfuncitem.nodeid} must be a plain module-level "
                        "function: rank processes import it by module and name")
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}  # noqa: SLF001
    from tpudist.testing._pool import RankError, RankPool, RankTimeout

    world_size, timeout = options["world_size"], float(options["timeout"])
    where = f"{world_size} ranks" + (f" of {options['topology']}" if options["topology"] else "")
    pool = RankPool(world_size, backend=options["backend"], topology=options["topology"],
                    env=options["env"], timeout=timeout)
    try:
        try:
            pool.start()
        except RankTimeout as e:
            pytest.fail(f"tpudist: the {where} for {pyfuncitem.name} did not start: {e}", pytrace=False)
        pool.run(fn, timeout=timeout, **kwargs)
    except RankError as e:
        pytest.fail(_per_rank(f"tpudist: {pyfuncitem.name} failed on rank(s) {sorted(e.failures)} "
                              f"of {where}", e.failures), pytrace=False)
    except RankTimeout as e:
        pytest.fail(_per_rank(f"tpudist: {pyfuncitem.name} timed out on {where}: ranks {e.missing} "
                              f"did not finish within timeout={timeout:g}s and every rank was killed",
                              e.failures), pytrace=False)
    finally:
        pool.close()
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test whose rank pool cannot start in this process (``TPUDIST_POOL_START=inprocess``, as on a TPU VM
    whose chip one process holds) is reported skipped, with the pool's reason, not failed."""
    outcome = yield
    if call.excinfo is not None and call.excinfo.typename == "PoolUnsupported":
        report = outcome.get_result()
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


def _per_rank(headline: str, failures: dict[int, str]) -> str:
    return headline + "".join(f"\n\n----- rank {r} traceback -----\n{tb.rstrip()}"
                              for r, tb in sorted(failures.items()))


@pytest.fixture(scope="module")
def tpudist_pool(request: pytest.FixtureRequest):
    """A RankPool shared by a module's tests (see the module docstring for its options)."""
    from tpudist.testing._pool import RankPool

    options = getattr(request, "param", None) or getattr(request.module, "tpudist_pool_options", None)
    options = dict(options or {"world_size": 2})
    world_size = options.pop("world_size", 2)
    with RankPool(world_size, **options) as pool:
        yield pool
