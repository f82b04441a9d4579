"""The TPU shape advisor: exact messages and suggestions for a table of model shapes."""

from __future__ import annotations

import pytest

from tpudist.training.advisor import MXU_SIZE, Advice, advise, resolve_generation
from tpudist.training.model import ModelArgs


def test_recipe_defaults_on_v5e():
    args = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    assert [str(a) for a in advise(args, "v5e")] == [
        "head_dim=16 (dim=64 / n_heads=4) is not a multiple of 128: attention matmuls fill 16 of the 128 MXU "
        "lanes; suggested: n_heads=1, n_kv_heads=1 (head_dim=128)",
        "dim=64 is not a multiple of 128: matmuls over it are padded to the v5e MXU's 128x128 tiles, "
        "wasting 50%; suggested: dim=128",
        "ffn_hidden=176 is not a multiple of 128: matmuls over it are padded to the v5e MXU's 128x128 tiles, "
        "wasting 31%; suggested: ffn_hidden=256",
    ]


def test_unpadded_vocabulary():
    args = ModelArgs(vocab_size=50257, dim=1024, n_heads=8, n_kv_heads=8, ffn_hidden=4096)
    assert advise(args, "v5p") == [Advice(
        "vocab", "vocab_size=50257 is not padded to a multiple of 128: the embedding and output matmul are "
        "padded anyway; suggested: vocab_size=50304 (the extra rows are never targets)",
        (("vocab_size", 50304),))]


def test_v6e_needs_multiples_of_256():
    args = ModelArgs(vocab_size=32000, dim=640, n_heads=5, n_kv_heads=1, ffn_hidden=1664)
    assert advise(args, "v5e") == []
    assert [a.suggested for a in advise(args, "v6e")] == [(("dim", 768),), (("ffn_hidden", 1792),)]
    assert str(advise(args, "v6e")[0]) == (
        "dim=640 is not a multiple of 256: matmuls over it are padded to the v6e MXU's 256x256 tiles, "
        "wasting 17%; suggested: dim=768")


def test_head_dim_suggestion_keeps_kv_heads_dividing_heads():
    args = ModelArgs(vocab_size=256, dim=512, n_heads=8, n_kv_heads=2, ffn_hidden=1536)
    (advice,) = advise(args, "v4")
    assert advice.rule == "head_dim"
    assert advice.suggested == (("n_heads", 4),)
    fixed = ModelArgs(vocab_size=256, dim=512, n_heads=4, n_kv_heads=2, ffn_hidden=1536)
    assert fixed.head_dim == 128 and advise(fixed, "v4") == []


def test_generation_from_topology_env(monkeypatch):
    monkeypatch.setenv("TPUDIST_TOPOLOGY", "v6e:2x4")
    assert resolve_generation() == "v6e"
    assert resolve_generation("v5p") == "v5p"
    monkeypatch.delenv("TPUDIST_TOPOLOGY")
    assert resolve_generation() == "v5e"


def test_unknown_generation():
    with pytest.raises(ValueError, match=r"tpu generation='v9x' is unknown; known: \['v2', "):
        resolve_generation("v9x")
    assert set(MXU_SIZE.values()) == {128, 256}


def test_tensor_parallel_shards_are_checked_per_chip():
    args = ModelArgs(vocab_size=32768, dim=1024, n_heads=8, n_kv_heads=8, ffn_hidden=2816)  # 2816 = 22 * 128
    assert advise(args, "v5p", tp=2) == []
    assert advise(args, "v5p", tp=4) == [Advice(
        "tp_shard", "ffn_hidden/tp=704 (ffn_hidden=2816 split over tp=4) is not a multiple of 128: each chip's "
        "matmuls are padded to the v5p MXU's 128x128 tiles; suggested: tp=2 or ffn_hidden=3072",
        (("tp", 2), ("ffn_hidden", 3072)))]
    assert [a.rule for a in advise(args, "v5p", tp=16)] == ["tp_shard", "tp_shard"]  # dim/16=64 as well
