"""Rank-side functions of tests/device/test_device_syncbn.py: ``nn.SyncBatchNorm`` on "tpu" tensors.

Each rank trains on its own slice of one global batch (uneven slices); the reference, computed in
every rank process on the CPU, is plain BatchNorm over the whole batch with the loss DDP optimises
(the mean over ranks of each rank's mean loss). The ranks return CPU tensors for the test to compare.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SPLITS = (3, 5)  # samples per rank: uneven on purpose


def _slices(splits):
    starts = [sum(splits[:i]) for i in range(len(splits))]
    return [slice(s, s + n) for s, n in zip(starts, splits)]


def _cnn(sync: bool) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.SyncBatchNorm if sync else nn.BatchNorm2d
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm(4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                         norm(4, momentum=None), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(SPLITS), 3, 8, 8, generator=g) * 2 + 0.5, torch.randint(0, 5, (sum(SPLITS),), generator=g)


def ddp_cnn_training(steps: int = 3) -> dict:
    """A CNN with SyncBatchNorm under DDP on the device: per-step losses, final parameters and buffers,
    next to the single-process reference of the same global batch."""
    import tpudist.device  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()
    x, y = _batch()
    mine = _slices(SPLITS)[r]
    model = DDP(_cnn(sync=True).to("tpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = _cnn(sync=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(x[mine].to("tpu")), y[mine].to("tpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())

        logits = ref(x)
        ref_loss = sum(F.cross_entropy(logits[s], y[s]) for s in _slices(SPLITS)) / len(SPLITS)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    state = {k: v.cpu() for k, v in model.module.state_dict().items()}
    return {"losses": losses, "ref_losses": ref_losses, "state": state, "ref_state": ref.state_dict()}


def module_forward_backward(splits: tuple[int, ...], dtype: torch.dtype) -> dict:
    """One SyncBatchNorm (affine, 3-D input) forward and backward with this rank's slice (possibly
    empty) of a global batch: output, input grad, running statistics; weight/bias grads summed over
    ranks. The reference: BatchNorm1d over the whole batch, in float32 on the CPU."""
    import tpudist.device  # noqa: F401

    r = dist.get_rank()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(splits), 4, 6, generator=g) * 3 - 1
    grad = torch.randn(x.shape, generator=g)
    mine = _slices(splits)[r]
    torch.manual_seed(3)
    bn = nn.SyncBatchNorm(4).to(dtype)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    ref = nn.BatchNorm1d(4)
    ref.load_state_dict({k: v.float() for k, v in bn.state_dict().items()})
    bn = bn.to("tpu")
    xt = x[mine].to(dtype).to("tpu").requires_grad_()
    out = bn(xt)
    out.backward(grad[mine].to(dtype).to("tpu"))
    # a rank with an empty slice gets no grads at all (torch leaves them None, as on CUDA)
    gw, gb = (torch.zeros(4, device="tpu") if p.grad is None else p.grad.float() for p in (bn.weight, bn.bias))
    dist.all_reduce(gw)
    dist.all_reduce(gb)
    xr = x.clone().requires_grad_()
    ref_out = ref(xr)
    ref_out.backward(grad)
    return {"out": out.detach().float().cpu(), "ref_out": ref_out.detach()[mine],
            "grad_x": torch.zeros(xt.shape) if xt.grad is None else xt.grad.float().cpu(), "ref_grad_x": xr.grad[mine],
            "grad_w": gw.cpu(), "ref_grad_w": ref.weight.grad, "grad_b": gb.cpu(), "ref_grad_b": ref.bias.grad,
            "running_mean": bn.running_mean.float().cpu(), "ref_running_mean": ref.running_mean,
            "running_var": bn.running_var.float().cpu(), "ref_running_var": ref.running_var}
