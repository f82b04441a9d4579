"""Fused mode runs the forward's graph at the first op of a backward pass (docs/device.md, Eager modes).

The device computes the forward while the host records the backward; the saved activations cross from
the forward's program to the backward's in their own shape. Against CPU eager and against the same
step recorded as one graph (``TPUDIST_FUSED_SPLIT_BACKWARD=0``). Sizes of their own per test: the
process's programs are shared by every test of the folder.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpudist.device  # noqa: F401  (installs the "tpu" device)


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.GELU(), torch.nn.LayerNorm(width),
                               torch.nn.Linear(width, 5))


def _data(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(n)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model, device: str, optimizer=_sgd, steps: int = 3):
    """Per step: the loss, the fused stats it moved, and the parameters after it (on the CPU)."""
    opt = optimizer(model.parameters())
    results = []
    for x, y in _data(steps):
        before = torch.tpu.cache_stats()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        after = torch.tpu.cache_stats()
        moved = {k: after.get(k, 0) - before.get(k, 0)
                 for k in ("backward_splits", "shaped_reads", "shaped_flattened", "syncs", "programs")}
        results.append((value, moved, [p.detach().cpu().clone() for p in model.parameters()]))
    return results


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_training_steps_equal_cpu_and_one_graph(mode, monkeypatch):
    ref = _train(_mlp(20), "cpu")
    split = _train(_mlp(20).to("tpu"), "tpu")
    monkeypatch.setenv("TPUDIST_FUSED_SPLIT_BACKWARD", "0")
    whole = _train(_mlp(20).to("tpu"), "tpu")
    for (r_loss, _, r_params), (s_loss, moved, s_params), (w_loss, w_moved, w_params) in zip(ref, split, whole):
        assert moved["backward_splits"] == 1 and w_moved["backward_splits"] == 0, (moved, w_moved)
        # the backward's program reads the forward's saved activations (N-d) as they are: none flattened
        assert moved["shaped_reads"] > 0 and moved["shaped_flattened"] == 0, moved
        assert w_moved["shaped_reads"] == 0, w_moved
        # two programs fuse differently from one (elements 1 ulp apart): each against CPU eager
        for r, s, w in zip(r_params, s_params, w_params):
            torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w, r, rtol=1e-5, atol=1e-6)
        assert abs(s_loss - r_loss) <= 1e-5 * abs(r_loss) and abs(w_loss - r_loss) <= 1e-5 * abs(r_loss)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_accumulated_and_retained_backwards(mode):
    """Two backward passes into the same gradients (one of a retained graph) and a value the forward
    made, read afterwards by views and by Strict mode: each backward's first op runs what is pending."""
    results = {}
    for device in ("cpu", "tpu"):
        model = _mlp(28).to(device)
        (x1, y1), (x2, _) = _data(2)
        hidden = model[0](x1.to(device))
        loss1 = F.cross_entropy(model[3](model[2](model[1](hidden))), y1.to(device))
        loss2 = model(x2.to(device)).square().mean()
        loss1.backward(retain_graph=True)
        loss2.backward()
        loss1.backward()
        with torch.tpu.eager_mode("strict"):
            total = hidden.sum()
        results[device] = [p.grad.cpu() for p in model.parameters()] + [
            hidden.t()[3:].cpu(), hidden[:, ::2].cpu(), total.cpu()]
    for r, g in zip(results["cpu"], results["tpu"]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bad_switch_value_raises(monkeypatch):
    from tpudist.device import _fused

    monkeypatch.setenv("TPUDIST_FUSED_SPLIT_BACKWARD", "yes")
    with pytest.raises(ValueError, match="TPUDIST_FUSED_SPLIT_BACKWARD='yes' must be '1'"):
        _fused.split_backward()


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
@pytest.mark.parametrize("chunks,width,syncs", [
    ({"FORWARD": "6"}, 44, 3), ({"BACKWARD": "5"}, 46, 4), ({"FORWARD": "6", "BACKWARD": "5"}, 48, 5)],
    ids=["forward", "backward", "both"])
def test_steps_in_chunks_equal_cpu_and_reuse_their_programs(mode, monkeypatch, chunks, width, syncs):
    """TPUDIST_FUSED_FORWARD_CHUNK=6: a forward under autograd runs every 6 ops; TPUDIST_FUSED_BACKWARD_CHUNK=5:
    the graph begun in the backward pass (backward, then the optimizer step) every 5. Values cross the cuts
    in their own shape; every step is cut at the same ops (no program after step 1); a forward under
    no_grad is not cut."""
    for part, ops in chunks.items():
        monkeypatch.setenv(f"TPUDIST_FUSED_{part}_CHUNK", ops)
    ref = _train(_mlp(width), "cpu")
    model = _mlp(width).to("tpu")
    got = _train(model, "tpu")
    # a program per chunk: without chunks a step runs two (the forward at the backward's start, the rest)
    for (r_loss, _, r_params), (loss, moved, params) in zip(ref, got):
        assert moved["syncs"] == syncs and moved["shaped_reads"] > 0 and moved["shaped_flattened"] == 0, moved
        for r, g in zip(r_params, params):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        assert abs(loss - r_loss) <= 1e-5 * abs(r_loss)
    assert got[2][1]["syncs"] == got[1][1]["syncs"]
    built = torch.tpu.cache_stats()["programs"]
    _train(model, "tpu")
    assert torch.tpu.cache_stats()["programs"] == built
    syncs = torch.tpu.cache_stats()["syncs"]
    with torch.no_grad():
        out = model(_data(1)[0][0].to("tpu")).sum().item()
    assert torch.tpu.cache_stats()["syncs"] == syncs + 1
    assert out == pytest.approx(model.cpu()(_data(1)[0][0]).sum().item(), rel=1e-5)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
@pytest.mark.parametrize("chunks", [{"BACKWARD": "7"}, {"FORWARD": "3", "BACKWARD": "7"}], ids=["backward", "both"])
def test_adamw_in_chunks_compiles_nothing_after_step_1(mode, monkeypatch, chunks):
    """AdamW makes its state (zeros_like) in step 1, inside a chunk of the backward's graph: the chunks count
    only ops that read an array, so step 1 is cut where step 2 is, and its state is made in the shape step 2
    reads it in; step 2's chunks are then step 1's programs (on a TPU v5e step 2 compiled one for 25 s)."""
    for part, ops in chunks.items():
        monkeypatch.setenv(f"TPUDIST_FUSED_{part}_CHUNK", ops)

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    ref = _train(_mlp(40), "cpu", adamw, steps=4)
    got = _train(_mlp(40).to("tpu"), "tpu", adamw, steps=4)
    built = [moved["programs"] for _, moved, _ in got]
    assert built[0] > 0 and built[1:] == [0, 0, 0], built
    for r, g in zip(ref[-1][2], got[-1][2]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bad_chunk_value_raises(monkeypatch):
    from tpudist.device import _fused

    monkeypatch.setenv("TPUDIST_FUSED_FORWARD_CHUNK", "-5")
    with pytest.raises(ValueError, match="TPUDIST_FUSED_FORWARD_CHUNK='-5' must be a number of ops"):
        _fused.forward_chunk()
    monkeypatch.setenv("TPUDIST_FUSED_BACKWARD_CHUNK", "1e3")
    with pytest.raises(ValueError, match="TPUDIST_FUSED_BACKWARD_CHUNK='1e3' must be a number of ops"):
        _fused.backward_chunk()
