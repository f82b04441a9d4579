"""SDPA as one op on the device, and growing KV caches that compile per capacity, not per token.

Every value is compared with CPU eager; compile counts are asserted, never times.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.device import _attention, _grow, buckets

try:
    from transformers import LogitsProcessor, LogitsProcessorList
except ImportError:  # the Hugging Face tests skip
    LogitsProcessor = LogitsProcessorList = None

MODES = ("strict", "fused")
# compile counts per step: each test starts from empty caches, whatever ran before it in the process
pytestmark = pytest.mark.usefixtures("fresh_caches")


def _compiled() -> int:
    stats = torch.tpu.cache_stats()
    return stats["programs"] + stats["kernels"]


def _sdpa_and_grads(device, q, k, v, mask=None, **kw):
    leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
    mask = mask.to(device) if mask is not None else None
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, **kw)
    weight = torch.linspace(-1, 1, out.numel(), device=device).reshape(out.shape)
    (out * weight).sum().backward()
    return [t.detach().cpu() for t in (out, *(leaf.grad for leaf in leaves))]


CASES = [  # (batch, heads, kv heads, query length, key length, head dim), causal, mask, enable_gqa
    (shape, causal, mask, gqa)
    for shape, causal, mask, gqa in itertools.product(
        [(2, 4, 4, 3, 5, 8), (1, 4, 2, 1, 7, 16), (2, 2, 2, 6, 6, 4)], [False, True],
        [None, "bool", "float", "row_fully_masked"], [False, True])
    if (shape[1] == shape[2] or gqa) and not (causal and mask)
]


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_sdpa_runs_as_one_op_and_matches_cpu(mode):
    torch.manual_seed(0)
    before = dict(_attention.STATS)
    for (b, h, hk, lq, lk, e), causal, mask_kind, gqa in CASES:
        q, k, v = torch.randn(b, h, lq, e), torch.randn(b, hk, lk, e), torch.randn(b, hk, lk, e)
        mask = None
        if mask_kind in ("bool", "row_fully_masked"):
            mask = torch.rand(b, 1, lq, lk) > 0.3
            if mask_kind == "row_fully_masked":
                mask[:, :, 0] = False  # torch gives 0 for a row with nothing to attend to
        elif mask_kind == "float":
            mask = torch.randn(1, h, lq, lk)
        want = _sdpa_and_grads("cpu", q, k, v, mask, is_causal=causal, enable_gqa=gqa)
        got = _sdpa_and_grads("tpu", q, k, v, mask, is_causal=causal, enable_gqa=gqa)
        for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-6, msg=f"{name} {(b, h, hk, lq, lk, e)} {causal} "
                                                                      f"{mask_kind} {gqa}")
    assert _attention.STATS["fused"] - before["fused"] == len(CASES)
    assert _attention.STATS["math"] == before["math"]


def test_sdpa_bf16_matches_cpu():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 16, dtype=torch.bfloat16) for _ in range(3))
    want = _sdpa_and_grads("cpu", q, k, v, is_causal=True)
    got = _sdpa_and_grads("tpu", q, k, v, is_causal=True)
    for w, g in zip(want, got):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_sdpa_takes_torch_math_path_where_the_fused_op_does_not_apply():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    # a mask that needs a gradient (a learned bias): torch's MATH decomposition, its gradient included
    bias = torch.randn(1, 3, 4, 4)
    grads = {}
    for device in ("cpu", "tpu"):
        leaf = bias.to(device).detach().requires_grad_()
        math_before = _attention.STATS["math"]
        F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), attn_mask=leaf).pow(2).sum().backward()
        grads[device] = leaf.grad.cpu()
    assert _attention.STATS["math"] == math_before + 1
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=1e-5, atol=1e-6)
    # 3-d inputs and dropout: MATH too (dropout's mask must be replayed by autograd, as torch does)
    math_before = _attention.STATS["math"]
    keep = torch.rand(3, 4, 4) > 0.4  # a bool mask on the MATH path masks (it is not added as 1.0/0.0)
    out = F.scaled_dot_product_attention(q[0].to("tpu"), k[0].to("tpu"), v[0].to("tpu"), attn_mask=keep.to("tpu"))
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q[0], k[0], v[0], attn_mask=keep),
                               rtol=1e-5, atol=1e-6)
    dropped = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), dropout_p=0.5)
    assert torch.isfinite(dropped.cpu()).all()
    assert _attention.STATS["math"] == math_before + 2
    # traced by torch.compile (FakeTensors: the MATH path), a bool mask still masks
    compiled = torch.compile(lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3]), backend="tpu")
    keep4 = torch.rand(2, 1, 4, 4) > 0.4
    torch.testing.assert_close(compiled(q.to("tpu"), k.to("tpu"), v.to("tpu"), keep4.to("tpu")).cpu(),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=keep4), rtol=1e-5, atol=1e-6)
    # sdpa_kernel(MATH) is honoured, and with it a double backward works as on CPU
    grads = {}
    for device in ("cpu", "tpu"):
        qd = q.to(device).detach().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(qd, k.to(device), v.to(device))
        (g,) = torch.autograd.grad(out.pow(2).sum(), qd, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), qd)
        grads[device] = gg.cpu()
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=1e-4, atol=1e-5)
    # the fused op's double backward (a gradient penalty) equals CPU's MATH one (CPU's flash kernel has
    # no double backward)
    grads = {}
    for device in ("cpu", "tpu"):
        qd, kd = q.to(device).detach().requires_grad_(), k.to(device).detach().requires_grad_()
        fused_before = _attention.STATS["fused"]
        with sdpa_kernel(SDPBackend.MATH) if device == "cpu" else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(qd, kd, v.to(device), is_causal=True)
        g = torch.autograd.grad(out.pow(2).sum(), (qd, kd), create_graph=True)
        grads[device] = [t.cpu() for t in torch.autograd.grad(g[0].pow(2).sum() + g[1].sum(), (qd, kd))]
    assert _attention.STATS["fused"] == fused_before + 1  # the tpu pass (the CPU one counts nothing)
    for got, want in zip(grads["tpu"], grads["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _repeat_kv(x, times):
    """transformers 5.17's ``repeat_kv``: each kv head expanded ``times`` and reshaped into the query heads."""
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, times, n, d).reshape(b, h * times, n, d)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("chunk,gqa", [(1, "enable_gqa"), (2, "enable_gqa"), (1, "repeat_kv")],
                         ids=["token", "chunk_of_2", "token_repeat_kv"])
