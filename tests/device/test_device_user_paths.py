"""Paths of torch that user code reaches through ``torch.tpu`` (the device module), against CPU eager.

- Activation checkpointing (``torch.utils.checkpoint``, reentrant and not) stashes the device's RNG
  state when ``torch.tpu._initialized`` says the device is in use, and restores it around the
  recomputation with ``torch.tpu.device(i)``: without both, a checkpointed block with dropout
  recomputes a different mask and its gradients are silently wrong.
- ``torch.load(f, map_location="tpu")`` of a checkpoint saved from CPU tensors: torch would build
  device storages with an allocator a Python backend does not have (the process segfaulted).
- ``torch.amp.GradScaler("tpu")`` with autocast: unscale, the inf check that skips a step, and the
  scale's growth and back-off, as on the CPU.
- CPU index tensors into a device tensor (``x[cpu_index]``, ``x[cpu_index] = v``), which CUDA accepts
  and HF BEiT relies on; other CPU tensor arguments stay a device-mismatch error.
- ``DataLoader(pin_memory=True)`` (Hugging Face's Trainer default) and ``Tensor.pin_memory()``: torch
  asks the PrivateUse1 hooks for a pinned allocator a Python backend cannot give (NotImplementedError).
- Hugging Face's ``Trainer`` on the device: accelerate calls ``torch.accelerator.empty_cache()`` for a
  backend it does not know by name, which asserted ("Allocator for tpu is not a DeviceAllocator");
  its checkpoints and ``save_pretrained`` find tied weights by ``untyped_storage().data_ptr()``, which
  was 0 for every tpu storage (every weight looked shared with every other: save raised).
- ``torch.compile(model)`` with inductor, the default backend: torch 2.13's inductor generates Pallas
  code for a device named "tpu" that imports Google's ``torch_tpu``; graphs of tpu tensors now
  compile with tpudist's backend, with a warning.

All cases run in one worker process that installs the device (it renames PrivateUse1 for the process).
"""

from __future__ import annotations

import io

import pytest
import torch

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- in the worker ------------------------------------------------------------------------------------


def _block():
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(F.gelu(self.lin(x)))

    return Block()


def run_checkpoint(mode: str, reentrant: bool | None, p_drop: float) -> dict:
    """Gradients of a block (dropout ``p_drop``) with and without checkpointing, on ``device``."""
    import tpudist.device  # noqa: F401
    from torch.utils.checkpoint import checkpoint

    out = {}
    for device in ("cpu", "tpu"):
        for ckpt in (False, True):
            torch.manual_seed(0)
            block = _block().to(device)
            block.drop.p = p_drop
            x = torch.randn(4, 16).to(device).requires_grad_()
            torch.manual_seed(5)
            with torch.tpu.eager_mode(mode):
                y = checkpoint(block, x, use_reentrant=reentrant) if ckpt else block(x)
                (y * y).sum().backward()
                out[device, ckpt] = (y.detach().cpu(), block.lin.weight.grad.cpu(), x.grad.cpu())
    return out


