"""Decoding compiles once: ints that change per step become inputs, growing token ids get bucketed storage.

Counts, not times: the programs (Fused) and kernels (Strict) compiled per step, against CPU eager values.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.device import _fused, buckets

GENERATE = Path(__file__).resolve().parents[2] / "recipes" / "generate.py"
MODES = ("strict", "fused")
# compile counts per step: each test starts from empty caches, whatever ran before it in the process
pytestmark = pytest.mark.usefixtures("fresh_caches")
WIDTH = {"strict": 3, "fused": 4}  # kernels are shared by the modes: each test's shapes are its own


@pytest.fixture
def dynamic_off():
    previous = tpudist.device.set_dynamic_scalars(False)
    yield
    tpudist.device.set_dynamic_scalars(previous)


def _compiled() -> int:
    stats = torch.tpu.cache_stats()
    return stats["programs"] + stats["kernels"]


def _cached_steps(device, length: int, steps: int, width: int):
    """A hand-written static cache: write at a moving position, read the slot back, mask by position."""
    cache = torch.zeros(2, length, width, device=device)
    positions = torch.arange(length, device=device)
    outs, compiled = [], []
    for pos in range(steps):
        before = _compiled() if device == "tpu" else 0
        cache[:, pos:pos + 1] = torch.full((2, 1, width), float(pos + 1), device=device)
        seen = cache.masked_fill(~positions.le(pos)[None, :, None], 0).sum(1) + pos  # int Scalar, int wrapped
        # a view at a moving offset; a wrapped int and a 0-dim CPU int on 0-d tensors. Their sites (0-d
        # float32 times an int) are every test's: the first value seen at a site stays a constant kernel,
        # so ints another test of the process used (y * 3) would pick it at that step. Hence 1000 + pos.
        slot = cache[:, pos].sum() * (1000 + pos) + torch.tensor(1000 + pos)
        outs.append((seen.cpu(), slot.cpu()))
        compiled.append(_compiled() - before if device == "tpu" else 0)
    return outs, cache.cpu(), compiled


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_ints_that_change_per_step_become_inputs(mode):
    ref, ref_cache, _ = _cached_steps("cpu", 19, 8, WIDTH[mode])
    dynamic_before = torch.tpu.cache_stats().get("dynamic_ints", 0)
    got, cache, compiled = _cached_steps("tpu", 19, 8, WIDTH[mode])
    for (a, b), (c, d) in zip(got, ref):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, d, rtol=0, atol=0)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    assert compiled[0] > 0 and compiled[1] > 0  # the first value is a constant, the second generalises
    assert compiled[2:] == [0] * 6, compiled
    assert torch.tpu.cache_stats()["dynamic_ints"] > dynamic_before


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_without_dynamic_ints_every_step_compiles(mode, dynamic_off):
    ref, _, _ = _cached_steps("cpu", 17, 6, WIDTH[mode])
    got, _, compiled = _cached_steps("tpu", 17, 6, WIDTH[mode])
    assert [a.tolist() for a, _ in got] == [c.tolist() for c, _ in ref]
    assert all(n > 0 for n in compiled), compiled


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_an_int_that_decides_a_shape_stays_a_constant(mode):
    refused = torch.tpu.cache_stats().get("dynamic_ints_refused", 0)
    width, dtype = WIDTH[mode], torch.int64 if mode == "strict" else torch.int32
    for n in (3, 5, 6, 7):
        got = (torch.eye(n, device="tpu", dtype=dtype) * width + n).cpu()
        assert got.tolist() == (torch.eye(n, dtype=dtype) * width + n).tolist()
        # an arange whose end changes at one place grows into a capacity instead (test_device_growing_cache)
        got = (torch.arange(n, device="tpu", dtype=dtype) * width + n).cpu()
        assert got.tolist() == (torch.arange(n, dtype=dtype) * width + n).tolist()
        full = torch.full((n, width), n, device="tpu", dtype=dtype).cpu()
        assert full.tolist() == torch.full((n, width), n, dtype=dtype).tolist()
    assert torch.tpu.cache_stats()["dynamic_ints_refused"] > refused


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_the_halves_of_rotate_half_stay_constants(mode):
    """Hugging Face Llama's rotate_half reads x[..., 32:] and x[..., :32], and its backward writes each half
    into zeros through one site (copy_ into a view): offsets 0 and 32 there. A column among a few of its row
    (views.few_columns) stays a constant, as a phase does: as a runtime input its write was a dynamic slice
    and update of the whole flat storage. Gradients equal CPU's."""
    dynamic_before = torch.tpu.cache_stats().get("dynamic_ints", 0)
    g = torch.Generator().manual_seed(0)
    width = 2 * WIDTH[mode] * 8  # a head dim of its own per mode (kernels are shared by the modes)
    compiled = []
    for _ in range(3):
        x_cpu, c = torch.randn(2, 3, 5, width, generator=g), torch.randn(5, width, generator=g)
        grads = []
        for device in ("cpu", "tpu"):
            x = x_cpu.to(device).detach().requires_grad_()
            before = _compiled() if device == "tpu" else 0
            (x * c.to(device) + _rotate_half(x) * c.to(device)).sum().backward()
            grads.append(x.grad.cpu())
            if device == "tpu":
                compiled.append(_compiled() - before)
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert torch.tpu.cache_stats().get("dynamic_ints", 0) == dynamic_before
    assert compiled[1:] == [0, 0], compiled


