"""Hugging Face ``Trainer`` under ``torchrun`` with the model on the "tpu" device trains like gloo, with DDP
or with FSDP.

The user's script is unchanged: ``import tpudist.device``, a ``Trainer``, ``torchrun --nproc-per-node 2``.
accelerate knows no distributed mode for a "tpu" device, so such a run used to become one process per
rank, silently (no DDP, no sharded data: each rank trained alone). Here both ranks must run DDP
(Trainer's default ``find_unused_parameters=True`` included, which needs the device's C++ hooks) on a
"tpu" process group, and give the losses and weights of the same script on CPU tensors over gloo
(``use_cpu=True``). Each run gets its own pool: accelerate makes the process group, once a process.

FSDP (``fsdp="full_shard"``) on the device used to train with DDP without a word (accelerate enables
FSDP only for GPU-like types): it must shard every parameter (``Shard(0)`` DTensors on the "tpu" group)
and, with SGD, train like the DDP reference. FSDP1 must raise, naming ``fsdp_version=2``.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers", reason="Hugging Face's Trainer needs transformers (optional extra)")
pytest.importorskip("accelerate", reason="Hugging Face's Trainer needs accelerate (optional extra)")

import rank_fns_trainer as fns  # noqa: E402
from tpudist.testing import RankPool  # noqa: E402


def _train(use_cpu: bool, fsdp_config: dict | None = None) -> list[dict]:
    with RankPool(2, backend=None, timeout=600) as pool:
        return pool.run(fns.train_tiny_llama, use_cpu, 2, fsdp_config)


@functools.cache
def _gloo_reference() -> dict:
    return _train(use_cpu=True)[0]


def _assert_trains_like(got: list[dict], ref: dict) -> None:
    assert len(got[0]["losses"]) == 2
    assert got[0]["losses"] == got[1]["losses"]  # the logged loss is the mean over both ranks
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6)
    for name, value in ref["params"].items():
        for rank in (0, 1):  # the same full weights on both ranks
            diff = (got[rank]["params"][name] - value).abs().max().item()
            assert diff <= 1e-6, (rank, name, diff)


def test_trainer_under_torchrun_on_the_device_is_ddp_and_trains_like_gloo():
    ref = _gloo_reference()
    got = _train(use_cpu=False)
    for rank, out in enumerate(got):
        assert (out["backend"], out["world_size"], out["device"], out["param_device"]) == ("tpu", 2, "tpu:0", "tpu:0")
        assert (out["parallel_mode"], out["wrapped"], out["find_unused_parameters"]) == (
            "ParallelMode.DISTRIBUTED", "DistributedDataParallel", True), rank
    assert (ref["backend"], ref["wrapped"]) == ("gloo", "DistributedDataParallel")
    _assert_trains_like(got, ref)


def test_trainer_fsdp_on_the_device_shards_the_parameters_and_trains_like_ddp_on_gloo():
    ref = _gloo_reference()
    got = _train(use_cpu=False, fsdp_config={"version": 2})
    for rank, out in enumerate(got):
        assert (out["backend"], out["world_size"], out["param_device"]) == ("tpu", 2, "tpu:0")
        assert out["wrapped"] == "FSDPLlamaForCausalLM", rank  # fully_shard's class swap, not DDP
        assert out["placements"].keys() == {k for k in ref["params"] if k != "lm_head.weight"}  # tied
        for name, placement in out["placements"].items():
            full_rows = ref["params"][name].shape[0]
            assert placement == (("S(0)",), "tpu", "tpu", (full_rows // 2, *ref["params"][name].shape[1:]),
                                 "tpu:0"), (rank, name, placement)
    _assert_trains_like(got, ref)


def test_accelerate_fsdp_from_env_on_the_device_is_fsdp2_and_fsdp1_raises():
    with RankPool(2, backend=None, timeout=600) as pool:
        got = pool.run(fns.accelerate_fsdp_from_env)
    for out in got:
        assert "needs fsdp_version=2" in out["error_v1"] and "got fsdp_version=1" in out["error_v1"]
        assert out["distributed_type"] == "DistributedType.FSDP"
        assert out["placements"] == {"0.weight": (("S(0)",), "tpu", "tpu", (3, 8), "tpu:0"),
                                     "0.bias": (("S(0)",), "tpu", "tpu", (3,), "tpu:0"),
                                     "1.weight": (("S(0)",), "tpu", "tpu", (2, 6), "tpu:0"),
                                     "1.bias": (("S(0)",), "tpu", "tpu", (2,), "tpu:0")}
