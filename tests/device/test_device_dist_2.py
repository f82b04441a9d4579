"""Distributed training code as users write it, unmodified, on the "tpu" device equals the same code on
CPU tensors over gloo: FSDP2 with gradient accumulation (``set_requires_gradient_sync``), activation
checkpointing, ``CPUOffloadPolicy`` and a bf16 ``MixedPrecisionPolicy``; DDP with ``no_sync()``,
``gradient_as_bucket_view`` and comm hooks; tensor parallelism on a Hugging Face Llama, with
``loss_parallel``; ``torch.distributed.checkpoint`` save, load and resume of an FSDP2 model and optimizer.

Rank functions are in ``rank_fns_device_2.py`` (they import ``tpudist.device``; this process never does).
Every case runs twice on the module's ``pool2``: on tpu tensors over "tpu" groups, and on CPU tensors
over gloo groups (the reference).
"""

from __future__ import annotations

import pytest
import torch

import rank_fns_device_2 as fns

# float32 (u = 2**-24), XLA's kernels against torch's CPU kernels, which may sum in another order (another
# vector width: AVX2 or AVX-512): a dot product of n terms may differ by n*u of |x|.|y| (the standard
# forward-error bound). The longest reduction here is the vocabulary's 32, chained through about 5 such
# a step (forward, backward, update) over 3 steps: 3 * 5 * 32 * u = 2.9e-5. Measured <= 3e-7 on one CPU;
# a wrong reduction, scale or missing term is off by 1e-3 or more.
RTOL = ATOL = 3 * 5 * 32 * 2.0 ** -24


def _close(got: dict, ref: dict, rank: int, rtol: float, atol: float) -> None:
    assert set(got) == set(ref), (rank, set(got) ^ set(ref))
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"rank {rank}, {name}: {m}")


def _both(pool, fn, *args, timeout=400):
    """(tpu results, gloo results) of ``fn(*args, device)`` on every rank."""
    return pool.run(fn, *args, "tpu", timeout=timeout), pool.run(fn, *args, "cpu", timeout=timeout)


FSDP_SEEN = {  # what the first block's wq computed with (weight, output) and the gradients' device and dtype
    "accum": {("forward", "tpu:0", "torch.float32", "tpu:0", "torch.float32"), ("grad", "tpu:0", "torch.float32")},
    "ac": {("forward", "tpu:0", "torch.float32", "tpu:0", "torch.float32"), ("grad", "tpu:0", "torch.float32")},
    # the sharded parameters and their gradients live on the CPU; the block computes on the device
    "offload": {("forward", "tpu:0", "torch.float32", "tpu:0", "torch.float32"), ("grad", "cpu", "torch.float32")},
}


@pytest.mark.parametrize("case", list(FSDP_SEEN))
def test_fsdp2_options_train_like_gloo(pool2, case):
    """``set_requires_gradient_sync(False)`` on the first of 2 micro-batches, ``checkpoint_wrapper`` on
    each block, ``CPUOffloadPolicy()`` (pins the CPU shards): 3 steps equal gloo's."""
    for rank, (got, ref) in enumerate(zip(*_both(pool2, fns.fsdp, case))):
        assert set(got["seen"]) == FSDP_SEEN[case], got["seen"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL), rank
        assert ref["losses"][-1] < ref["losses"][0]
        _close(got["params"], ref["params"], rank, RTOL, ATOL)


def test_fsdp2_bf16_mixed_precision_like_gloo(pool2):
    """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the blocks compute in bf16
    on the device, gradients are reduced and kept in fp32, and training follows gloo's within bf16
    rounding (XLA and torch round bf16 intermediates differently: measured 4e-4 on the first loss,
    5e-3 on the parameters after 3 steps at lr 0.1)."""
    for rank, (got, ref) in enumerate(zip(*_both(pool2, fns.fsdp, "mp"))):
        assert set(got["seen"]) == {("forward", "tpu:0", "torch.bfloat16", "tpu:0", "torch.bfloat16"),
                                    ("grad", "tpu:0", "torch.float32")}, got["seen"]
        assert got["losses"][0] == pytest.approx(ref["losses"][0], rel=2e-3), rank
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-2), rank
        _close(got["params"], ref["params"], rank, 0.0, 2e-2)


@pytest.mark.parametrize("case", ["no_sync", "bucket_view", "allreduce_hook", "fp16_hook", "powersgd", "autocast"])
def test_ddp_options_train_like_gloo(pool2, case):
    """``no_sync()`` accumulation over small buckets, ``gradient_as_bucket_view=True``, and comm hooks
    (``allreduce_hook``; ``fp16_compress_hook`` casts to fp16 and back on the device as gloo's run does
    on the CPU; ``powerSGD_hook``, whose future callbacks all_reduce and wait: it hung before the comm
    stream ran collectives issued from its own thread at once); and a bf16 ``torch.autocast`` forward:
    every step's synchronised gradients and the final parameters equal gloo's."""
    for rank, (got, ref) in enumerate(zip(*_both(pool2, fns.ddp, case))):
        assert "error" not in got and "error" not in ref, (got.get("error"), ref.get("error"))
        assert got["devices"] == ["tpu:0"], got["devices"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL), rank
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
            _close(g, r, f"{rank} step {step}", RTOL, ATOL)
        _close(got["params"], ref["params"], rank, RTOL, ATOL)