@pytest.mark.parametrize("batch", (1, 2))
@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_growing_token_ids_compile_per_capacity_not_per_token(mode, batch):
    """With a batch of 2, the last column is an offset below the batch dim's stride (the capacity): a
    position, not a phase of an interleaving (views.phase), so it becomes a runtime input too."""
    previous = buckets.set_growth(buckets.Growth(multiple=8, max_buckets=2, per_octave=2))
    try:
        rows = [[5, 1, 4], [2, 7, 3]][:batch]
        ids_cpu = torch.tensor(rows, dtype=torch.int64 if mode == "strict" else torch.int32)
        ids = ids_cpu.to("tpu")
        compiled, lasts = [], []
        for step in range(30):
            before = _compiled()
            token = (ids[:, -1:] * 7 + step) % 11  # reads the last token: a view at a moving offset
            ids = torch.cat([ids, token], dim=-1)
            lasts.append(ids[:, -1].cpu())
            compiled.append(_compiled() - before)
            ids_cpu = torch.cat([ids_cpu, (ids_cpu[:, -1:] * 7 + step) % 11], dim=-1)
    finally:
        buckets.set_growth(previous)
    assert ids.shape == (batch, 33)
    assert ids.stride() == (48, 1)  # rows of a sequence grown into capacity 48
    assert torch.equal(ids.cpu(), ids_cpu)
    assert torch.equal(torch.stack(lasts, dim=1), ids_cpu[:, 3:])
    # capacities 8, 16 (multiples of 8 up to 2 buckets), then 2 per power of two: 24, 32, 48. After the
    # first steps (a constant, then runtime offsets, then the padded storage) only the step that moves
    # to a new capacity and the next (the first append within it) compile
    new_capacity = [step for step in range(30) if 3 + step + 1 in (9, 17, 25, 33)]
    # With a batch of 2 the last column's row stride is the capacity, so its site in a new capacity does
    # not inherit the runtime offset (_core._hint_of keeps strides): a constant first, then generalised
    after = (0, 1) if batch == 1 else (0, 1, 2)
    allowed = {step + k for step in new_capacity for k in after}
    assert {i for i, n in enumerate(compiled) if n and i >= 4} <= allowed, compiled