def test_growing_kv_cache_compiles_per_capacity(mode, chunk, gqa):
    """A hand-written dynamic cache: ``cat`` new keys/values at dim 2, attend over all of them (grouped
    query heads by SDPA's ``enable_gqa``, or by an expand and reshape of the cache, a copy of it each step)."""
    previous = buckets.set_growth(buckets.Growth(multiple=8, max_buckets=2, per_octave=2))
    try:
        torch.manual_seed(3 + chunk)
        steps = 14
        new_k = torch.randn(steps, 2, 2, chunk, 8)
        new_v = torch.randn(steps, 2, 2, chunk, 8)
        queries = torch.randn(steps, 2, 4, chunk, 8)
        caches = {"cpu": [torch.randn(2, 2, 3, 8)] * 2}
        caches["tpu"] = [t.to("tpu") for t in caches["cpu"]]
        compiled, outs = [], {"cpu": [], "tpu": []}
        for step in range(steps):
            before = _compiled()
            for device, (k, v) in caches.items():
                k = torch.cat([k, new_k[step].to(device)], dim=2)
                v = torch.cat([v, new_v[step].to(device)], dim=2)
                caches[device] = [k, v]
                if gqa == "repeat_kv":
                    out = F.scaled_dot_product_attention(queries[step].to(device), _repeat_kv(k, 2), _repeat_kv(v, 2),
                                                         is_causal=chunk > 1)
                else:
                    out = F.scaled_dot_product_attention(queries[step].to(device), k, v, is_causal=chunk > 1,
                                                         enable_gqa=True)
                outs[device].append(out.cpu())
            compiled.append(_compiled() - before)
    finally:
        buckets.set_growth(previous)
    k, v = caches["tpu"]
    assert k.shape == (2, 2, 3 + steps * chunk, 8)
    torch.testing.assert_close(k.cpu(), caches["cpu"][0], rtol=0, atol=0)
    torch.testing.assert_close(v.cpu(), caches["cpu"][1], rtol=0, atol=0)
    for step, (want, got) in enumerate(zip(outs["cpu"], outs["tpu"])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    # lengths 3 + chunk * (step + 1); capacities 8, 16, then 24, 32. Past the first appends (an ordinary
    # cat, then the first into a capacity) only a step that reaches a new capacity compiles
    lengths = [3 + chunk * (s + 1) for s in range(steps)]
    new_capacity = {s for s in range(1, steps) if buckets.Growth(8, 2, 2).capacity_for(lengths[s])
                    != buckets.Growth(8, 2, 2).capacity_for(lengths[s - 1])}
    allowed = new_capacity | {s + 1 for s in new_capacity}
    if gqa == "repeat_kv":  # the copy of a cache filled to its capacity runs exact (ops at the capacity
        # cannot tell its grown dim from the others then): a length equal to a capacity compiles once more
        allowed |= {s for s in range(steps) if lengths[s] == buckets.Growth(8, 2, 2).capacity_for(lengths[s])}
    assert {s for s, n in enumerate(compiled) if n and s >= 3} <= allowed, compiled


@pytest.fixture(scope="module")
def hf_llama():
    pytest.importorskip("transformers", reason="Hugging Face generate needs transformers (optional extra)")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_hf_default_dynamic_cache_generate_compiles_once(mode, hf_llama):
    model = copy.deepcopy(hf_llama)
    torch.manual_seed(1)
    prompts = {1: torch.randint(1, 64, (1, 5)), 2: torch.randint(1, 64, (2, 5))}
    kwargs = dict(do_sample=False, pad_token_id=0)
    reference = {b: model.generate(p, max_new_tokens=24, min_new_tokens=24, **kwargs) for b, p in prompts.items()}
    model.to("tpu")
    for batch, prompt in prompts.items():
        short = model.generate(prompt.to("tpu"), max_new_tokens=6, min_new_tokens=6, **kwargs)
        assert torch.equal(short.cpu(), reference[batch][:, :11])
        before = _compiled()
        tokens = model.generate(prompt.to("tpu"), max_new_tokens=24, min_new_tokens=24, **kwargs)
        assert torch.equal(tokens.cpu(), reference[batch])
        assert _compiled() == before, f"batch {batch}: 24 new tokens compiled what 6 did not"


class _CompiledPerStep(LogitsProcessor if LogitsProcessor is not None else object):
    """Records the device's compile count at every decoding step (a logits processor runs once per step)."""

    def __init__(self):
        self.counts = []

    def __call__(self, ids, scores):
        self.counts.append(_compiled())
        return scores


def _padded_prompts():
    """Three prompts of lengths 7, 5 and 3, left-padded to 7 (HF's layout for batched generation)."""
    torch.manual_seed(2)
    ids = torch.randint(1, 64, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    for row, pad in ((1, 2), (2, 4)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


SEARCHES = {"greedy": dict(do_sample=False), "beams": dict(do_sample=False, num_beams=3)}


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_hf_padded_batch_and_beam_search_compile_per_capacity(mode, search, hf_llama):
    """Left padding makes HF build an attention mask per step (``arange`` of the key length, compared
    and combined with the grown 2-d mask, then indexed); beam search reorders the grown cache with
    ``index_select`` every step. Both run at the capacity: tokens equal CPU eager, and a generation
    twice as long compiles nothing the shorter one did not (before: a few kernels per new length)."""
    model = copy.deepcopy(hf_llama)
    ids, mask = _padded_prompts()
    kwargs = dict(SEARCHES[search], pad_token_id=0)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=14, min_new_tokens=14, **kwargs)
    model.to("tpu")
    on_device = dict(kwargs, attention_mask=mask.to("tpu"))
    short = model.generate(ids.to("tpu"), max_new_tokens=6, min_new_tokens=6, **on_device)
    if search == "greedy":  # beam search's best beams after 6 tokens need not be a prefix of those after 14
        assert torch.equal(short.cpu(), reference[:, :13])
    steps = _CompiledPerStep()
    tokens = model.generate(ids.to("tpu"), max_new_tokens=14, min_new_tokens=14,
                            logits_processor=LogitsProcessorList([steps]), **on_device)
    assert torch.equal(tokens.cpu(), reference)
    per_step = [b - a for a, b in zip(steps.counts, steps.counts[1:])]
    assert per_step[5:] == [0] * len(per_step[5:]), per_step


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_variable_length_batches_stay_contiguous_like_cpu(mode):
    """Training-style code whose lengths change from batch to batch (a suffix token cat onto fresh token
    ids, a (b, h, n, d) cat, a length mask from arange(n)) is not a sequence being appended to: its
    results stay contiguous exact tensors, so ``.view()`` works as on CPU. Before, the third length
    turned them into strided views of a capacity and ``.view(-1)`` raised torch's stride error."""
    for n in (5, 7, 9, 12):
        got = {}
        for device in ("cpu", "tpu"):
            tokens = (torch.arange(2 * n, device=device).view(2, n) % 7)
            eos = torch.full((2, 1), 9, device=device)
            ids = torch.cat([tokens, eos], dim=1)
            kv = torch.cat([torch.ones(2, 3, n, 4, device=device), torch.zeros(2, 3, 1, 4, device=device)], dim=2)
            lengths = torch.tensor([n, n - 2], device=device)
            mask = torch.arange(n, device=device)[None, :] < lengths[:, None]
            got[device] = [(x.is_contiguous(), x.view(-1).cpu()) for x in (ids, kv, mask, mask.float() * 2)]
        for (c_cpu, v_cpu), (c_tpu, v_tpu) in zip(got["cpu"], got["tpu"]):
            assert c_tpu == c_cpu, n
            torch.testing.assert_close(v_tpu, v_cpu)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_garbage_of_a_finished_generation_grows_no_arange(mode):
    """A grown tensor left in a reference cycle (a finished generation's cache, not yet collected) is no
    decoding in progress: a training-style arange(n) whose n changes stays exact and contiguous, as on
    CPU. Before, the mask made from it became a strided view of a capacity and ``.view(-1)`` raised."""
    import gc

    ids = torch.tensor([[5, 1, 4]], device="tpu")
    for step in range(4):  # a flat append seen at a second length grows into a capacity
        ids = torch.cat([ids, torch.full((1, 1), step, device="tpu")], dim=-1)
    assert _grow.buffer_of(ids) in _grow.CAPACITY, "the appends grew nothing: nothing to test"
    cycle = [ids]
    cycle.append(cycle)
    del ids, cycle
    gc.disable()  # the cycle stays until a collection: none may run by chance before the aranges
    try:
        for n in (6, 8, 10):
            lengths = torch.tensor([n, n - 2], device="tpu")
            mask = torch.arange(n, device="tpu")[None, :] < lengths[:, None]
            want = torch.arange(n)[None, :] < torch.tensor([n, n - 2])[:, None]
            assert mask.is_contiguous(), (n, mask.stride())
            assert torch.equal(mask.view(-1).cpu(), want.view(-1))
    finally:
        gc.enable()


# (pad, value) of a grown (1, n) mask: to a fixed width past and within the capacity (8, 16, 24, 32 here)
# and a width that cuts, on the right (one kernel per width and capacity); on the left (exact: positions move)
_MASK_PADS = {"to_40": ((0, 40), False), "to_20_true": ((0, 20), True), "cut_to_6": ((0, 6), True),
              "left": ((3, 0), False)}


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype,scale", [(torch.bool, 1), (torch.int64, 7), (torch.float32, -1.5)],
                         ids=["bool", "int64", "float32"])
def test_grown_mask_padded_to_a_fixed_width_compiles_per_capacity(mode, dtype, scale):
    """transformers 5.17's ``prepare_padding_mask`` pads the 2-D attention mask, which grows a token at a
    time, to the static cache's length: ``F.pad(mask, (0, width - n))`` with ``n`` new every token. It
    compiled a kernel (a Fused program) per token; now one per width and capacity, with CPU's values."""
    previous = buckets.set_growth(buckets.Growth(multiple=8, max_buckets=2, per_octave=2))
    try:
        masks = {device: torch.ones(1, 3, dtype=dtype, device=device) * scale for device in ("cpu", "tpu")}
        compiled = []
        # what a new length builds, programs and kernels apart: in Fused mode an op's new kernel is traced
        # into a new program (a kernel and a program), unless Strict, run first in the file, built the kernel
        def built() -> tuple[int, int]:
            stats = torch.tpu.cache_stats()
            return stats["programs"], stats["kernels"]

        for step in range(14):
            before = built()
            got = {}
            for device in ("cpu", "tpu"):
                new = torch.full((1, 1), step % 2, dtype=dtype, device=device) * scale
                masks[device] = torch.cat([masks[device], new], dim=1)
                n = masks[device].shape[1]
                got[device] = []
                for name, (pad, value) in _MASK_PADS.items():
                    width_pad = (pad[0], pad[1] - n) if name != "left" else pad
                    out = F.pad(masks[device], width_pad, value=value)
                    got[device].append(out.cpu())
            for name, want, have in zip(_MASK_PADS, got["cpu"], got["tpu"]):
                assert have.shape == want.shape and torch.equal(have, want), (step, name)
            compiled.append(tuple(now - then for now, then in zip(built(), before)))
    finally:
        buckets.set_growth(previous)
    # lengths 4 + step: capacity 8 up to 8, then 16 from step 5 (length 9), 24 from step 13. Steps 8 to 11
    # (lengths 12 to 15) stay in capacity 16 past its first appends: only the left pad compiles (exact,
    # a kernel and in Fused mode its program per length); the three right pads compiled one each per length
    # before. (programs, kernels) per step:
    assert all(programs <= 1 and kernels <= 1 for programs, kernels in compiled[8:12]), str(compiled)
