"""End-to-end recipe runs on 2 ranks (under ``torchrun`` or in a RankPool), each with a hard timeout.

The FSDP2 recipe trains until the loss has clearly fallen, is interrupted after step 15, and resumes
from its checkpoint of step 10: steps 11-15 replay bit for bit and the run finishes at step 30.
Each recipe's ``main`` also runs inside an existing process group (a RankPool), as a library call.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from tpudist.testing import RankPool, run_command, torchrun_command

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
TINY = ["--vocab-size", "64", "--dim", "32", "--n-heads", "2", "--n-kv-heads", "1", "--seq-len", "16",
        "--global-batch", "8", "--warmup-steps", "3", "--lr", "2e-2"]


def torchrun(recipe: str, nproc: int, *args: str) -> str:
    """Runs ``recipes/<recipe>`` under torchrun; returns its stdout; kills the whole session on timeout."""
    command = torchrun_command(nproc, f"recipes/{recipe}", *args)
    returncode, out = run_command(command, cwd=REPO, timeout=TIMEOUT_S, env={"TPUDIST_TOPOLOGY": None})
    assert returncode == 0, f"{' '.join(command)} exited with {returncode}:\n{out[-5000:]}"
    return out


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_recipe(recipe: str, argv: list[str]) -> list[tuple[int, float]]:
    """A recipe's ``main(argv)`` inside an already initialised process group (the pool's)."""
    namespace = runpy.run_path(str(REPO / "recipes" / recipe), run_name="recipe")
    return [(m.step, m.loss) for m in namespace["main"](argv)]


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2) as pool:
        yield pool


def test_fsdp_recipe_learns_and_resumes(pool2, tmp_path):
    """First run: the real command line under torchrun, preempted after step 15. Second run: the same
    recipe resumed inside a RankPool, from the checkpoint of step 10."""
    common = [*TINY, "--steps", "30", "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first_log = torchrun("train_fsdp.py", 2, *common, "--stop-after", "15", "--metrics-path", str(tmp_path / "a.jsonl"))
    first = read_metrics(tmp_path / "a.jsonl")
    assert [m["step"] for m in first] == list(range(1, 16))
    assert "fsdp on backend=tpu world_size=2 mesh(dp_replicate,dp_shard,tp)=(1, 2, 1)" in first_log
    assert "advisor[v5e]: head_dim=16 (dim=32 / n_heads=2) is not a multiple of 128" in first_log
    assert first_log.count("tokens/s") == 15  # one progress line per step, from rank 0 only

    second = pool2.run(run_recipe, "train_fsdp.py", [*common, "--resume"])
    assert second[0] == second[1]  # the logged loss is the global mean, the same on every rank
    assert [step for step, _ in second[0]] == list(range(11, 31))  # resumed after step 10
    assert [loss for _, loss in second[0][:5]] == [m["loss"] for m in first[10:]]  # same state, same data

    losses = [m["loss"] for m in first[:10]] + [loss for _, loss in second[0]]
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:3]) / 3, losses


def test_ddp_recipe_learns(pool2):
    losses = [[loss for _, loss in rank] for rank in pool2.run(run_recipe, "train_ddp.py", [*TINY, "--steps", "12"])]
    assert losses[0] == losses[1]
    assert len(losses[0]) == 12 and losses[0][-1] < 0.9 * losses[0][0], losses[0]
