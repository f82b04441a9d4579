"""``nn.SyncBatchNorm`` on "tpu" tensors over the "tpu" backend equals BatchNorm over the whole batch.

torch implements SyncBatchNorm's batch-norm pieces for CUDA only; the device lowers them (CUDA's
formulas) and writes the running statistics their schema hides. Rank functions: ``rank_fns_syncbn.py``.
"""

from __future__ import annotations

import pytest
import torch

import rank_fns_syncbn as fns

_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def test_ddp_cnn_with_sync_batch_norm_trains_like_one_process(pool2):
    """Uneven per-rank batches, two SyncBatchNorms (one with momentum=None), SGD with momentum, 3 steps."""
    for rank, result in enumerate(pool2.run(fns.ddp_cnn_training)):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} losses: {m}")
        assert result["state"].keys() == result["ref_state"].keys()
        for name, ref in result["ref_state"].items():  # parameters, running stats, num_batches_tracked
            torch.testing.assert_close(result["state"][name], ref, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"rank {rank} {name}: {m}")


# Not (4, 0) in bfloat16: torch's SyncBatchNorm gathers a rank's empty-input statistics in the input's
# dtype and the others' in float32, which the backend refuses as a CollectiveMismatch (on NCCL it is
# silent), a torch 2.13 bug that no backend can mend.
@pytest.mark.parametrize(("splits", "dtype"), [((3, 5), torch.float32), ((3, 5), torch.bfloat16),
                                               ((4, 0), torch.float32)],
                         ids=["uneven-float32", "uneven-bfloat16", "one_rank_empty-float32"])
def test_sync_batch_norm_module(pool2, splits, dtype):
    for rank, result in enumerate(pool2.run(fns.module_forward_backward, splits, dtype)):
        for name in ("out", "grad_x", "grad_w", "grad_b", "running_mean", "running_var"):
            torch.testing.assert_close(result[name], result[f"ref_{name}"], **_TOL[dtype],
                                       msg=lambda m, name=name: f"rank {rank} {name}: {m}")
