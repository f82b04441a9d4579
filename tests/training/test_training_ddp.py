"""DDP on the "tpu" backend trains exactly like one process on the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tpudist.training.equivalence import full_parameters, to_numpy, update_error

STEPS = 3
GLOBAL_BATCH = 8
LR = 0.05
FP32_RTOL = 1e-5


class Net(nn.Module):
    """A small MLP; ``unused`` is never touched in forward (for find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def loss_fn(model, x, y):
    return (model(x) - y).pow(2).mean()


def train_single_process() -> dict[str, torch.Tensor]:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        loss_fn(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return full_parameters(model)


def train_ddp(variant: str) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = {"bucket_cap_mb": 1e-4}  # tiny buckets: several all-reduces per backward, in reverse order
    kwargs |= {"gradient_as_bucket_view": {"gradient_as_bucket_view": True},
               "static_graph": {"static_graph": True},
               "find_unused": {"find_unused_parameters": True}}.get(variant, {})
    net = make_net()
    if variant != "find_unused":
        net.unused.requires_grad_(False)  # DDP skips frozen parameters; others must all get gradients
    model = DDP(net, **kwargs)
    if variant == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank::world], y[rank::world]
        if variant == "no_sync":
            # Two micro-batches per step; only the second backward all-reduces.
            with model.no_sync():
                (loss_fn(model, x[0::2], y[0::2]) / 2).backward()
            (loss_fn(model, x[1::2], y[1::2]) / 2).backward()
        else:
            loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return to_numpy(full_parameters(model))


@pytest.fixture(scope="module")
def reference():
    return full_parameters(make_net()), train_single_process()


# variant -> (upper bound, lower bound) of the relative update error. The fp16 hook must round
# visibly (else it did not run), but stay within fp16 precision.
VARIANTS = {"plain": (FP32_RTOL, 0.0), "gradient_as_bucket_view": (FP32_RTOL, 0.0),
            "static_graph": (FP32_RTOL, 0.0), "no_sync": (FP32_RTOL, 0.0), "find_unused": (FP32_RTOL, 0.0),
            "fp16_hook": (2e-3, FP32_RTOL)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ddp_matches_single_process(pool2, reference, variant):
    initial, ref = reference
    results = pool2.run(train_ddp, variant)
    for rank, got in enumerate(results):
        assert (got["unused.weight"] == initial["unused.weight"].numpy()).all(), "unused parameter moved"
        used = [n for n in ref if not n.startswith("unused.")]
        errors = update_error({n: initial[n] for n in used}, {n: ref[n] for n in used},
                              {n: got[n] for n in used})
        upper, lower = VARIANTS[variant]
        assert lower <= max(errors.values()) < upper, f"rank {rank}: {errors}"
    for name in results[0]:
        assert (results[0][name] == results[1][name]).all(), f"replicas diverged at {name}"

