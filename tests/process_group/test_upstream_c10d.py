"""PyTorch's own c10d test suite on "tpu": a curated selection of ``distributed_test.py`` (shipped
in the installed torch), run the way torch's ``test/distributed/test_distributed_spawn.py`` runs
it (``tests/process_group/upstream/c10d_spawn.py``), with the backend swapped for "tpu". Every selected test must
pass. Each was chosen because it passes on gloo at 2 ranks with the pinned torch; the gloo run that
shows it (as long again: every test spawns fresh ranks) is left to ``TPUDIST_UPSTREAM_GLOO=1``,
which runs each chunk on gloo first and requires the same outcome there.

The swap is the one a user makes: the suite is imported and decides what to run and expect as for
gloo, and ``init_process_group(backend="gloo")`` creates "tpu" instead. Tests of the suite that
pass on gloo but not on "tpu" are in ``NOT_ON_TPU`` with the reason (and in docs/testing.md).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tpudist.testing import run_command

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "upstream", "c10d_spawn.py")

# Chosen to cover the c10d entry points a Python backend serves (and the forms issue 12 found
# broken) at two ranks within CI's budget (each test starts fresh ranks, forked from a server that
# imported torch, the suite and JAX once per chunk: ~1-3 s a test after the chunk's first, which
# pays ~20-35 s for the imports; spawned ranks took 12-130 s a test on a loaded 2-core machine);
# every one of them passes on gloo at 2 ranks (the suite's all_to_all tests are MPI-only).
# More that pass on both, left out for time, are listed in docs/testing.md. Three chunks, so
# pytest-xdist can spread them.
SELECTION = {
    "p2p": [
        "test_send_recv", "test_send_recv_autograd_profiler", "test_send_recv_torch_profiler",
        "test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
        "test_send_recv_any_source_torch_profiler", "test_irecv",
        "test_batch_isend_irecv_gloo",
    ],
    "reductions": [
        "test_all_reduce_sum", "test_all_reduce_sum_complex",
        "test_all_reduce_complex_unsupported_ops", "test_sparse_all_reduce_sum",
        "test_all_reduce_coalesced_sum", "test_reduce_sum", "test_broadcast", "test_barrier",
    ],
    "movement": [
        "test_all_gather", "test_all_gather_coalesced_simple",
        "test_all_gather_coalesced_with_empty", "test_scatter",
        "test_scatter_object_list", "test_all_gather_object_default_pg",
        "test_DistributedDataParallelCPU", "test_get_future",
    ],
}

# Tests of the suite that pass on gloo (2 ranks) but not with the backend swapped for "tpu": why.
NOT_ON_TPU = {
    "test_get_backend": "asserts dist.get_backend() == 'gloo': the swapped world is named 'tpu'",
    "test_monitored_barrier_gloo": "torch 2.13's dist.monitored_barrier refuses every backend but "
                                   "gloo ('monitored_barrier is only implemented for GLOO backend') "
                                   "before the backend is called; tpudist.monitored_barrier(group, "
                                   "timeout) is the equivalent",
}


def _run(backend: str, tests: list[str], tmp_path) -> dict[str, str]:
    temp = tmp_path / backend
    temp.mkdir()
    env = {"BACKEND": "gloo", "WORLD_SIZE": "2", "TEMP_DIR": str(temp),
           "INIT_METHOD": f"file://{temp}/shared_init_file", "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": "120",
           "TPUDIST_UPSTREAM_SWAP": "tpu" if backend == "tpu" else None, "XLA_FLAGS": None,
           "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
    out_json = tmp_path / f"{backend}.json"
    code, out = run_command([sys.executable, RUNNER, "--json", str(out_json), *tests],
                            timeout=60 + 45 * len(tests), env=env, cwd=HERE)
    assert code == 0 and out_json.exists(), out[-5000:]
    return json.loads(out_json.read_text())


@pytest.mark.parametrize("chunk", sorted(SELECTION))
def test_torch_c10d_suite_passes_on_tpu_as_on_gloo(chunk, tmp_path):
    tests = SELECTION[chunk]
    outcomes = {}
    if os.environ.get("TPUDIST_UPSTREAM_GLOO") == "1":
        outcomes["gloo"] = _run("gloo", tests, tmp_path)
    outcomes["tpu"] = _run("tpu", tests, tmp_path)
    for backend, outcome in outcomes.items():
        assert sorted(outcome) == sorted(tests), (backend, sorted(outcome))
        assert all(o == "passed" for o in outcome.values()), \
            (backend, {t: o for t, o in outcome.items() if o != "passed"})


def test_selection_and_known_gaps_name_tests_that_exist(tmp_path):
    names = tmp_path / "names.json"
    code, out = run_command([sys.executable, RUNNER, "--list", "--json", str(names)], timeout=120,
                            env={"BACKEND": "gloo", "WORLD_SIZE": "2", "TEMP_DIR": str(tmp_path)})
    assert code == 0, out[-3000:]
    known = set(json.loads(names.read_text()))
    selected = [t for chunk in SELECTION.values() for t in chunk]
    assert len(selected) == len(set(selected))
    assert set(selected) <= known and set(NOT_ON_TPU) <= known
    assert not set(selected) & set(NOT_ON_TPU)
