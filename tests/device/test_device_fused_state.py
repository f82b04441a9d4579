"""A Fused training loop compiles its step once: state an optimizer creates in step 1 is made apart.

AdamW makes ``exp_avg``/``exp_avg_sq`` (and, capturable or fused, ``step``) with ``zeros_like`` inside
its first step; step 2 reads them. Without ``tpudist.device._hoist`` step 1 and step 2 were two
programs of the whole step (issue #37: 70 s and 63 s to compile on a TPU v5e at 158M parameters).
Counts, not times, against CPU eager losses. Each test's model has sizes of its own: the process's
programs are shared by every test of the folder, and a program another test built would hide a miss.
"""

from __future__ import annotations

import jax
import pytest
import torch
import torch.nn.functional as F

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.training.model import ModelArgs, Transformer

STEPS = 5


def _loss_rtol() -> float:
    """Against CPU eager AdamW: float32 matmuls on a TPU run one bf16 pass by default (2.3e-3 relative
    from float64 on a v5e; the CPU backend 2.4e-7), so the chip gets a looser bound."""
    return 1e-5 if jax.devices()[0].platform == "cpu" else 2e-2


VARIANTS = {  # AdamW's implementations: each makes its state its own way
    "foreach": {},
    "for_loop": {"foreach": False},
    "capturable": {"capturable": True},  # step counts on the device, bias corrections computed there
    "fused": {"fused": True},  # torch._fused_adamw_, step counts on the device
}


def _model(variant: str) -> Transformer:
    torch.manual_seed(0)
    dim = 8 * (3 + list(VARIANTS).index(variant))  # sizes no other test uses
    return Transformer(ModelArgs(vocab_size=40, dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8))


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 40, (2, 8), generator=g), torch.randint(0, 40, (2, 8), generator=g))
            for _ in range(STEPS)]


def _train(model, opt, device):
    """Losses and, per step, the fused programs built and the ops split off into init programs."""
    losses, programs, hoisted = [], [], []
    for x, y in _batches():
        before = torch.tpu.cache_stats()
        loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after = torch.tpu.cache_stats()
        programs.append(after["programs"] - before["programs"])
        hoisted.append(after.get("hoisted_ops", 0) - before.get("hoisted_ops", 0))
    return losses, programs, hoisted


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_adamw_loop_compiles_its_step_once(mode, variant):
    ref_model = _model(variant)
    ref, _, _ = _train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), "cpu")
    model = _model(variant).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **VARIANTS[variant])
    losses, programs, hoisted = _train(model, opt, "tpu")
    for step, (r, g) in enumerate(zip(ref, losses)):
        assert abs(r - g) <= _loss_rtol() * abs(r), (variant, step, losses, ref)
    # step 1: the forward's program and the rest's (backward and optimizer step), which every later step
    # runs, and a one-op program per kind of state tensor (zeros_like of one shape; zeros(()) for device
    # step counts) and for the backward's seed (ones_like(loss), made in the forward's graph and kept
    # past it) unless an earlier test made it
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.device.type == "tpu"]
    kinds = {(tuple(v.shape), v.dtype) for v in state}  # the seed's ones_like(()) is a kernel of its own
    assert 2 <= programs[0] <= 2 + len(kinds) + 1 and programs[1:] == [0] * (STEPS - 1), (programs, kinds)
    assert hoisted == [len(state) + 1] + [0] * (STEPS - 1), (hoisted, len(state))


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_a_loop_without_state(mode, split, monkeypatch):
    """SGD without momentum makes no state: nothing is split off, the causal mask's constants included,
    but the backward's seed when the forward runs apart (the default); with
    TPUDIST_FUSED_SPLIT_BACKWARD=0 the step is one program."""
    monkeypatch.setenv("TPUDIST_FUSED_SPLIT_BACKWARD", "1" if split else "0")
    dim = 56 if split else 72  # sizes of their own: a program of the other case would hide a miss
    torch.manual_seed(0)
    ref_model = Transformer(ModelArgs(vocab_size=40, dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8))
    model = Transformer(ModelArgs(vocab_size=40, dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8))
    model.load_state_dict(ref_model.state_dict())
    ref, _, _ = _train(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), "cpu")
    model = model.to("tpu")
    before = torch.tpu.cache_stats()
    losses, programs, hoisted = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), "tpu")
    after = torch.tpu.cache_stats()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=_loss_rtol(), atol=0)
    splits = after.get("backward_splits", 0) - before.get("backward_splits", 0)
    if split:  # the forward's program, the rest's, and the seed's one-op program unless an earlier test made it
        assert 2 <= programs[0] <= 3 and programs[1:] == [0] * (STEPS - 1), programs
        assert hoisted == [1] + [0] * (STEPS - 1), hoisted
        assert splits == STEPS, splits
    else:
        assert programs == [1] + [0] * (STEPS - 1), programs
        assert hoisted == [0] * STEPS, hoisted
        assert splits == 0, splits


def _compute(acc, ones):
    x = torch.arange(6.0).reshape(2, 3).to(acc.device)
    acc.add_(x * 2)                                      # acc: written in place
    mask = torch.ones(2, 3, device=acc.device).tril()   # made and not kept: stays in the program
    return (acc * mask).sum(0) + ones                    # ones: read, never written


def _made_and_kept(device):
    """A graph that makes storages it keeps (one written, one not) and computes with them."""
    acc, ones = torch.zeros(2, 3, device=device), torch.ones(3, device=device)
    return acc, ones, _compute(acc, ones)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_split_graph_values_equal_cpu_and_the_rest_is_shared(mode):
    want = _made_and_kept("cpu")
    before = torch.tpu.cache_stats()
    got = _made_and_kept("tpu")
    torch.tpu.synchronize()
    after = torch.tpu.cache_stats()
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
    assert after["hoisted_ops"] - before.get("hoisted_ops", 0) == 2  # zeros and ones; the mask's ones stay
    assert after["programs"] - before["programs"] == 3  # zeros alone, ones alone, the rest
    # the same computation on storages made before it is the split graph's second program
    acc, ones = torch.zeros(2, 3, device="tpu"), torch.ones(3, device="tpu")
    torch.tpu.synchronize()
    programs = torch.tpu.cache_stats()["programs"]
    out = _compute(acc, ones)
    torch.tpu.synchronize()
    assert torch.tpu.cache_stats()["programs"] == programs
    torch.testing.assert_close(out.cpu(), want[2], rtol=0, atol=0)
    torch.testing.assert_close(acc.cpu(), want[0], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_a_graph_of_constants_alone_is_not_split(mode):
    before = torch.tpu.cache_stats()
    z = torch.zeros(5, 7, device="tpu")
    torch.tpu.synchronize()
    after = torch.tpu.cache_stats()
    assert after.get("hoisted_ops", 0) == before.get("hoisted_ops", 0)
    assert torch.equal(z.cpu(), torch.zeros(5, 7))
