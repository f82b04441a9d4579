"""The typed config and the command line generated from it; the data task; the model on one process."""

from __future__ import annotations

import dataclasses
import doctest
import math

import pytest
import torch

from tpudist.training import MarkovTask, ModelArgs, ParallelDims, TrainConfig, Transformer, parse_config
from tpudist.training.config import build_parser


def test_every_field_has_a_flag_and_help():
    parser = build_parser(TrainConfig)
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(flags) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(a.help for a in flags.values())
    text = parser.format_help()
    assert "--no-reshard-after-forward" in text and "cosine decay to 10% of lr" in text


def test_overrides():
    cfg = parse_config(TrainConfig, ["--steps", "7", "--lr", "0.5", "--mesh", "2,1,2", "--no-reshard-after-forward",
                                     "--activation-checkpoint", "--param-dtype", "bfloat16"])
    assert (cfg.steps, cfg.lr, cfg.mesh, cfg.reshard_after_forward, cfg.activation_checkpoint) == (
        7, 0.5, (2, 1, 2), False, True)
    assert parse_config(TrainConfig, []) == TrainConfig()


def test_bad_values_say_the_rule():
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--mesh", "1,x"])
    with pytest.raises(ValueError, match=r"mesh=\(1, 2\) must have 3 sizes"):
        TrainConfig(mesh=(1, 2))
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        TrainConfig(resume=True)
    with pytest.raises(ValueError, match=r"mesh=\(1, 2, 3\) \(dp_replicate,dp_shard,tp\) must multiply to world_size=4"):
        ParallelDims.from_sizes((1, 2, 3), world_size=4)
    assert ParallelDims.from_sizes((), world_size=4) == ParallelDims(1, 4, 1)


def test_markov_batches_are_a_function_of_the_step():
    task = MarkovTask(vocab_size=32, seq_len=8, seed=3)
    full_inputs, full_targets = task.batch(5, 4)
    assert torch.equal(task.batch(5, 4)[0], full_inputs)
    assert not torch.equal(task.batch(6, 4)[0], full_inputs)
    shards = [task.batch(5, 4, shard=r, num_shards=2) for r in range(2)]
    assert torch.equal(torch.cat([shards[0][0], shards[1][0]]), full_inputs[[0, 2, 1, 3]])
    table = task.transition_table()
    assert torch.allclose(table.sum(1), torch.ones(32)) and int((table[0] > 0).sum()) == task.branching
    assert 0 < task.entropy_rate() < math.log(task.branching)


def test_model_shapes_and_causality():
    args = ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8)
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(32, (2, 8))
    logits = model(tokens)
    assert logits.shape == (2, 8, 32)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 32
    assert torch.equal(model(changed)[:, :5], logits[:, :5])  # the future does not leak into the past
    assert not torch.equal(model(changed)[:, 5:], logits[:, 5:])


@pytest.mark.parametrize("module", ["advisor", "config", "data", "model", "parallelize"])
def test_docstring_examples(module):
    import importlib

    results = doctest.testmod(importlib.import_module(f"tpudist.training.{module}"))
    assert results.attempted > 0 and results.failed == 0
