"""``TPUDIST_FUSED_BLOCKS=1``: Fused programs cut at a model's repeated blocks (docs/device.md, Eager modes).

A block's forward and its backward are each a program of their own, the same program for every layer:
a model's first step compiles as many programs whatever its depth. Against CPU eager (losses and
parameters through AdamW steps), for the recipe's Transformer and Hugging Face's Llama. Sizes of their
own per test: the process's programs are shared by every test of the folder.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.device import _blocks, _fused
from tpudist.training.model import ModelArgs, Transformer


@pytest.fixture
def blocks(monkeypatch):
    monkeypatch.setenv("TPUDIST_FUSED_BLOCKS", "1")
    installed = bool(_blocks._handles)  # noqa: SLF001 - set at import (TPUDIST_FUSED_BLOCKS=1 in the environment)
    _blocks.install()  # import installs them where the variable is set before it
    yield
    if not installed:  # the worker's later tests run without the global hooks, as they would alone
        _blocks.uninstall()


def _recipe(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=64, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, max_seq_len=16))


def _hf(dim: int, layers: int) -> torch.nn.Module:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import tpu_step

    args = ModelArgs(vocab_size=64, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    return tpu_step.hf_from_recipe(Transformer(args), args)


def _logits(out):
    return getattr(out, "logits", out)


def _train(model, device: str, steps: int = 3):
    """Per step: the loss and the programs and syncs it took; then the parameters (on the CPU)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
        before = torch.tpu.cache_stats()
        loss = F.cross_entropy(_logits(model(x.to(device))).flatten(0, 1), y.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        after = torch.tpu.cache_stats()
        results.append((value, after["programs"] - before["programs"], after["syncs"] - before["syncs"]))
    return results, [p.detach().cpu() for p in model.parameters()]


def _check_equal(ref, got):
    (r_steps, r_params), (g_steps, g_params) = ref, got
    for (r_loss, _, _), (loss, _, _) in zip(r_steps, g_steps):
        assert abs(loss - r_loss) <= 1e-5 * abs(r_loss), (loss, r_loss)
    for r, g in zip(r_params, g_params):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
@pytest.mark.parametrize("make,dim,extra", [(_recipe, 24, 4), (_hf, 56, 5)], ids=["recipe", "hf"])
def test_a_deeper_model_compiles_no_more_programs(mode, blocks, make, dim, extra):
    """Two programs a step per layer (its forward, its backward) and a few more, yet the same model twice
    as deep builds as many programs in step 1, and none after: its layers run one program. Each depth
    starts from an empty program table (the disk cache stays), so neither reuses the other's programs
    nor those of whatever ran before in this process (AdamW's state is made by a program per shape)."""
    built = []
    for layers in (3, 6):
        _fused._PROGRAMS.clear()  # noqa: SLF001
        ref = _train(make(dim, layers), "cpu")
        got = _train(make(dim, layers).to("tpu"), "tpu")
        _check_equal(ref, got)
        steps = got[0]
        assert [s[1] for s in steps[1:]] == [0, 0], steps  # step 2 on runs step 1's programs
        assert all(s[2] == 2 * layers + extra for s in steps), (layers, steps)
        built.append(steps[0][1])
    assert built[1] == built[0], built


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_blocks_with_chunks_and_without_grad(mode, blocks, monkeypatch):
    """Op-count chunks start counting again at each block's cut: every layer is cut alike, so step 2
    compiles nothing; a forward under no_grad is not cut."""
    monkeypatch.setenv("TPUDIST_FUSED_FORWARD_CHUNK", "7")
    monkeypatch.setenv("TPUDIST_FUSED_BACKWARD_CHUNK", "11")
    ref = _train(_recipe(40, 3), "cpu")
    model = _recipe(40, 3).to("tpu")
    got = _train(model, "tpu")
    _check_equal(ref, got)
    assert [s[1] for s in got[0][1:]] == [0, 0], got[0]
    assert got[0][0][2] > 2 * 3 + 4, got[0]  # more cuts than the blocks alone make
    syncs = torch.tpu.cache_stats()["syncs"]
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        out = model(x.to("tpu")).sum().item()
    assert torch.tpu.cache_stats()["syncs"] == syncs + 1
    assert out == pytest.approx(model.cpu()(x).sum().item(), rel=1e-5)


class _SyncsFirst(torch.nn.Module):
    """Reads a value to the host between its embedding and its layers (as Hugging Face's mask checks
    do): a sync point, not a cut, runs the embedding's graph, so the first layer's input is held flat."""

    def __init__(self, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 24)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(24), torch.nn.Linear(24, 24), torch.nn.GELU())
            for _ in range(layers))
        self.head = torch.nn.Linear(24, 64)

    def forward(self, x):
        h = self.embed(x)
        if bool(x.max() >= 64):  # the sync: it runs the embedding's graph too
            raise ValueError("token ids past the vocabulary")
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_first_layer_after_a_sync_runs_the_layers_programs(mode, blocks, monkeypatch):
    """The first layer's input, left flat by a sync, is put in its own shape at the layer's start: it runs
    the programs of the other layers (forward and backward), never a same-ops program of its own."""
    built = []
    compile_ = _fused._load_or_compile  # noqa: SLF001

    def spy(g, *args, **kwargs):
        built.append(tuple(kernel for kernel, _, _ in g.nodes))
        return compile_(g, *args, **kwargs)

    monkeypatch.setattr(_fused, "_load_or_compile", spy)
    _fused._PROGRAMS.clear()  # noqa: SLF001
    torch.manual_seed(0)
    ref = _SyncsFirst(3)
    got = _train(copy.deepcopy(ref).to("tpu"), "tpu")
    _check_equal(_train(ref, "cpu"), got)
    repeated = [ops for ops in set(built) if built.count(ops) > 1]
    assert not repeated, [len(ops) for ops in repeated]


def test_bad_value_raises(monkeypatch):
    monkeypatch.setenv("TPUDIST_FUSED_BLOCKS", "yes")
    with pytest.raises(ValueError, match="TPUDIST_FUSED_BLOCKS='yes' must be '1'"):
        _blocks.enabled()


def test_which_modules_are_blocks():
    """Two or more alike modules with submodules in a ModuleList or Sequential: a transformer's layers;
    not a Sequential's Linear layers (a program of one op each), nor layers of other shapes."""
    model = _recipe(16, 3)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    mixed = torch.nn.ModuleList([mlp, torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                          torch.nn.Linear(8, 4))])
    holder = torch.nn.Module()
    holder.mixed = mixed
    for m in (model, mlp, holder):
        _blocks._mark(m)  # noqa: SLF001 - as the forward pre-hook does for a module's first call
    assert all(layer in _blocks._blocks for layer in model.layers)  # noqa: SLF001
    assert not any(m in _blocks._blocks for m in (*mlp, *mixed, model.output))  # noqa: SLF001
    # lazy parameters have no shape yet: no block, and no error (the hook runs on every model's forward)
    lazy = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU()) for _ in range(2)))
    holder.lazy = lazy
    _blocks._mark(holder)  # noqa: SLF001
    assert not any(m in _blocks._blocks for m in lazy)  # noqa: SLF001

    class Unhashable(torch.nn.Module):  # an __eq__ without __hash__: the hooks pass it by
        def __eq__(self, other):
            return self is other

        def forward(self, x):
            return x + 1

    assert not _blocks._is_block(Unhashable())  # noqa: SLF001
