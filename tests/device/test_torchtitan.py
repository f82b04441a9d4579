"""torchtitan's Llama 3 debug model trains on the "tpu" device like on CPU eager torch.

The model comes from torchtitan's own flavor table (``llama3_configs["debugmodel"]``: 6 layers, dim 256,
vocab 2048, fused QKV, complex RoPE) and trains on synthetic token batches: no tokenizer, no dataset.
Three CPU-launch adaptations of torchtitan 0.3 live here, not in tpudist (``_import_torchtitan``,
``_debug_config``): torchtitan imports Triton unconditionally (a CUDA-only package, absent with torch's
CPU build), and its FlexAttention runs through torch.compile + Inductor and has no backward on CPU, so
the CPU reference could not train with it.

Installing the device renames PrivateUse1 for the whole process, so everything runs in one worker
process, as in tests/device/test_device.py; this pytest process never imports ``tpudist.device``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

from tpudist.testing import RankPool  # noqa: E402

STEPS = 3
BATCH, SEQ = 2, 32


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- helpers that run in the worker ------------------------------------------------------------------


def _import_torchtitan():
    """Import torchtitan's Llama 3 package on a machine without Triton.

    ``torchtitan.models.common`` imports the expert-parallel Triton kernels at module level (for MoE
    models only). A placeholder module stands in for that one kernels module; Llama 3 never calls it.
    Faking ``triton`` itself instead would make torch's Inductor believe Triton is installed.
    """
    import sys
    import types

    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            stub = types.ModuleType(name, "placeholder: Triton kernels are CUDA-only (tests/device/test_torchtitan.py)")
            stub.__getattr__ = lambda attr: _unavailable(attr)
            sys.modules[name] = stub
    from torchtitan.models import llama3

    return llama3


def _unavailable(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)

    def call(*args, **kwargs):
        raise RuntimeError(f"torchtitan's Triton kernel {attr} needs CUDA and Triton; this process has neither")

    return call


def _debug_config():
    """torchtitan's "debugmodel" flavor with SDPA (causal) in place of FlexAttention in every layer.

    FlexAttention is compiled with Inductor and has no backward on CPU; with one unpacked document per
    row, causal SDPA computes the same attention.
    """
    llama3 = _import_torchtitan()
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = llama3.llama3_configs["debugmodel"](attn_backend="flex")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _batches(vocab):
    """One synthetic batch, seen every step, so that three steps visibly lower the loss."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _train(model, batches, device):
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for x, y in batches:
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_debug_model(modes):
    import tpudist.device  # noqa: F401  (before torchtitan: its device_type is read at import)

    config = _debug_config()
    torch.manual_seed(0)
    cpu = config.build()
    cpu.init_states()
    tpus = {mode: copy.deepcopy(cpu).to("tpu") for mode in modes}
    batches = _batches(config.vocab_size)
    out = {"cpu": _train(cpu, batches, "cpu")}
    for mode, model in tpus.items():
        with torch.tpu.eager_mode(mode):
            losses = _train(model, batches, "tpu")
        diff = max((a - b.cpu()).abs().max().item() for a, b in zip(cpu.parameters(), model.parameters()))
        out[mode] = (losses, diff, str(next(model.parameters()).device))
    return out


def run_memory_monitor():
    """What torchtitan's trainer asks of the device module: its device type and memory monitor."""
    import tpudist.device  # noqa: F401

    _import_torchtitan()
    from torchtitan.components.metrics import build_device_memory_monitor
    from torchtitan.tools import utils

    monitor = build_device_memory_monitor()
    x = torch.ones(1024, 1024, device="tpu")  # 4 MiB
    (x * 2).sum().item()
    stats = monitor.get_peak_stats()
    monitor.reset_peak_stats()
    return dict(device_type=utils.device_type, module=utils.device_module.__name__,
                name=monitor.device_name, capacity=monitor.device_capacity,
                peak_active_gib=stats.max_active_gib, peak_reserved_gib=stats.max_reserved_gib,
                retries=stats.num_alloc_retries, ooms=stats.num_ooms)


# -- tests -------------------------------------------------------------------------------------------


def test_debug_model_trains_like_cpu(dev):
    out = dev(run_debug_model, ("strict", "fused"))
    ref = out.pop("cpu")
    assert ref[-1] < ref[0], f"the CPU reference did not learn: {ref}"
    for mode, (losses, diff, device) in out.items():
        assert device == "tpu:0", (mode, device)
        assert losses == pytest.approx(ref, rel=1e-4), f"{mode}: losses {losses} vs CPU {ref}"
        assert diff < 2e-4, f"{mode}: parameters differ from CPU by up to {diff} (AdamW lr 1e-3)"


def test_memory_monitor(dev):
    # torchtitan's metrics module imports tensorboard, a torchtitan dependency a --no-deps install lacks
    pytest.importorskip("tensorboard", reason="tensorboard (torchtitan's metrics need it) is not installed")
    got = dev(run_memory_monitor)
    assert got["device_type"] == "tpu" and got["module"] == "torch.tpu", got
    assert isinstance(got["name"], str) and got["name"], got
    assert got["capacity"] > 0, got
    assert 4 / 1024 <= got["peak_active_gib"] <= got["peak_reserved_gib"], got
    assert got["retries"] >= 0 and got["ooms"] >= 0, got
