"""torchtitan's Llama 3 debug model with its FSDP2 x TP (2 x 2), and with its pipeline parallelism x
FSDP2 or x TP (2 x 2), on a "tpu" world of 4 ranks trains like one process without parallelism.

``recipes/torchtitan/train_llama3.py`` runs as a library call inside a pool of 4 ranks, on CPU tensors
and with the model on the "tpu" device; the reference is the same recipe in one process on the whole
batch (``--dp-shard 1 --tp 1``). gloo cannot be the reference: torchtitan's FSDP2 reduces gradients
with PREMUL_SUM, which gloo refuses. Per-step global losses (torchtitan's ``dist_sum``) and gradient
norms (its ``clip_grad_norm_`` over DTensors, clipping at 1.0 active) must agree.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

import rank_fns_titan as fns  # noqa: E402
from tpudist.testing import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def on_tpu_backend():
    """``run(device, fn, argv)`` in a "tpu" world of 4 ranks; one pool per device (FSDP2 puts a module
    on torch's current accelerator, so CPU runs get a process without the device), one alive at a time."""
    pools: dict[str, RankPool] = {}

    def run(device: str, fn, argv: list[str]) -> list:
        if device not in pools:
            for pool in pools.values():
                pool.close()
            pools.clear()
            pools[device] = RankPool(4, timeout=300)
            pools[device].start()
            if device == "tpu":
                pools[device].run(fns.install_device)
        return pools[device].run(fn, argv)

    yield run
    for pool in pools.values():
        pool.close()


_REFERENCES: dict[int, dict] = {}  # steps -> the one-process run's result (it does not depend on the layout)


def reference(on_tpu_backend, steps: int) -> dict:
    if steps not in _REFERENCES:
        _REFERENCES[steps] = on_tpu_backend("cpu", fns.run_reference, ["--device", "cpu", "--steps", str(steps)])[0]
    return _REFERENCES[steps]


def assert_matches_reference(results: list[dict], ref: dict, device: str, loss_rtol: float) -> None:
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, ref["losses"]  # the reference learns (8.23 -> 7.42 in 2 steps)
    for rank, got in enumerate(results):
        assert got["param_device"] == device, (rank, got["param_device"])
        assert got["losses"] == results[0]["losses"], rank  # the logged loss is global
        assert got["grad_norms"] == results[0]["grad_norms"], rank
        assert got["losses"] == pytest.approx(ref["losses"], rel=loss_rtol), (got["losses"], ref["losses"])
        # the FSDP split sums per-rank gradients in another order: norms 3e-5 apart on CPU tensors (measured)
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4), (got["grad_norms"], ref["grad_norms"])


def test_fsdp_tp_on_cpu_tensors_matches_one_process(on_tpu_backend):
    argv = ["--device", "cpu", "--steps", "3"]
    ref = reference(on_tpu_backend, 3)
    results = on_tpu_backend("cpu", fns.run_recipe, argv)
    assert_matches_reference(results, ref, "cpu", loss_rtol=1e-6)


PIPELINE = ["--pp", "2", "--dp-shard", "2", "--tp", "1", "--steps", "2"]  # torchtitan's 1F1B, 2 microbatches a step


def assert_pipelined(results: list[dict]) -> None:
    """Ranks 0-1 (pp rank 0: the mesh is pp-major) hold stage 0, ranks 2-3 stage 1."""
    assert [got["stages"] for got in results] == [[0], [0], [1], [1]], [got["stages"] for got in results]


def test_pipeline_fsdp_on_cpu_tensors_matches_one_process(on_tpu_backend):
    ref = reference(on_tpu_backend, 2)
    results = on_tpu_backend("cpu", fns.run_recipe, ["--device", "cpu", *PIPELINE])
    assert_pipelined(results)
    assert_matches_reference(results, ref, "cpu", loss_rtol=1e-6)


def test_pipeline_tp_on_cpu_tensors_matches_one_process(on_tpu_backend):
    """pp=2 x tp=2: each stage's tp ranks hold the same loss (one counts it), the batch is not split."""
    ref = reference(on_tpu_backend, 2)
    results = on_tpu_backend("cpu", fns.run_recipe, ["--device", "cpu", "--pp", "2", "--dp-shard", "1", "--tp", "2",
                                                     "--steps", "2"])
    assert_pipelined(results)
    assert_matches_reference(results, ref, "cpu", loss_rtol=1e-6)


def test_fsdp_tp_on_tpu_device_matches_one_process(on_tpu_backend):
    ref = reference(on_tpu_backend, 2)
    results = on_tpu_backend("tpu", fns.run_recipe, ["--device", "tpu", "--steps", "2"])
    assert_matches_reference(results, ref, "tpu", loss_rtol=1e-5)


def test_pipeline_fsdp_on_tpu_device_matches_one_process(on_tpu_backend):
    """The stages' activations and gradients cross as tpu tensors (device point to point)."""
    ref = reference(on_tpu_backend, 2)
    results = on_tpu_backend("tpu", fns.run_recipe, ["--device", "tpu", *PIPELINE])
    assert_pipelined(results)
    assert_matches_reference(results, ref, "tpu", loss_rtol=1e-5)
