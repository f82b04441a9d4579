"""Hugging Face ``Trainer`` under ``torchrun`` with the model on the "tpu" device trains like gloo.

The user's script is unchanged: ``import tpudist.device``, a ``Trainer``, ``torchrun --nproc-per-node 2``.
accelerate knows no distributed mode for a "tpu" device, so such a run used to become one process per
rank, silently (no DDP, no sharded data: each rank trained alone). Here both ranks must run DDP
(Trainer's default ``find_unused_parameters=True`` included, which needs the device's C++ hooks) on a
"tpu" process group, and give the losses and weights of the same script on CPU tensors over gloo
(``use_cpu=True``). Each run gets its own pool: accelerate makes the process group, once a process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="Hugging Face's Trainer needs transformers (optional extra)")
pytest.importorskip("accelerate", reason="Hugging Face's Trainer needs accelerate (optional extra)")

import rank_fns_trainer as fns  # noqa: E402
from tpudist.testing import RankPool  # noqa: E402


def _train(use_cpu: bool) -> list[dict]:
    with RankPool(2, backend=None, timeout=600) as pool:
        return pool.run(fns.train_tiny_llama, use_cpu)


def test_trainer_under_torchrun_on_the_device_is_ddp_and_trains_like_gloo():
    ref = _train(use_cpu=True)
    got = _train(use_cpu=False)
    for rank, out in enumerate(got):
        assert (out["backend"], out["world_size"], out["device"], out["param_device"]) == ("tpu", 2, "tpu:0", "tpu:0")
        assert (out["parallel_mode"], out["wrapped"], out["find_unused_parameters"]) == (
            "ParallelMode.DISTRIBUTED", "DistributedDataParallel", True), rank
    assert (ref[0]["backend"], ref[0]["wrapped"]) == ("gloo", "DistributedDataParallel")
    assert len(got[0]["losses"]) == 2
    assert got[0]["losses"] == got[1]["losses"]  # the logged loss is the mean over both ranks
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-6, abs=1e-6)
    for name, value in ref[0]["params"].items():
        for rank in (0, 1):  # DDP keeps the replicas equal
            diff = (got[rank]["params"][name] - value).abs().max().item()
            assert diff <= 1e-6, (rank, name, diff)
