"""Distributed checkpoints of FSDP2 training on the "tpu" backend: an interrupted and resumed run is
bit-identical to an uninterrupted one, and a checkpoint loads at another world size."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tpudist.training import Checkpointer, TrainConfig, Trainer, Transformer
from tpudist.training.checkpoint import COMPLETE_MARKER
from tpudist.training.equivalence import full_parameters, to_numpy
from tpudist.training.trainer import lr_at

CONFIG = TrainConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=8, global_batch=4,
                     steps=4, warmup_steps=1, lr=1e-2, checkpoint_every=2, log_every=1000)


def train(cfg: TrainConfig):
    """Runs a Trainer in the pool's process group; returns (steps taken, losses, full parameters)."""
    trainer = Trainer(cfg)
    history = trainer.train()
    params = to_numpy(full_parameters(trainer.model))
    trainer.close()
    return [m.step for m in history], [m.loss for m in history], params


@pytest.fixture(scope="module")
def uninterrupted(pool2, tmp_path_factory):
    """(checkpoint directory, (steps, losses, parameters)) of a 4-step run saving at steps 2 and 4."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    return directory, pool2.run(train, dataclasses.replace(CONFIG, checkpoint_dir=str(directory)))[0]


def test_resume_is_bit_identical(pool2, uninterrupted, tmp_path):
    cfg = dataclasses.replace(CONFIG, checkpoint_dir=str(tmp_path))
    first = pool2.run(train, dataclasses.replace(cfg, stop_after=3))[0]
    assert first[0] == [1, 2, 3]
    assert Checkpointer(tmp_path).complete_steps() == [2]
    (tmp_path / "step_000003").mkdir()  # a save that died before COMPLETE was written: must be skipped

    steps, losses, params = pool2.run(train, dataclasses.replace(cfg, resume=True))[0]
    full_steps, full_losses, full_params = uninterrupted[1]
    assert steps == [3, 4]  # resumed after the checkpoint of step 2: nothing lost, nothing repeated twice
    assert losses == full_losses[2:]
    assert first[1] == full_losses[:3]
    for name, value in full_params.items():
        assert (params[name] == value).all(), f"{name} differs from the uninterrupted run"
    assert Checkpointer(tmp_path).complete_steps() == [2, 4]


def test_resume_tensor_parallel_and_across_layouts(pool2, uninterrupted, tmp_path):
    """The same on a (dp=1, tp=2) mesh; and the FSDP checkpoint of step 2 resumed on the TP mesh
    (every tensor resharded) lands where the FSDP run did, up to float reassociation."""
    import shutil

    tp = dataclasses.replace(CONFIG, mesh=(1, 1, 2))
    _, tp_losses, tp_params = pool2.run(train, dataclasses.replace(tp, checkpoint_dir=str(tmp_path / "a")))[0]
    pool2.run(train, dataclasses.replace(tp, checkpoint_dir=str(tmp_path / "b"), stop_after=3))
    steps, losses, params = pool2.run(train, dataclasses.replace(tp, checkpoint_dir=str(tmp_path / "b"),
                                                                 resume=True))[0]
    assert steps == [3, 4] and losses == tp_losses[2:]
    for name, value in tp_params.items():
        assert (params[name] == value).all(), f"{name} differs from the uninterrupted tensor-parallel run"

    fsdp_dir, (_, fsdp_losses, fsdp_params) = uninterrupted
    shutil.copytree(fsdp_dir / "step_000002", tmp_path / "c" / "step_000002")
    steps, losses, params = pool2.run(train, dataclasses.replace(tp, checkpoint_dir=str(tmp_path / "c"),
                                                                 resume=True))[0]
    assert steps == [3, 4] and losses == pytest.approx(fsdp_losses[2:], rel=1e-5)
    for name, value in fsdp_params.items():
        torch.testing.assert_close(torch.from_numpy(params[name]), torch.from_numpy(value), rtol=1e-4, atol=1e-5,
                                   msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_load_at_world_size_1(uninterrupted):
    """The 2-rank sharded checkpoint of step 2 loads into a plain one-process model and optimizer;
    2 more steps there land where the 2-rank run did (up to float reassociation)."""
    from tpudist.training.data import MarkovTask

    directory, (_, _, full_params) = uninterrupted
    model = Transformer(CONFIG.model_args())
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG.lr, weight_decay=CONFIG.weight_decay)
    initial = full_parameters(model)
    Checkpointer(directory).load(model, optimizer, step=2)
    loaded = full_parameters(model)
    assert not torch.equal(loaded["output.weight"], initial["output.weight"]), "load did not change weights"

    task = MarkovTask(CONFIG.vocab_size, CONFIG.seq_len, seed=CONFIG.data_seed, branching=CONFIG.branching)
    for step in (3, 4):
        inputs, targets = task.batch(step, CONFIG.global_batch)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, CONFIG)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    got = full_parameters(model)
    for name, value in full_params.items():
        torch.testing.assert_close(got[name], torch.from_numpy(value), rtol=1e-4, atol=1e-5, msg=name)


def test_incomplete_checkpoint_is_not_loaded(tmp_path):
    (tmp_path / "step_000007").mkdir()
    (tmp_path / "step_000005").mkdir()
    (tmp_path / "step_000005" / COMPLETE_MARKER).write_text("5\n")
    (tmp_path / "notes").mkdir()
    assert Checkpointer(tmp_path).complete_steps() == [5]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint for step=7"):
        Checkpointer(tmp_path).load(torch.nn.Linear(1, 1), None, step=7)
