"""End-to-end recipe runs on 2 ranks (under ``torchrun`` or in a RankPool), each with a hard timeout.

The FSDP2 recipe trains until the loss has clearly fallen, is interrupted after step 15, and resumes
from its checkpoint of step 10: steps 11-15 replay bit for bit and the run finishes at step 30.
Each recipe's ``main`` also runs inside an existing process group (a RankPool), as a library call.

On ``--device tpu`` (one rank, in its own pool: installing the device is for the whole process) the
recipe's losses equal ``--device cpu`` within 1e-5 in each eager mode, with ``--variable-length``
and with ``--kernels jax``. A process group that cannot take device tensors stops the recipe at
start-up with an error that says what to do.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from tpudist.testing import RankPool, run_command, torchrun_command

REPO = Path(__file__).resolve().parents[2]
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


# -- --device tpu ------------------------------------------------------------------------------------
DEVICE_STEPS = ["--steps", "3"]
VARIABLE = ["--seq-len", "48", "--variable-length", "--bucket-multiple", "16"]  # buckets 16, 32, 48


@pytest.fixture(scope="module")
def tpu1_pool():
    with RankPool(1, timeout=300) as pool:  # a "tpu" world of one rank
        yield pool


@pytest.fixture(scope="module")
def tpu1(tpu1_pool):
    return lambda *args: [loss for _, loss in tpu1_pool.run(run_recipe, "train_fsdp.py", list(args))[0]]


def fused_programs_per_step(steps: int) -> list[int]:
    """Fused programs each of the trainer's first ``steps`` steps built (FSDP2 on one rank, clipping, AdamW)."""
    import torch

    from tpudist.training import TrainConfig, Trainer

    cfg = TrainConfig(device="tpu", eager_mode="fused", steps=steps, vocab_size=64, dim=40, n_heads=2,
                      n_kv_heads=1, seq_len=16, global_batch=8, warmup_steps=2, lr=2e-2, log_every=100)
    trainer = Trainer(cfg)
    built = []
    for step in range(steps):
        before = torch.tpu.cache_stats()["programs"]
        trainer.train_step(step)
        built.append(torch.tpu.cache_stats()["programs"] - before)
    return built


@pytest.fixture(scope="module")
def cpu_losses(tpu1):
    cache = {}

    def losses(*args):
        if args not in cache:
            cache[args] = tpu1(*TINY, *DEVICE_STEPS, *args, "--device", "cpu")
        return cache[args]
    return losses


def assert_close(got, ref, rtol=1e-5):
    assert len(got) == len(ref), (got, ref)
    for step, (g, r) in enumerate(zip(got, ref), 1):
        assert abs(g - r) <= rtol * abs(r), (step, g, r)


@pytest.mark.parametrize("mode", ("debug", "strict", "fused"))
def test_fsdp_recipe_on_tpu_device_matches_cpu(tpu1, cpu_losses, mode):
    got = tpu1(*TINY, *DEVICE_STEPS, "--device", "tpu", "--eager-mode", mode)
    assert_close(got, cpu_losses())


def test_fused_trainer_compiles_its_step_once(tpu1_pool):
    """Step 1 builds the step's programs (and its state's); later steps build none, whether they clip or
    not. The set-up's pending ops run at the end of Trainer.__init__, not in step 1's graph."""
    built = tpu1_pool.run(fused_programs_per_step, 6)[0]
    assert built[0] > 0 and built[1:] == [0] * 5, built


def test_variable_length_on_tpu_device_matches_cpu(tpu1, cpu_losses):
    ref = cpu_losses(*VARIABLE)
    assert_close(tpu1(*TINY, *DEVICE_STEPS, *VARIABLE, "--device", "tpu", "--eager-mode", "strict"), ref)
    assert ref != cpu_losses()  # other data: the lengths varied (the padding itself: test_device.py)


def test_jax_kernels_on_tpu_device_match_torch_ops_on_cpu(tpu1, cpu_losses):
    got = tpu1(*TINY, *DEVICE_STEPS, "--kernels", "jax", "--device", "tpu", "--eager-mode", "strict")
    assert_close(got, cpu_losses())


def test_variable_length_lengths_vary_within_buckets():
    from tpudist.training import MarkovTask, TrainConfig

    cfg = TrainConfig(seq_len=1024, variable_length=True)
    task = MarkovTask(cfg.vocab_size, cfg.seq_len)
    lengths = {task.length_of(step) for step in range(1, 41)}
    buckets = cfg.buckets()
    assert len(lengths) >= 16 and min(lengths) >= 128 and max(lengths) <= 1024
    assert buckets.sizes == (128, 256, 384, 512, 640, 768, 896, 1024)
    assert len({buckets.size_for(n) for n in lengths}) <= 8
    assert cfg.model_args().max_seq_len == 1024


def test_tpu_device_on_a_group_without_device_tensors_says_what_to_do():
    """DDP hands device tensors to the process group even on one rank; a group that cannot take them
    (gloo here: plain python, a world of one) stops the recipe at start-up with the fix."""
    import sys

    command = [sys.executable, "recipes/train_fsdp.py", *TINY, "--steps", "1", "--backend", "gloo",
               "--parallelism", "ddp", "--device", "tpu", "--eager-mode", "strict"]
    returncode, out = run_command(command, cwd=REPO, timeout=TIMEOUT_S, env={"WORLD_SIZE": None, "RANK": None})
    assert returncode != 0
    assert ("ValueError: device='tpu' with world_size=1 and parallelism='ddp' needs a process group that takes "
            "tpu tensors, and backend='gloo' does not yet") in out, out[-3000:]
    assert "pass --device cpu" in out
