"""``recipes/train_fsdp.py --pp 2``: pipeline stages x FSDP2 (mesh pp=2 x dp_shard=2) on 4 ranks train
like the same recipe in one process without parallelism.

Each schedule (GPipe, 1F1B, interleaved 1F1B with two stages per rank) runs on CPU tensors over the
"tpu" process group, and 1F1B with the model on the "tpu" device; the reference is the recipe's own
one-process run (``--device cpu``, no ``--pp``). Per-step losses (the last stage's, averaged over
dp_shard) and gradient norms (over every stage's shards) must agree.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from tpudist.testing import RankPool

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "train_fsdp.py"
TINY = ["--vocab-size", "64", "--dim", "32", "--n-heads", "2", "--n-kv-heads", "1", "--n-layers", "4",
        "--seq-len", "16", "--global-batch", "8", "--warmup-steps", "3", "--lr", "2e-2", "--steps", "4"]


def run_recipe(argv: list[str]) -> list[tuple[float, float]]:
    """The recipe's ``main(argv)`` in this rank's process group: (loss, grad_norm) per step."""
    if "tpu" in argv:
        import tpudist.device  # noqa: F401  (before the first backward of this process)
    namespace = runpy.run_path(str(RECIPE), run_name="recipe")
    return [(m.loss, m.grad_norm) for m in namespace["main"](argv)]


@pytest.fixture(scope="module")
def reference():
    with RankPool(1, timeout=300) as pool:
        return pool.run(run_recipe, [*TINY, "--device", "cpu"])[0]


@pytest.fixture(scope="module")
def run4(reference):
    """``run(device, argv)`` on 4 ranks of a "tpu" world; one pool per device, one alive at a time."""
    pools: dict[str, RankPool] = {}

    def run(device: str, argv: list[str]) -> list:
        if device not in pools:
            for pool in pools.values():
                pool.close()
            pools.clear()
            pools[device] = RankPool(4, timeout=400)
        return pools[device].run(run_recipe, [*TINY, "--device", device, *argv])

    yield run
    for pool in pools.values():
        pool.close()


def assert_matches(results: list, reference: list, rtol: float) -> None:
    assert reference[-1][0] < reference[0][0], reference  # the reference learns
    for rank, got in enumerate(results):
        assert got == results[0], rank  # logged values are global
    losses, norms = zip(*results[0])
    ref_losses, ref_norms = zip(*reference)
    assert losses == pytest.approx(ref_losses, rel=rtol), (losses, ref_losses)
    assert norms == pytest.approx(ref_norms, rel=rtol), (norms, ref_norms)


@pytest.mark.parametrize("schedule", ("gpipe", "1f1b", "interleaved1f1b"))
def test_pp_fsdp_cpu_tensors_match_one_process(run4, reference, schedule):
    # measured: losses 1.1e-7, gradient norms 2.6e-8 from the one-process run, every schedule
    assert_matches(run4("cpu", ["--pp", "2", "--schedule", schedule]), reference, rtol=1e-6)


def test_pp_fsdp_tpu_device_matches_one_process(run4, reference):
    results = run4("tpu", ["--pp", "2", "--schedule", "1f1b", "--eager-mode", "strict"])
    assert_matches(results, reference, rtol=1e-5)  # measured: losses 1.1e-7, gradient norms 2.5e-8


@pytest.mark.parametrize("schedule", ("1f1b", "interleaved1f1b"))
def test_pp_checkpoint_resume_equals_an_uninterrupted_run(run4, reference, schedule, tmp_path):
    """Stop after step 2 (checkpoint at 2), resume to 4: steps 3-4 equal the uninterrupted run's (the
    reference's, to the tolerance the pipelined run already meets), and the resumed run starts at 3."""
    ckpt = ["--pp", "2", "--schedule", schedule, "--checkpoint-dir", str(tmp_path / schedule),
            "--checkpoint-every", "2"]
    first = run4("cpu", [*ckpt, "--stop-after", "2"])
    resumed = run4("cpu", [*ckpt, "--resume"])
    assert [len(r) for r in first] == [2] * 4 and [len(r) for r in resumed] == [2] * 4
    assert_matches([a + b for a, b in zip(first, resumed)], reference, rtol=1e-6)
    # without the restore, steps 3-4 would start from fresh weights: their loss is the first step's
    assert resumed[0][0][0] < reference[0][0] - 1e-3, (resumed[0], reference)


def test_pp_option_errors_name_the_fix():
    namespace = runpy.run_path(str(RECIPE), run_name="recipe")
    config = namespace["FsdpConfig"]
    with pytest.raises(ValueError, match=r"pp=2 combines with FSDP2 over the remaining ranks only; got "
                                         r"mesh=\(1, 2, 2\) parallelism='fsdp': drop --mesh"):
        config(pp=2, mesh=(1, 2, 2))
    with pytest.raises(ValueError, match=r"schedule='zb' must be one of"):
        config(pp=2, schedule="zb")