def run_load_map_location() -> dict:
    import tpudist.device  # noqa: F401
    from torch import nn

    torch.manual_seed(0)
    emb, head = nn.Embedding(5, 4), nn.Linear(4, 5)
    head.weight = emb.weight  # tied: saved once
    base = torch.arange(12.0).reshape(3, 4)
    saved = {
        "sd": {"emb.weight": emb.weight, "head.weight": head.weight, "head.bias": head.bias},
        "base": base, "view": base[1:, 1:], "param": nn.Parameter(torch.ones(2)),
        "ints": torch.arange(4), "bf16": torch.linspace(0, 1, 3, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
    }
    buf = io.BytesIO()
    torch.save(saved, buf)
    out = {"saved": saved}
    for name, where in (("str", "tpu"), ("indexed", "tpu:0"), ("device", torch.device("tpu")),
                        ("dict", {"cpu": "tpu"})):
        buf.seek(0)
        got = torch.load(buf, map_location=where)
        out[name] = {
            "devices": sorted({str(t.device) for t in _tensors(got)}),
            "values": {k: v.cpu() for k, v in _flat(got).items()},
            "dtypes": {k: v.dtype for k, v in _flat(got).items()},
            "param": (type(got["param"]).__name__, got["param"].requires_grad),
            "view_offset": got["view"].storage_offset(),
        }
        with torch.no_grad():
            got["base"].add_(100)  # the view was rebuilt over the same device storage: it sees this
        out[name]["view_after_base_write"] = got["view"].cpu()
    buf.seek(0)
    try:
        torch.load(buf, map_location="tpu:1")
    except Exception as e:  # noqa: BLE001
        out["bad_index"] = (type(e).__name__, str(e))
    model = nn.Linear(4, 5).to("tpu")
    buf2 = io.BytesIO()
    torch.save(nn.Linear(4, 5).state_dict(), buf2)
    buf2.seek(0)
    sd = torch.load(buf2, map_location="tpu")
    model.load_state_dict(sd)
    out["loaded_model"] = {k: v.cpu() for k, v in model.state_dict().items()}
    buf2.seek(0)
    out["cpu_sd"] = torch.load(buf2)
    with torch.tpu.device(0), torch.tpu.device_of(model.weight):
        out["index"] = torch.tpu._utils._get_device_index("tpu:0")  # noqa: SLF001
    return out


def run_cpu_indices(mode: str) -> dict:
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    rows, cols = torch.tensor([3, 0, 3]), torch.tensor([1, 2, 3])
    mask = torch.tensor([True, False, True, False, True])
    out = {}
    with torch.tpu.eager_mode(mode):
        for device in ("cpu", "tpu"):
            leaf = x.clone().to(device).requires_grad_()
            picked = leaf[rows] * torch.arange(4.0).to(device)
            picked.sum().backward()
            put, acc, fill = (x.clone().to(device) for _ in range(3))
            put[rows] = torch.ones(3, 4).to(device)
            acc.index_put_((rows,), torch.ones(3, 4).to(device), accumulate=True)
            fill[mask] = 7.0
            out[device] = [t.detach().cpu() for t in (
                picked, leaf.grad, leaf[rows, cols], leaf[mask], put, acc, fill)]
        for name, fn in (("add", lambda t: t + torch.ones(4)),
                         ("index_select", lambda t: t.index_select(0, rows))):
            try:
                fn(x.to("tpu"))
            except RuntimeError as e:
                out[name] = str(e)
    return out


def run_grad_scaler(mode: str) -> dict:
    import tpudist.device  # noqa: F401
    import torch.nn.functional as F

    out = {}
    with torch.tpu.eager_mode(mode):
        for device in ("cpu", "tpu"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(device)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16, growth_interval=2)
            scales = []
            for step in range(5):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = F.mse_loss(model(x).float(), torch.zeros(4, 2).to(device))
                if step == 2:
                    loss = loss * float("inf")  # this step's gradients overflow: skipped, scale backs off
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                scales.append(scaler.get_scale())
            out[device] = (scales, [p.detach().cpu() for p in model.parameters()])
    return out


def run_pinned_loader(mode: str) -> dict:
    import tpudist.device  # noqa: F401
    from torch.utils.data import DataLoader, TensorDataset

    xs, ys = torch.randn(10, 3), torch.arange(10)
    out = {"batches": [], "pinned": []}
    with torch.tpu.eager_mode(mode):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).to("tpu")
        for x, y in DataLoader(TensorDataset(xs, ys), batch_size=4, pin_memory=True):
            out["pinned"].append((x.is_pinned(), y.is_pinned()))
            x, y = x.to("tpu", non_blocking=True), y.to("tpu", non_blocking=True)
            out["batches"].append((model(x).detach().cpu(), y.cpu()))
    plain = torch.randn(2, 5)
    pinned = plain.t().pin_memory()
    out["plain_is_pinned"] = plain.is_pinned()
    out["pinned"] += [(pinned.is_pinned(), pinned[1:].is_pinned())]  # a view of pinned memory is pinned
    out["copy"] = (torch.equal(pinned, plain.t()), pinned.stride() == plain.t().stride(),
                   pinned.data_ptr() != plain.data_ptr(), pinned.pin_memory() is pinned)
    del pinned
    out["after_free"] = torch.randn(2, 5).t().is_pinned()  # memory at a freed pinned address is not pinned
    try:
        plain.pin_memory("cuda")
    except ValueError as e:
        out["bad_device"] = str(e)
    out["cpu_reference"] = [torch.nn.Linear(3, 1) for _ in [torch.manual_seed(0)]][0](xs).detach()
    return out


