"""Killed FSDP training resumes from its last complete checkpoint and ends where an uninterrupted run does.

The FSDP2 recipe runs under ``torchrun --max-restarts 3`` with faults drawn from a seeded RNG: a rank is
SIGKILLed at the start of a step, in the middle of writing its checkpoint shards, and after DCP
finished a save but before the COMPLETE marker was written. Each restart resumes (``--resume``) from
the newest complete checkpoint: no step is lost, none is counted twice, and the losses and the final
checkpoint are bit-identical to an uninterrupted run's.

Run as a script (what torchrun launches here), this file is the recipe with faults injected.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150
STEPS, EVERY = 8, 2
TINY = ["--vocab-size", "64", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
        "--seq-len", "16", "--global-batch", "8", "--warmup-steps", "2", "--lr", "2e-2", "--log-every", "100",
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
_FAULTS_ENV, _FIRED_ENV = "TPUDIST_TEST_FAULTS", "TPUDIST_TEST_FIRED_DIR"


@dataclass(frozen=True, slots=True)
class Fault:
    """SIGKILL ``rank`` once: at the start of ``step`` ("step"), after writing the first item of its
    checkpoint shards of ``step`` ("write"), or after DCP finished saving ``step`` ("saved")."""

    phase: str
    step: int
    rank: int

    def __str__(self) -> str:
        return f"{self.phase}:{self.step}:{self.rank}"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        phase, step, rank = text.split(":")
        return cls(phase, int(step), int(rank))


def fault_plan(seed: int) -> list[Fault]:
    """Three faults at increasing steps, so each one is reached again after the previous restart."""
    rng = random.Random(seed)
    at_step = rng.randint(2, 3)
    mid_write = rng.choice([4, 6])
    after_save = rng.choice([s for s in range(mid_write + EVERY, STEPS + 1, EVERY)])
    return [Fault("step", at_step, rng.randrange(2)), Fault("write", mid_write, rng.randrange(2)),
            Fault("saved", after_save, rng.randrange(2))]


def resume_points(faults: list[Fault]) -> list[int]:
    """The step each attempt after a fault resumes from: the newest checkpoint completed before it."""
    return [(f.step - 1) // EVERY * EVERY for f in faults]


# -- the recipe with faults (runs in torchrun's workers) --------------------------------------------
def _faulty_recipe(argv: list[str]) -> None:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from tpudist.training import trainer

    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fired_dir = Path(os.environ.get(_FIRED_ENV, "."))
    faults = [Fault.parse(f) for f in os.environ.get(_FAULTS_ENV, "").split(";") if f]
    saving: list[int] = []

    def maybe_die(phase: str, step: int) -> None:
        for i, fault in enumerate(faults):
            marker = fired_dir / f"fired_{i}"
            if (fault.phase, fault.step, fault.rank) == (phase, step, rank) and not marker.exists():
                marker.write_text(f"attempt {attempt}\n")
                os.kill(os.getpid(), signal.SIGKILL)

    train_step, save, write_item = trainer.Trainer.train_step, dcp.save, dcp_fs._write_item  # noqa: SLF001

    def train_step_hook(self, step):
        maybe_die("step", step)
        return train_step(self, step)

    def save_hook(state_dict, *, checkpoint_id, **kwargs):
        saving[:] = [int(Path(checkpoint_id).name.split("_")[1])]
        result = save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        maybe_die("saved", saving[0])
        return result

    def write_item_hook(*args, **kwargs):
        result = write_item(*args, **kwargs)  # one item is in the open shard file: die mid-file
        maybe_die("write", saving[0])
        return result

    trainer.Trainer.train_step, dcp.save, dcp_fs._write_item = train_step_hook, save_hook, write_item_hook
    argv = [a.replace("{attempt}", str(attempt)) for a in argv]  # one metrics file per attempt
    runpy.run_path(str(REPO / "recipes" / "train_fsdp.py"), run_name="recipe")["main"](argv)


if __name__ == "__main__":
    _faulty_recipe(sys.argv[1:])
    sys.exit(0)


# -- the tests ----------------------------------------------------------------------------------------
import pytest  # noqa: E402 - the workers above need none of the test machinery

from tpudist.testing import RankPool, run_command, torchrun_command  # noqa: E402


def torchrun(run_dir: Path, faults: list[Fault], max_restarts: int) -> str:
    """The fault-injected recipe under torchrun (2 ranks); returns its output. Kills the session on timeout."""
    command = torchrun_command(2, __file__, *TINY, "--resume", "--checkpoint-dir", str(run_dir / "ckpt"),
                               "--metrics-path", str(run_dir / "metrics.{attempt}.jsonl"),
                               max_restarts=max_restarts)
    env = {_FAULTS_ENV: ";".join(map(str, faults)), _FIRED_ENV: str(run_dir), "TPUDIST_TOPOLOGY": None}
    returncode, out = run_command(command, cwd=REPO, env=env, timeout=TIMEOUT_S)
    assert returncode == 0, f"{' '.join(command)} exited with {returncode}:\n{out[-6000:]}"
    return out


def attempt_logs(run_dir: Path) -> list[list[dict]]:
    logs = []
    while (path := run_dir / f"metrics.{len(logs)}.jsonl").exists():
        logs.append([json.loads(line) for line in path.read_text().splitlines()])
    return logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run (the same launcher, no faults)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    torchrun(run_dir, [], max_restarts=0)
    return run_dir


def test_fault_plan_is_seeded_and_reachable():
    assert fault_plan(0) == fault_plan(0)
    assert len({tuple(fault_plan(seed)) for seed in range(20)}) > 1
    for seed in range(20):
        faults = fault_plan(seed)
        assert [f.phase for f in faults] == ["step", "write", "saved"]
        assert all(a.step < b.step for a, b in zip(faults, faults[1:])), faults
        assert all(f.step % EVERY == 0 for f in faults[1:]), faults


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_killed_three_times_resumes_bit_identically(reference, tmp_path):
    faults = fault_plan(seed=int(os.environ.get("TPUDIST_RECOVERY_SEED", "1")))
    out = torchrun(tmp_path, faults, max_restarts=len(faults))
    fired = sorted(p.name for p in tmp_path.glob("fired_*"))
    assert fired == [f"fired_{i}" for i in range(len(faults))], f"faults {faults}: only {fired} fired\n{out[-3000:]}"

    (full,) = attempt_logs(reference)
    full_loss = {m["step"]: m["loss"] for m in full}
    assert sorted(full_loss) == list(range(1, STEPS + 1))
    logs = attempt_logs(tmp_path)
    assert len(logs) == len(faults) + 1, f"faults {faults}: {len(logs)} attempts"
    resumes = resume_points(faults)
    history = []
    for attempt, log in enumerate(logs):
        steps = [m["step"] for m in log]
        first = resumes[attempt - 1] + 1 if attempt else 1
        assert steps == list(range(first, first + len(steps))), f"attempt {attempt} of faults {faults}: {steps}"
        # every step taken, replayed or not, has exactly the uninterrupted run's loss
        assert [m["loss"] for m in log] == [full_loss[s] for s in steps], f"attempt {attempt}, faults {faults}"
        kept = steps if attempt == len(faults) else [s for s in steps if s <= resumes[attempt]]
        history += kept
    assert history == list(range(1, STEPS + 1)), f"faults {faults}: steps counted {history}"
    assert [m["step"] for m in logs[-1]] == list(range(resumes[-1] + 1, STEPS + 1))

    # the checkpoint left behind by the final attempt holds the uninterrupted run's parameters and optimizer
    (_, want), (_, got) = _load_plain(reference / "ckpt", STEPS), _load_plain(tmp_path / "ckpt", STEPS)
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].equal(value), name


def _load_plain(directory: Path, step: int | None) -> tuple[int, dict]:
    """A checkpoint (``step``, or the newest complete one if None) loaded into a one-process model and
    optimizer; returns its step and every tensor, by name."""
    import torch

    from tpudist.training import Checkpointer, TrainConfig, Transformer, parse_config

    cfg = parse_config(TrainConfig, TINY)
    model = Transformer(cfg.model_args())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    model(torch.zeros((1, 2), dtype=torch.long)).sum().backward()
    optimizer.step()  # creates the state the checkpoint fills in
    if step is None:
        step = Checkpointer(directory).load_latest(model, optimizer)
    else:
        Checkpointer(directory).load(model, optimizer, step)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optim.{index}.{k}": v for k, v in state.items()})
    return step, tensors


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_half_written_checkpoint_is_skipped(reference, tmp_path):
    """Newer saves without COMPLETE (one DCP could load, one truncated mid-shard) are never picked."""
    from tpudist.training import Checkpointer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt" / "step_000004", ckpt / "step_000004")
    shutil.copytree(reference / "ckpt" / "step_000006", ckpt / "step_000006")
    (ckpt / "step_000006" / "COMPLETE").unlink()  # every shard and .metadata written, marker not
    partial = ckpt / "step_000008"
    partial.mkdir()
    shard = next((reference / "ckpt" / "step_000008").glob("*.distcp"))
    (partial / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert Checkpointer(ckpt).complete_steps() == [4]

    (step, got), (_, want) = _load_plain(ckpt, None), _load_plain(reference / "ckpt", 4)
    assert step == 4
    for name, value in want.items():
        assert got[name].equal(value), name


def _pid() -> int:
    return os.getpid()


def test_sigterm_ends_a_tpu_rank():
    with RankPool(2, backend="tpu", timeout=60) as pool:
        pid = pool.run(_pid)[1]
        os.kill(pid, signal.SIGTERM)
        proc = pool._procs[1]  # noqa: SLF001 - the harness holds the Popen
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 1 (pid {pid}) still runs 5 s after SIGTERM")
        assert proc.returncode == -signal.SIGTERM