@pytest.mark.parametrize("case", ["unused", "static"])
def test_ddp_unused_parameters_and_static_graph_like_gloo(pool2, case):
    """``find_unused_parameters=True`` and ``static_graph=True`` with a branch that is never taken: every
    step's gradients and the parameters equal gloo's. DDP's C++ reducer stages its
    used-parameter map through pinned host memory for a PrivateUse1 model, which needs the C++ hooks'
    pinned allocator (device/_hooks.py; with the Python hooks, ``TPUDIST_CPP_HOOKS=0``, it raises)."""
    for rank, (got, ref) in enumerate(zip(*_both(pool2, fns.ddp, case))):
        assert "error" not in got and "error" not in ref, (got.get("error"), ref.get("error"))
        assert got["devices"] == ["tpu:0"], got["devices"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL), rank
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
            _close(g, r, f"{rank} step {step}", RTOL, ATOL)
        _close(got["params"], ref["params"], rank, RTOL, ATOL)


@pytest.mark.parametrize("loss_parallel", [False, True], ids=["replicated_logits", "loss_parallel"])
def test_hugging_face_llama_tensor_parallel_like_gloo(pool2, loss_parallel):
    """``parallelize_module`` (Colwise/Rowwise projections, Rowwise embedding, Colwise LM head) on an
    unmodified HF Llama, 3 AdamW steps; with ``loss_parallel`` the logits stay vocabulary-sharded into
    the cross entropy. AdamW amplifies the kernels' rounding where a gradient is near eps (1.3e-4 seen)."""
    pytest.importorskip("transformers", reason="Hugging Face transformers not installed")
    got_all = pool2.run(fns.tp_hf, "tpu", loss_parallel, timeout=400)
    ref_all = pool2.run(fns.tp_hf, "cpu", loss_parallel, timeout=400)
    for rank, (got, ref) in enumerate(zip(got_all, ref_all)):
        assert got["devices"] == ["tpu:0"], got["devices"]
        assert ref["losses"][-1] < ref["losses"][0]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        _close(got["params"], ref["params"], rank, 1e-5, 5e-4)


def test_distributed_checkpoint_resume_equals_uninterrupted(pool2, tmp_path):
    """``dcp.save`` of ``get_state_dict(model, optimizer)`` (FSDP2, Adam) after 2 steps; a fresh model
    that took a step of its own ``dcp.load``s and ``set_state_dict``s it and takes the same last 2 steps
    as the uninterrupted run: bit for bit the same, and the same as gloo's run within rounding."""
    got_all = pool2.run(fns.dcp_resume, "tpu", str(tmp_path / "tpu"), timeout=400)
    ref_all = pool2.run(fns.dcp_resume, "cpu", str(tmp_path / "cpu"), timeout=400)
    for rank, (got, ref) in enumerate(zip(got_all, ref_all)):
        assert got["devices"] == ["tpu:0"], got["devices"]
        assert got["resumed_losses"] == got["losses"][2:], rank
        for name, value in got["straight"].items():
            assert torch.equal(got["resumed"][name], value), (rank, name)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6), rank
        _close(got["straight"], ref["straight"], rank, 1e-5, 2e-5)  # Adam: 5e-6 seen


def test_full_state_dict_broadcast_load_and_async_save(pool2, tmp_path):
    """A full CPU state dict on rank 0 (``full_state_dict=True, cpu_offload=True``), a fresh sharded model
    loaded from rank 0's full state dict (``broadcast_from_rank0=True``) and ``dcp.async_save`` of the
    device's own state dict + ``dcp.load`` all give back the trained parameters, on the device as on gloo.
    async_save stages each tensor by copying its untyped storage to the host (``UntypedStorage.copy_``, which
    reads a tpu storage as bytes: ``set_`` of a uint8 tensor over it); that needs tpu storages to report
    their true size (``nbytes()``, from the device's C++ hooks)."""
    got_all = pool2.run(fns.state_dict_round_trips, "tpu", str(tmp_path / "tpu"), timeout=400)
    ref_all = pool2.run(fns.state_dict_round_trips, "cpu", str(tmp_path / "cpu"), timeout=400)
    for rank, (got, ref) in enumerate(zip(got_all, ref_all)):
        assert "async_error" not in ref, ref["async_error"]
        assert "async_error" not in got, got["async_error"]
        _close(got["trained"], ref["trained"], rank, RTOL, ATOL)
        assert got["full_devices"] == (["cpu"] if rank == 0 else []), got["full_devices"]
        assert set(got["full"]) == (set(got["trained"]) if rank == 0 else set())
        for name, value in got["full"].items():
            assert torch.equal(value, got["trained"][name]), (rank, name)
        assert got["broadcast_devices"] == ["tpu:0"]
        _close(got["broadcast"], got["trained"], rank, 0.0, 0.0)
        _close(got["async"], got["trained"], rank, 0.0, 0.0)