def run_hf_trainer(mode: str) -> dict:
    import os
    import tempfile

    import tpudist.device  # noqa: F401
    from rank_fns_trainer import tiny_llama_config_and_data
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    cfg, data = tiny_llama_config_and_data(8)

    def train(use_cpu, out_dir, resume=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        args = TrainingArguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                                 report_to=[], use_cpu=use_cpu, logging_steps=1, save_strategy="steps", save_steps=2,
                                 seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return model, {"device": str(next(model.parameters()).device),
                       "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                       "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}

    out = {}
    with torch.tpu.eager_mode(mode), tempfile.TemporaryDirectory() as tmp:
        _, out["cpu"] = train(True, os.path.join(tmp, "cpu"))
        model, out["tpu"] = train(False, os.path.join(tmp, "tpu"))  # checkpoints at steps 2 and 3
        _, out["resumed"] = train(False, os.path.join(tmp, "tpu"), resume=os.path.join(tmp, "tpu", "checkpoint-2"))
        model.save_pretrained(os.path.join(tmp, "saved"))  # tied embeddings: one storage on the device
        loaded = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "saved"))
        out["saved"] = {k: v.detach() for k, v in loaded.state_dict().items()}
        ptr = {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters(remove_duplicate=False)}
        out["tied"] = ptr["lm_head.weight"] == ptr["model.embed_tokens.weight"]
        out["distinct"] = len({p.untyped_storage().data_ptr() for p in model.parameters()})
        out["num_params"] = len(list(model.parameters()))
    return out