def test_growth_capacities():
    rule = buckets.Growth()
    assert [rule.capacity_for(n) for n in (1, 128, 129, 1024, 1025, 1536, 1537, 2049)] == [
        128, 128, 256, 1024, 1280, 1536, 1792, 2560]
    with pytest.raises(ValueError, match="multiple=0"):
        buckets.Growth(multiple=0)
    with pytest.raises(TypeError, match="Growth"):
        buckets.set_growth(128)


def _generate_module():
    return runpy.run_path(str(GENERATE), run_name="generate_recipe")


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_project_model_static_cache_decodes_with_one_program(mode):
    gen = _generate_module()
    torch.manual_seed(0)
    args = gen["ModelArgs"](vocab_size=96, dim=32 if mode == "strict" else 48, n_layers=2, n_heads=4, n_kv_heads=2,
                            max_seq_len=24)
    model = gen["Transformer"](args).eval()
    prompt = torch.randint(0, args.vocab_size, (1, 6))
    reference = gen["generate"](model, prompt, 12, max_len=24).tokens
    no_cache = prompt  # the model without a cache, recomputing the whole sequence per token
    for _ in range(12):
        no_cache = torch.cat([no_cache, model(no_cache)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(reference, no_cache[:, 6:])
    model.to("tpu")
    first = gen["generate"](model, prompt, 12, max_len=24)
    assert torch.equal(first.tokens, reference)
    # prefill, the first decode step (constants), the second (its ints become inputs), then nothing
    assert first.compiled_per_step[3:] == [0] * 9, first.compiled_per_step
    second = gen["generate"](model, prompt, 8, max_len=24)
    assert torch.equal(second.tokens, reference[:, :8])
    assert sum(second.compiled_per_step) == 0, second.compiled_per_step


@pytest.mark.parametrize("compile_forward", [False, True], ids=["eager_forward", "compiled_forward"])
@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_hf_static_cache_generate_compiles_once(mode, compile_forward):
    pytest.importorskip("transformers", reason="Hugging Face generate needs transformers (optional extra)")
    if compile_forward and mode == "strict":
        pytest.skip("the compiled forward is one program whatever the eager mode: covered once, in fused")
    gen = _generate_module()
    torch.manual_seed(0)
    model = gen["_hf_model"]()
    prompt = torch.randint(0, 128, (1, 5))
    reference = gen["hf_generate"](model, prompt, 10)[0]
    model.to("tpu")
    short, _, _ = gen["hf_generate"](model, prompt, 6, compile_forward=compile_forward)
    assert torch.equal(short, reference[:, :6])
    tokens, _, compiled = gen["hf_generate"](model, prompt, 10, compile_forward=compile_forward)
    assert torch.equal(tokens, reference)
    assert compiled == 0  # 10 new tokens compile nothing that 6 did not


def test_reading_a_view_that_moves_along_its_storage_compiles_one_reader():
    """``.cpu()`` / ``.item()`` of ``ids[:, i]`` for every i (a streaming decoder reading its newest
    token): the view's offset is an argument of the reader, not a new program per position."""
    x = torch.arange(2 * 40, dtype=torch.int64).reshape(2, 40)
    d = x.to("tpu")
    before = torch.tpu.cache_stats()["readers"]
    for i in range(40):
        assert torch.equal(d[:, i].cpu(), x[:, i]) and d[0, i].item() == i
        assert torch.equal(d[:, i:i + 1].cpu(), x[:, i:i + 1])
    assert torch.tpu.cache_stats()["readers"] - before <= 3  # d[:, i], d[0, i], d[:, i:i+1]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("batch", (1, 2), ids=["batch1", "padded_batch2"])
@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_hf_static_cache_generate_first_call_compiles_few_programs(mode, batch, monkeypatch):
    """Issue #56: 24 greedy tokens with HF's static cache, op by op in Fused mode. The first call builds at
    most 16 XLA programs (fused programs and readers; every XLA compile counted, whatever asked for it).
    Three of them run the model: the prefill, the first decode step (exact token ids) and one program for
    every later step, the last included (a view at a moving offset into the grown token ids is a runtime
    input from its first value, and so is HF's stopping flag, a Python bool: each a constant first would
    cost a program more); none is cut into parts for the cache's per-layer counters (_parts: two programs more, three launches
    a step). The third call compiles nothing. Tokens equal CPU's."""
    pytest.importorskip("transformers", reason="Hugging Face generate needs transformers (optional extra)")
    import jax._src.compiler as jax_compiler

    compiles, original = [], jax_compiler.compile_or_get_cached

    def counted(*args, **kwargs):
        compiles.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax_compiler, "compile_or_get_cached", counted)
    forwards, compile_ = [], _fused._load_or_compile  # noqa: SLF001

    def counting(g, *args, **kwargs):
        if any(kernel.op == torch.ops.aten.mm.default for kernel, _, _ in g.nodes):  # a program running the model
            forwards.append(len(g.nodes))
        return compile_(g, *args, **kwargs)

    monkeypatch.setattr(_fused, "_load_or_compile", counting)
    torch.manual_seed(0)
    model = _tiny_llama()
    prompt = torch.randint(1, 128, (batch, 8))
    mask = torch.ones_like(prompt)
    if batch == 2:  # left padding: HF builds the padding mask every step
        prompt[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                  cache_implementation="static", max_cache_len=64, disable_compile=True)
    reference = model.generate(prompt, attention_mask=mask, **kwargs)
    model.to("tpu")
    built, parted = [], torch.tpu.cache_stats().get("parted_graphs", 0)
    for _ in range(3):
        stats, num_compiles = torch.tpu.cache_stats(), len(compiles)
        out = model.generate(prompt.to("tpu"), attention_mask=mask.to("tpu"), **kwargs).cpu()
        assert torch.equal(out, reference)
        after = torch.tpu.cache_stats()
        built.append((after["programs"] + after["readers"] - stats["programs"] - stats["readers"],
                      len(compiles) - num_compiles))
    programs, xla = built[0]
    assert 0 < programs <= 16 and xla <= 16, built
    assert len(forwards) == 3 and torch.tpu.cache_stats().get("parted_graphs", 0) == parted, (forwards, built)
    assert built[2] == (0, 0), built


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_python_bools_are_runtime_inputs_and_never_ints(mode):
    """A Python bool for a number is a runtime input from its first value (HF's stopping flag
    ``torch.full((b,), is_done)`` flips at the last step), and its kernel is never an int's: ``True == 1``
    in Python, but ``torch.full((2,), True)`` is bool and ``torch.full((2,), 1)`` int64 (the device once
    gave the second the first's kernel). Values and dtypes equal CPU's, both orders of both values."""
    x_cpu = torch.tensor([[True, False, True]])
    i_cpu = torch.tensor([[3, -2, 0]])
    f_cpu = torch.tensor([[1.5, -2.0, 0.25]])

    def run(device, flags):
        x, i, f = x_cpu.to(device), i_cpu.to(device), f_cpu.to(device)
        outs = []
        for flag in flags:
            outs += [torch.full((2,), flag, device=device), torch.full((2,), int(flag), device=device),
                     torch.full((2,), flag, device=device, dtype=torch.bool), x | flag, x.masked_fill(~x, flag),
                     i + flag, f * flag, torch.where(x, f, flag), x == flag]
        return [t.cpu() for t in outs]

    compiled = []
    for flags in ((True, False, True), (False, True, False)):
        before = _compiled()
        got, ref = run("tpu", flags), run("cpu", flags)
        compiled.append(_compiled() - before)
        for g, r in zip(got, ref, strict=True):
            assert g.dtype == r.dtype and torch.equal(g, r), (flags, g, r)
    assert compiled[1] == 0, compiled  # the other order of the same values: the same kernels
