"""Point to point and pipeline parallelism on "tpu" device tensors, against gloo on CPU tensors.

Every case runs on the module's pool of two ranks; rank functions are in ``rank_fns_p2p.py`` and
import ``tpudist.device`` themselves (this process never does).
"""

from __future__ import annotations

import pytest
import torch

import rank_fns_p2p as fns
from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=300) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, timeout=400) as pool:
        yield pool


def _same_bits(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (-0.0 and NaN payloads included)."""
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(as_bytes(got), as_bytes(ref))


def test_point_to_point_equals_gloo(pool):
    """send/recv (with src and from any source), isend/irecv, batch_isend_irecv, tags, a subgroup,
    strided sends, recvs into views, every dtype: the same bits as gloo on CPU tensors."""
    tpu, gloo = pool.run(fns.exchange, "tpu"), pool.run(fns.exchange, "cpu")
    for rank, (got, ref) in enumerate(zip(tpu, gloo)):
        assert set(got) == set(ref), rank
        assert len([k for k in ref if k.startswith("dtype_")]) == len(fns.DTYPES)
        for name, value in ref.items():
            if isinstance(value, torch.Tensor):
                assert _same_bits(got[name], value), (rank, name, got[name], value)
            else:
                assert got[name] == value, (rank, name)
    assert gloo[0]["any_source_rank"] == 1
    assert gloo[1]["recv_into_views_base"][1:3, 2:5].tolist() == [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]


def test_mismatched_sends_and_recvs_are_named_errors(pool):
    for rank, errors in enumerate(pool.run(fns.mismatches)):
        for name in ("numel", "dtype", "device", "async_numel"):
            kind, _, message = errors[name].partition(": ")
            assert kind == "CollectiveMismatch", (rank, name, errors[name])
            assert "the sender's and the receiver's tensors differ" in message, message
            assert "0->1" in message and "no data was exchanged" in message, message
        assert "permute of 3 x float32" in errors["numel"] and "permute of 4 x float32" in errors["numel"]
        assert "permute of 3 x int32" in errors["dtype"]
        assert "on tpu tensors" in errors["device"] and "on cpu tensors" in errors["device"]
        assert errors["expanded_recv"].startswith("ValueError: recv: tensor has elements that share memory")
        # the waiting thread's timeout or the comm thread's, whichever fires first under load: same words
        assert errors["no_receiver"].startswith("CollectiveTimeout: send/recv on group"), errors["no_receiver"]
        assert f"send {rank}->{1 - rank} (tag 0)" in errors["no_receiver"], errors["no_receiver"]
        assert "timeout of 3s" in errors["no_receiver"]
        assert errors["after_all_reduce"] == [2.0, 2.0]
        assert errors["after_p2p"] == [6.0 - rank] * 2


def test_point_to_point_makes_no_host_copy(pool):
    """The sender's storage buffer enters the 2-device program and the program's output becomes the
    receiver's storage; no host conversion runs and nothing is fetched to the host (the two sides'
    ops are compared through the store before the transfer). Controls: a CPU send/recv and a
    .cpu() are counted."""
    for rank, out in enumerate(pool.run(fns.no_host_copy)):
        assert [name for name, _ in out["checks"]] == (["send", "recv"] if rank == 0 else ["recv", "send"]) + [
            "batch_isend_irecv", "irecv_into_view"]
        for name, links in out["checks"]:
            assert links and all(links), (rank, name, links)
        assert set(out["host_conversions"].values()) <= {0}, out["host_conversions"]
        assert out["fetched"] == [], out["fetched"]
        assert out["direct"] == (["send", "recv"] if rank == 0 else ["recv", "send"]) + ["batch_isend_irecv"], out
        assert out["controls"].get("raw", 0) + out["controls"].get("write_raw", 0) >= 1
        assert out["controls"].get("to_torch", 0) >= 1
        res = out["results"]
        assert res["recv"].tolist() == (torch.arange(6.0) * (2 - rank)).tolist()
        assert res["batch"].tolist() == (torch.arange(3000.0) + 1 - rank).tolist()
        assert res["view_base"][:, 1].tolist() == (torch.arange(4.0) + 10 * (1 - rank)).tolist()
        assert res["view_base"][:, [0, 2]].abs().sum() == 0


def test_the_no_host_copy_check_sees_a_copy(pool):
    for rank, out in enumerate(pool.run(fns.no_host_copy, True)):
        assert not all(all(links) for _, links in out["checks"]), (rank, out["checks"])


PIPELINES = {  # name: (schedule, eager mode, stages per rank)
    "gpipe_strict": ("ScheduleGPipe", "strict", 1),
    "1f1b_fused": ("Schedule1F1B", "fused", 1),
    "interleaved_1f1b_strict": ("ScheduleInterleaved1F1B", "strict", 2),
    "interleaved_zero_bubble_fused": ("ScheduleInterleavedZeroBubble", "fused", 2),
    "zbv_zero_bubble_strict": ("ScheduleZBVZeroBubble", "strict", 2),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_schedule_on_device_equals_gloo(pool, name):
    """torch.distributed.pipelining with the stages' weights on the tpu device: the losses, the last
    step's gradients and the parameters after the SGD steps equal the same schedule's with gloo on
    CPU tensors."""
    _compare_pipelines(pool, *PIPELINES[name])
    if name == "gpipe_strict":  # the parameters moved: the comparison is not of two untouched models
        assert any((v.abs() > 0).any() for v in pool.run(fns.pipeline, "ScheduleGPipe", "cpu")[0]["grads"].values())


def test_interleaved_pipeline_on_4_ranks_equals_gloo(pool4):
    """Each rank in two pairs (stages r and r + 4 of 8; rank 3 sends stage 3 -> 4 back to rank 0)."""
    _compare_pipelines(pool4, "ScheduleInterleaved1F1B", "strict", 2)


def test_ranks_running_different_collectives_on_device_stay_correct(pool4):
    """MPMD: ranks 0 and 1 evaluate (all_reduce, send/recv, broadcast on their subgroup) between
    steps while ranks 2 and 3 wait in the next world collective; then a complex all_reduce."""
    tpu, gloo = pool4.run(fns.mpmd, "tpu"), pool4.run(fns.mpmd, "cpu")
    for rank, (got, ref) in enumerate(zip(tpu, gloo)):
        assert set(got) == set(ref) and ("eval1" in ref) == (rank < 2), rank
        for name, value in ref.items():
            assert _same_bits(got[name], value), (rank, name, got[name], value)
    assert gloo[0]["grad1"].tolist() == [4.0, 14.0, 24.0, 34.0] and gloo[1]["p2p1"].tolist() == [1.0] * 3


def _compare_pipelines(pool, schedule: str, mode: str, per_rank: int) -> None:
    tpu = pool.run(fns.pipeline, schedule, "tpu", mode, per_rank)
    gloo = pool.run(fns.pipeline, schedule, "cpu", mode, per_rank)
    for rank, (got, ref) in enumerate(zip(tpu, gloo)):
        assert got["devices"] == ["tpu:0"] and ref["devices"] == ["cpu"]
        assert got["stages"] == ref["stages"] and len(got["stages"]) == per_rank
        holds_last = pool.world_size * per_rank - 1 in ref["stages"]
        assert len(ref["losses"]) == (fns.MICROBATCHES * fns.PIPE_STEPS if holds_last else 0)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6), rank
        for what in ("grads", "params"):
            assert set(got[what]) == set(ref[what]) and ref[what]
            for key, value in ref[what].items():
                torch.testing.assert_close(got[what][key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, key=key: f"rank {rank} {what} {key}: {m}")