def run_default_compile() -> dict:
    import warnings

    import tpudist.device  # noqa: F401
    import torch.nn.functional as F
    from tpudist.device import _compile_default

    _compile_default._warned = False  # once per process: this run counts its own
    out = {}
    for device in ("cpu", "tpu"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 4)).to(device)
        compiled = torch.compile(model)  # inductor, as users write it
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                loss = F.cross_entropy(compiled(x.to(device)), torch.tensor([0, 1, 2, 3], device=device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        out[device] = {"losses": losses, "params": [p.detach().cpu() for p in model.parameters()],
                       "warnings": [str(w.message) for w in caught if "inductor" in str(w.message)]}
    return out


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    return {prefix.rstrip("."): obj}


def _tensors(obj):
    return list(_flat(obj).values())


# -- tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpointed_dropout_recomputes_the_same_mask(dev, mode, reentrant):
    out = dev(run_checkpoint, mode, reentrant, 0.5)
    for device in ("cpu", "tpu"):
        plain, ckpt = out[device, False], out[device, True]
        for a, b in zip(plain, ckpt):
            assert torch.equal(a, b), f"{device}: checkpointed gradients differ from the plain run"
    assert 0.3 < (out["tpu", True][0] == 0).float().mean() < 0.7  # dropout really ran on the device


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_checkpoint_without_dropout_matches_cpu(dev, mode):
    out = dev(run_checkpoint, mode, False, 0.0)
    for a, b in zip(out["cpu", True], out["tpu", True]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_torch_load_map_location_tpu(dev):
    out = dev(run_load_map_location)
    saved = _flat(out["saved"])
    for name in ("str", "indexed", "device", "dict"):
        got = out[name]
        assert got["devices"] == ["tpu:0"], name
        for key, value in saved.items():
            assert got["dtypes"][key] == value.dtype, (name, key)
            assert torch.equal(got["values"][key], value.detach()), (name, key)
        assert got["param"] == ("Parameter", True)
        assert got["view_offset"] == 5
        assert torch.equal(got["view_after_base_write"], saved["view"] + 100), name  # one storage, shared
    kind, message = out["bad_index"]
    assert kind == "ValueError" and "device index 1 does not exist" in message
    for key, value in out["cpu_sd"].items():
        assert torch.equal(out["loaded_model"][key], value), key
    assert out["index"] == 0


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_cpu_index_tensors_into_device_tensors(dev, mode):
    out = dev(run_cpu_indices, mode)
    for i, (want, got) in enumerate(zip(out["cpu"], out["tpu"])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"case {i}")
    for name in ("add", "index_select"):  # CUDA refuses these with a CPU tensor too
        assert "Expected all tensors to be on the same device" in out[name], name


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_grad_scaler_with_autocast_steps_like_cpu(dev, mode):
    out = dev(run_grad_scaler, mode)
    assert out["tpu"][0] == out["cpu"][0] == [2.0 ** 16, 2.0 ** 17, 2.0 ** 16, 2.0 ** 16, 2.0 ** 17]
    for got, want in zip(out["tpu"][1], out["cpu"][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_pinned_dataloader_batches_equal_cpu(dev, mode):
    out = dev(run_pinned_loader, mode)
    got = torch.cat([b[0] for b in out["batches"]])
    torch.testing.assert_close(got, out["cpu_reference"], rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.cat([b[1] for b in out["batches"]]), torch.arange(10))
    assert out["pinned"] == [(True, True)] * 4  # 3 batches, then a pinned tensor and its view
    assert out["plain_is_pinned"] is False and out["after_free"] is False
    assert out["copy"] == (True, True, True, True)
    assert "pinned for 'tpu' only" in out["bad_device"]


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_hugging_face_trainer_trains_like_cpu(dev, mode):
    pytest.importorskip("transformers", reason="Hugging Face's Trainer needs transformers (optional extra)")
    pytest.importorskip("accelerate", reason="Hugging Face's Trainer needs accelerate (optional extra)")
    out = dev(run_hf_trainer, mode)
    assert (out["cpu"]["device"], out["tpu"]["device"]) == ("cpu", "tpu:0")
    assert len(out["cpu"]["losses"]) == 3
    assert out["tpu"]["losses"] == pytest.approx(out["cpu"]["losses"], rel=1e-5)
    for name, want in out["cpu"]["params"].items():
        # AdamW at lr 1e-2 normalises each step: a gradient near 0 moves its parameter by up to lr whatever
        # its rounding, so CPU kernels that round differently move it too (1.05e-5 on an AVX512 AMD EPYC)
        torch.testing.assert_close(out["tpu"]["params"][name], want, rtol=1e-4, atol=5e-5, msg=name)
        assert torch.equal(out["resumed"]["params"][name], out["tpu"]["params"][name]), name  # from checkpoint-2
        assert torch.equal(out["saved"][name], out["tpu"]["params"][name]), name  # save_pretrained round trip
    # data_ptr() of a tpu storage: aliases (the tied embedding) equal, every other parameter distinct
    assert out["tied"] and out["distinct"] == out["num_params"]


def test_default_torch_compile_of_a_device_model_trains_like_cpu(dev):
    out = dev(run_default_compile)
    assert out["tpu"]["losses"] == pytest.approx(out["cpu"]["losses"], rel=1e-5)
    for got, want in zip(out["tpu"]["params"], out["cpu"]["params"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert out["cpu"]["warnings"] == []  # CPU graphs stay inductor's
    assert len(out["tpu"]["warnings"]) == 1 and "backend='tpu'" in out["tpu"]["warnings"][0]
