"""PyTorch's own c10d tests (``torch/testing/_internal/distributed/distributed_test.py``, shipped
in the installed torch) driven the way torch's ``test/distributed/test_distributed_spawn.py``
drives them: ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` in the environment, one fresh set of
spawned rank processes per test, ``init_process_group(backend=BACKEND, init_method="file://...")``.

Run as a script (the spawned ranks import this file as ``__mp_main__``):
    BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) python tests/process_group/upstream/c10d_spawn.py \
        --json out.json test_all_reduce_sum test_barrier

``TPUDIST_UPSTREAM_SWAP=tpu`` (with ``BACKEND=gloo``) swaps the backend the way a user would: the
suite is imported, decides what to run and what to expect exactly as for gloo, but every
``init_process_group(backend="gloo")`` creates the "tpu" backend instead (and so do the groups
that inherit it); groups a test explicitly asks gloo for stay gloo. With ``BACKEND=tpu`` alone the
suite skips its gloo-only tests (sparse all_reduce, barrier timeouts, object collectives, ...).

Ranks start from a forkserver that has already imported torch, the suite and tpudist's backend
(``TPUDIST_UPSTREAM_START=spawn`` starts each one with a fresh interpreter, as torch does): those
imports were nearly all of a rank's time, in both ranks of every test (see ``_RankProcess``).

Writes ``{"test_name": "passed" | "failed" | "skipped: reason" | "error", ...}`` to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import unittest

import functools
import gc
import os

import torch  # noqa: F401 - loads the "tpu" backend's torch.backends entry point
import torch.distributed as dist
import torch.multiprocessing
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

SWAP = os.environ.get("TPUDIST_UPSTREAM_SWAP")


def _swapped(init_process_group):
    @functools.wraps(init_process_group)
    def init(*args, **kwargs):
        if kwargs.get("backend") == os.environ["BACKEND"]:
            kwargs["backend"] = SWAP
        elif args and len(args) >= 1 and args[0] == os.environ["BACKEND"]:
            args = (SWAP, *args[1:])
        return init_process_group(*args, **kwargs)

    return init


if SWAP:  # runs in the parent and in every spawned rank (they import this file)
    dist.init_process_group = _swapped(dist.init_process_group)


# What a rank imports before its test runs: torch and the suite (what this file imports), and what
# init_process_group("tpu") and destroy_process_group() import (JAX and tpudist's backend, torch's
# profiler for the *_profiler tests). Importing alone starts no JAX backend and no thread beyond
# the one ``import torch`` starts, so forking afterwards is safe. Not "__main__": Python 3.11's
# forkserver never receives the main path and skips it silently; the rank imports this file itself
# (cheap once the rest is loaded), which also installs the swap.
_PRELOAD = ["torch", "torch.distributed", "torch.profiler",
            "torch.testing._internal.distributed.distributed_test", "jax", "jax.distributed", "jax.extend",
            "tpudist.process_group.group", "tpudist.mesh", "tpudist.runtime.program_cache", "tpudist.runtime.jax_cache"]


class _RankProcess(torch.multiprocessing.get_context("forkserver").Process):
    """A rank forked from a server that imported ``_PRELOAD`` once, instead of a fresh interpreter
    importing it in every rank of every test (10-25 s a rank on a loaded 2-core machine, nearly all
    of a test's time). Otherwise it starts as a spawned rank does: with the parent's environment as
    it is at ``start()`` (setUp points TEMP_DIR and INIT_METHOD at a new directory for every test),
    and the suite's module-level INIT_METHOD read from it.

    The imported modules' objects are frozen out of the garbage collector: destroy_process_group()
    runs gc.collect(), which otherwise walks them all (~375k objects, 0.5-1.8 s a rank); what the
    test itself creates is collected as before.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self):
        os.environ.clear()
        os.environ.update(self._environ)
        distributed_test.INIT_METHOD = os.getenv("INIT_METHOD", "env://")
        gc.freeze()
        super().run()


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("TPUDIST_UPSTREAM_START", "forkserver") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(_RankProcess)


class _Outcomes(unittest.TextTestResult):
    outcomes: dict[str, str] = {}
    seconds: dict[str, float] = {}

    def _name(self, test) -> str:
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        name = self._name(test)
        self.seconds[name] = round(time.monotonic() - self._started, 1)
        print(f"UPSTREAM {name} {self.outcomes.get(name, '?')} {self.seconds[name]}s", file=sys.stderr,
              flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[self._name(test)] = "passed"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[self._name(test)] = "failed"

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[self._name(test)] = "error"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = f"skipped: {reason}"

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcomes[self._name(test)] = "failed"

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcomes[self._name(test)] = "passed"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--list", action="store_true", help="write the names of every test instead")
    parser.add_argument("tests", nargs="*")
    args = parser.parse_args()
    known = sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_"))
    if args.list:
        with open(args.json, "w") as f:
            json.dump(known, f, indent=1)
        return 0
    for name in args.tests:
        if name not in known:
            _Outcomes.outcomes[name] = "missing: no such test in this torch"
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in args.tests if n in known)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Outcomes)
    runner.run(suite)
    with open(args.json, "w") as f:
        json.dump(_Outcomes.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
