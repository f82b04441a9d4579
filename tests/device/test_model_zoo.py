"""A model zoo on the "tpu" device and through ``torch.compile(backend="tpu")``, against CPU eager torch.

Real architectures nobody here wrote (``zoo_models``: Hugging Face Llama, GPT-2, BERT with a padding
mask, T5, Mixtral (mixture of experts), Swin (shifted-window vision transformer), a torchvision-style ResNet with BatchNorm, an LSTM/GRU language model with tied weights)
train ``STEPS`` AdamW steps from the same initial weights in each way a user runs them:

- ``strict`` / ``fused``: the model moved with ``.to("tpu")``, eager device ops in that mode;
- ``compile_cpu``: ``torch.compile(backend="tpu")`` of the loss on CPU tensors;
- ``compile_device``: the same on the device's tensors.

Each must match CPU eager: losses within 1e-4 relative at every step, parameters and buffers (BatchNorm
running statistics) within 1% of how far training moved them plus 1e-5 (L2 norms: AdamW normalises each
element's step, so an element whose gradient is rounding noise may step either way; a missed update is 100%), the same number of parameters (tied weights stay tied), no CPU
fallback, and no new program compiled after step 2 (the step is cached, not rebuilt). The device is
installed in one worker process shared by all cases (it renames PrivateUse1 for the whole process).
"""

from __future__ import annotations

import pytest

from tpudist.testing import RankPool

import zoo_models

WAYS = ("strict", "fused", "compile_cpu", "compile_device")
LOSS_RTOL = 1e-4
STATE_RTOL = 1e-2  # of the L2 norm of (trained - initial), per parameter or buffer
STATE_ATOL = 1e-5  # for what training barely moves (BERT's key bias: its gradient is 0 up to rounding)


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=900, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- in the worker ------------------------------------------------------------------------------------


def _to(batch, device):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def _programs(way) -> int:
    """Programs built so far by the path ``way`` runs on (kernels, fused programs, compiled graphs)."""
    import torch

    from tpudist.compile import STATS

    stats = torch.tpu.cache_stats()
    return stats["misses"] + stats["programs"] + STATS.graphs + STATS.programs_compiled


def _train(model, batches, loss_fn, device, compiled):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    step_loss = loss_fn
    if compiled:
        step_loss = torch.compile(loss_fn, backend="tpu")
    losses, programs = [], []
    for batch in batches:
        loss = step_loss(model, _to(batch, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        programs.append(_programs(device))
    return losses, programs


def run_family(family: str, way: str) -> dict:
    """Train ``family`` on the CPU (reference) and in ``way``; return what the test compares."""
    import copy

    import torch

    import tpudist.device  # noqa: F401

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batches, loss_fn = zoo_models.FAMILIES[family]()
    model.train()
    other = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in (*model.named_parameters(), *model.named_buffers())}
    ref_losses, _ = _train(model, batches, loss_fn, "cpu", compiled=False)
    device = "cpu" if way == "compile_cpu" else "tpu"
    mode = "fused" if way == "fused" else "strict"
    fallbacks_before = dict(torch.tpu.cache_stats()["cpu_fallback_ops"])
    with torch.tpu.eager_mode(mode):
        other = other.to(device)
        losses, programs = _train(other, batches, loss_fn, device, compiled=way.startswith("compile"))
    ref_state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    got_state = {**dict(other.named_parameters()), **dict(other.named_buffers())}
    diffs = {}
    for name, ref in ref_state.items():
        got = got_state.get(name)
        if got is None or got.shape != ref.shape or got.dtype != ref.dtype:
            diffs[name] = f"missing or reshaped: {None if got is None else (tuple(got.shape), got.dtype)}"
            continue
        got = got.detach().cpu()
        if ref.dtype.is_floating_point:
            moved = (ref.detach() - initial[name]).norm().item()
            err = (got - ref.detach()).norm().item()
            diffs[name] = 0.0 if err <= STATE_RTOL * moved + STATE_ATOL else f"off by {err:.3g}, moved {moved:.3g}"
        else:
            diffs[name] = 0.0 if torch.equal(got, ref) else f"{got.tolist()} != {ref.tolist()}"
    fallbacks = {k: v - fallbacks_before.get(k, 0) for k, v in torch.tpu.cache_stats()["cpu_fallback_ops"].items()
                 if v != fallbacks_before.get(k, 0)}
    return dict(ref_losses=ref_losses, losses=losses, diffs=diffs, programs=programs,
                num_params=(len(list(model.parameters())), len(list(other.parameters()))),
                devices=sorted({str(t.device) for t in got_state.values()}), fallbacks=fallbacks)


# -- tests --------------------------------------------------------------------------------------------


def _family_params():
    params = []
    for family in zoo_models.FAMILIES:
        for way in WAYS:
            marks = ()
            if family in zoo_models.HF_FAMILIES:
                marks = pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed "
                                           "(pip install -e '.[test]' brings it)")
            params.append(pytest.param(family, way, marks=marks, id=f"{family}-{way}"))
    return params


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("family,way", _family_params())
def test_zoo_trains_like_cpu(dev, family, way):
    r = dev(run_family, family, way)
    assert r["num_params"][0] == r["num_params"][1], f"parameter count: cpu {r['num_params'][0]}, got {r['num_params'][1]}"
    want_device = "cpu" if way == "compile_cpu" else "tpu:0"
    assert r["devices"] == [want_device], r["devices"]
    assert not r["fallbacks"], f"CPU fallbacks: {r['fallbacks']}"
    for step, (ref, got) in enumerate(zip(r["ref_losses"], r["losses"])):
        assert abs(got - ref) <= LOSS_RTOL * abs(ref), f"step {step}: loss {got} vs cpu {ref} ({r['losses']} vs {r['ref_losses']})"
    bad = {k: v for k, v in r["diffs"].items() if v != 0.0}
    assert not bad, f"parameters/buffers off CPU eager after {len(r['losses'])} steps: {bad}"
    programs = r["programs"]
    # Fused: an optimizer's state made in step 1 runs as a program of its own, so step 2 is step 1's
    # program (tpudist.device._hoist); Strict and compiled graphs may still build kernels in step 2
    settled = 0 if way == "fused" else 1
    assert programs[-1] == programs[settled], f"programs built after step {settled + 1}: {programs}"
