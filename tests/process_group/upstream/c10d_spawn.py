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

Writes ``{"test_name": "passed" | "failed" | "skipped: reason" | "error", ...}`` to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import unittest

import functools
import os

import torch  # noqa: F401 - loads the "tpu" backend's torch.backends entry point
import torch.distributed as dist
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


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


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
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in args.tests if n in known)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Outcomes)
    runner.run(suite)
    with open(args.json, "w") as f:
        json.dump(_Outcomes.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
