"""Dynamic sizes in torch.compile(backend="tpu"): one static program per bucket where padding is safe,
one per size (counted as such) where it is not; results and gradients equal CPU eager either way."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import probe_ops  # noqa: F401 - defines torch.ops.tpudist_test.mystery, which has no lowering
from tpudist.compile import dynamic
from tpudist.compile.program import STATS
from tpudist.device.buckets import Buckets
from tpudist.testing import RankPool


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # noqa: SLF001
    yield
    torch._dynamo.reset()  # noqa: SLF001


class Counts:
    """Deltas of the backend's counters over a block."""

    def __enter__(self):
        self._dynamic = dynamic.STATS.snapshot()
        self._fallbacks = len(dynamic.STATS.fallbacks)
        self._graphs = STATS.graphs
        return self

    def __exit__(self, *exc):
        now = dynamic.STATS.snapshot()
        self.padded = now["padded_programs"] - self._dynamic["padded_programs"]
        self.exact = now["exact_programs"] - self._dynamic["exact_programs"]
        self.xla_graphs = STATS.graphs - self._graphs
        self.fallbacks = dynamic.STATS.fallbacks[self._fallbacks:]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _check_step(compiled, eager_fn, model, ref, *inputs, tol=1e-5):
    """Forward and parameter gradients of the compiled step equal eager's."""
    got = compiled(model, *inputs)
    want = eager_fn(ref, *inputs)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    got.backward()
    want.backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
        p.grad = r.grad = None


def _mlp_loss(model, x):
    return model(x).square().mean()  # a mean over the dynamic batch dim: divided by the real count


def test_mlp_batch_one_program_per_bucket():
    model = _mlp()
    ref = copy.deepcopy(model)
    step = torch.compile(_mlp_loss, backend="tpu", dynamic=True)
    with Counts() as first:
        for n in (3, 5, 7, 11, 16, 31, 64, 100, 127, 128):  # ten sizes in the first bucket (128)
            _check_step(step, _mlp_loss, model, ref, torch.randn(n, 8))
    assert (first.padded, first.exact, first.xla_graphs) == (1, 0, 2), vars(first)  # forward + backward
    with Counts() as second:
        for n in (129, 200, 3):  # the second bucket (256), then the first again
            _check_step(step, _mlp_loss, model, ref, torch.randn(n, 8))
    assert (second.padded, second.exact) == (1, 0), vars(second)
    assert not first.fallbacks and not second.fallbacks


def test_mlp_inference_with_custom_buckets():
    model = _mlp()
    buckets = Buckets(max_length=64, multiple=16)
    fn = torch.compile(lambda x: model(x).softmax(-1), backend="tpu", dynamic=True, options={"buckets": buckets})
    sizes = (2, 5, 16, 17, 30, 33, 48, 64, 70, 90)
    with torch.no_grad(), Counts() as counts:
        for n in sizes:
            x = torch.randn(n, 8)
            torch.testing.assert_close(fn(x), model(x).softmax(-1), rtol=1e-5, atol=1e-5)
    in_range = {buckets.size_for(n) for n in sizes if n <= buckets.max_length}
    assert counts.padded == len(in_range) == 4, vars(counts)  # 16, 32, 48, 64
    assert counts.exact == 2, vars(counts)  # 70 and 90: beyond max_length, at their own size


def _reductions(x, w):
    """Reductions over the dynamic dim that padding handles: sum, mean, softmax, amax, cumsum."""
    h = x * w
    centred = h - h.mean(0, keepdim=True)
    return (centred.softmax(0) * h).sum() + h.amax(0).sum() + h.cumsum(0)[:, :2].mean() + h.logsumexp(0).sum()


def _equals_eager(fn, eager, inputs) -> None:
    """``fn(x, w)`` against ``eager(x, w)`` for each ``x`` of ``inputs`` (drawn after ``w``): values and
    ``w``'s gradient."""
    w = torch.randn(6, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    for x in inputs:
        got, want = fn(x, w), eager(x, w_ref)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.backward()
        want.backward()
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
        w.grad = w_ref.grad = None


def test_reductions_over_the_padded_dim_are_masked():
    fn = torch.compile(_reductions, backend="tpu", dynamic=True)
    with Counts() as counts:
        # all negative: a zero at the padding would win amax
        _equals_eager(fn, _reductions, (-torch.rand(n, 6) - 1 for n in (3, 9, 20)))
    assert (counts.padded, counts.exact) == (1, 0), (vars(counts), counts.fallbacks)


def _detached_scale(x, w):
    h = x * w
    return (h * h.detach().square().mean(1, keepdim=True)).sum()  # the scale is a constant for autograd


def _dynamic_rows(n: int) -> torch.Tensor:
    x = torch.randn(n, 6)
    torch._dynamo.mark_dynamic(x, 0)  # noqa: SLF001
    return x


def test_detach_in_a_padded_graph_stops_its_gradient():
    fn = torch.compile(_detached_scale, backend="tpu")
    with Counts() as counts:
        _equals_eager(fn, _detached_scale, (_dynamic_rows(n) for n in (3, 5)))
    assert (counts.padded, counts.exact) == (1, 0), (vars(counts), counts.fallbacks)


# Graphs that must not be padded: each runs one program per size, counted, and still equals eager.
_UNSAFE = {
    "variance over the dynamic dim": (lambda x, w: (x * w).var(0).sum(), "var"),
    "max over the dynamic dim": (lambda x, w: (x * w).max(0).values.sum(), "max"),
    "size used as a value": (lambda x, w: (x * w).sum(0).sum() / x.size(0), "used as a value"),
    "last row": (lambda x, w: (x * w)[-1].sum(), "select"),
    "flattened output": (lambda x, w: (x * w).flatten(), "merged"),
    "division by the padded values": (lambda x, w: (w / (x + 1)).sum(), "broadcasts"),
}


@pytest.mark.parametrize("name", list(_UNSAFE))
def test_unsafe_graphs_run_per_size(name):
    fn, reason = _UNSAFE[name]
    w = torch.randn(6, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    compiled = torch.compile(fn, backend="tpu")
    with Counts() as counts:
        for n in (3, 5, 8):
            x = torch.randn(n, 6)
            torch._dynamo.mark_dynamic(x, 0)  # noqa: SLF001 - only the batch dim (dynamic=True: w's too)
            got, want = compiled(x, w), fn(x, w_ref)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            (got.sum() if got.dim() else got).backward()
            (want.sum() if want.dim() else want).backward()
            torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
            w.grad = w_ref.grad = None
    assert (counts.padded, counts.exact) == (0, 3), vars(counts)
    assert counts.fallbacks and any(reason in why for _, _, why in counts.fallbacks), counts.fallbacks


def test_no_buckets_means_one_program_per_size():
    # LayerNorm's eps: under dynamic=True, Dynamo passes float attributes as 0-d tensors read with .item()
    model = torch.nn.Sequential(_mlp(), torch.nn.LayerNorm(4))
    fn = torch.compile(lambda x: model(x), backend="tpu", dynamic=True, options={"buckets": None})
    with torch.no_grad(), Counts() as counts:
        for n in (3, 4, 3, 6):
            x = torch.randn(n, 8)
            torch.testing.assert_close(fn(x), model(x), rtol=1e-5, atol=1e-5)
    assert (counts.padded, counts.exact) == (0, 3), vars(counts)


def test_bad_buckets_option():
    import tpudist.compile as tc

    with pytest.raises(TypeError, match="Buckets"):
        tc.backend(None, [], options={"buckets": 128})


def _with_mystery(x):
    return torch.ops.tpudist_test.mystery(x.sin()).cos().sum(0)


def test_graph_break_option_on_a_dynamic_graph():
    """An op without a lowering (not known row-independent either): per size, split around the op."""
    fn = torch.compile(_with_mystery, backend="tpu", options={"on_missing_op": "graph_break"})
    with Counts() as counts:
        for n in (3, 5):
            x = torch.randn(n, 4)
            torch._dynamo.mark_dynamic(x, 0)  # noqa: SLF001
            with pytest.warns(UserWarning, match="eagerly"):
                torch.testing.assert_close(fn(x), _with_mystery(x))
    assert (counts.padded, counts.exact) == (0, 2), vars(counts)
    assert any("mystery" in why for _, _, why in counts.fallbacks), counts.fallbacks


class Block(torch.nn.Module):
    """Embedding, learned positions (sliced to the length), pre-norm attention (SDPA) and MLP, a head."""

    def __init__(self, causal: bool, vocab=32, dim=16, heads=2, max_len=512):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(max_len, dim) * 0.1)
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.heads, self.causal = heads, causal

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.emb(tokens) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.head(x)


def _block_loss(model, tokens):
    return model(tokens).square().mean()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_block_sequence_mark_dynamic(causal):
    torch.manual_seed(0)
    model = Block(causal)
    ref = copy.deepcopy(model)
    step = torch.compile(_block_loss, backend="tpu")
    with Counts() as counts:
        for t in (5, 9, 17, 40, 128, 130, 250):  # buckets 128 and 256
            tokens = torch.randint(0, 32, (2, t))
            torch._dynamo.mark_dynamic(tokens, 1)  # noqa: SLF001
            _check_step(step, _block_loss, model, ref, tokens)
    assert (counts.padded, counts.exact, counts.xla_graphs) == (2, 0, 4), (vars(counts), counts.fallbacks)


def test_block_dynamic_true_batch_and_sequence():
    torch.manual_seed(0)
    model = Block(causal=True)
    ref = copy.deepcopy(model)
    step = torch.compile(_block_loss, backend="tpu", dynamic=True)
    with Counts() as counts:
        for b, t in ((2, 5), (3, 9), (4, 30), (2, 100)):  # batch and length both vary, one bucket each
            _check_step(step, _block_loss, model, ref, torch.randint(0, 32, (b, t)))
    assert (counts.padded, counts.exact) == (1, 0), (vars(counts), counts.fallbacks)


def test_block_logits_inference_are_sliced_back():
    torch.manual_seed(0)
    model = Block(causal=True).eval()
    fn = torch.compile(model, backend="tpu", dynamic=True)
    with torch.no_grad(), Counts() as counts:
        for t in (4, 11, 60):
            tokens = torch.randint(0, 32, (2, t))
            got = fn(tokens)
            assert got.shape == (2, t, 32)
            torch.testing.assert_close(got, model(tokens), rtol=1e-5, atol=1e-5)
    assert (counts.padded, counts.exact) == (1, 0), (vars(counts), counts.fallbacks)


class NoGradScale(torch.nn.Module):
    """Embeddings scaled by a statistic taken under ``torch.no_grad()`` of tensors that need grad (of
    the embeddings and of a weight): a constant for autograd, as Hugging Face's rotary tables are."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        with torch.no_grad():
            scale = x.square().mean(-1, keepdim=True).add(1).rsqrt() * self.head.weight.abs().mean()
        return self.head(x * scale)


def test_no_grad_region_pads_and_stays_out_of_the_gradients():
    torch.manual_seed(0)
    model = NoGradScale()
    ref = copy.deepcopy(model)
    step = torch.compile(_block_loss, backend="tpu")
    with Counts() as counts:
        for t in (5, 9, 17):
            tokens = torch.randint(0, 32, (2, t))
            torch._dynamo.mark_dynamic(tokens, 1)  # noqa: SLF001
            _check_step(step, _block_loss, model, ref, tokens)
    assert (counts.padded, counts.exact) == (1, 0), (vars(counts), counts.fallbacks)
    assert not counts.fallbacks, counts.fallbacks


def _lm_loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def test_decoder_lm_loss_over_lengths_up_to_max_seq_len():
    """The project's decoder (RoPE tables sliced to the length) with cross-entropy over flattened logits:
    the length pads to max_seq_len (below the first bucket), one program for every length."""
    from tpudist.training.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48))
    ref = copy.deepcopy(model)
    step = torch.compile(_lm_loss, backend="tpu")
    with Counts() as counts:
        for t in (5, 9, 17, 40, 48):
            tokens, targets = torch.randint(0, 64, (2, t)), torch.randint(0, 64, (2, t))
            targets[0, 1] = -100  # an ignored target: the mean is over the real, not ignored, ones
            torch._dynamo.mark_dynamic(tokens, 1)  # noqa: SLF001
            torch._dynamo.mark_dynamic(targets, 1)  # noqa: SLF001
            _check_step(step, _lm_loss, model, ref, tokens, targets)
    assert (counts.padded, counts.exact, counts.xla_graphs) == (1, 0, 2), (vars(counts), counts.fallbacks)


def test_hf_llama_default_config_over_lengths():
    """Hugging Face Llama at its default config (use_cache=True: the KV cache's first update is a cat
    onto an empty tensor along the length), loss over the logits: one program for every length."""
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers not installed")

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64)).eval()
    ref = copy.deepcopy(model)

    def loss(m, ids, labels):
        return F.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), labels.flatten())

    step = torch.compile(loss, backend="tpu")
    with Counts() as counts:
        for t in (6, 9, 13, 20):
            ids = torch.randint(1, 64, (2, t))
            labels = torch.roll(ids, -1, 1)
            labels[:, -1] = -100
            torch._dynamo.mark_dynamic(ids, 1)  # noqa: SLF001
            torch._dynamo.mark_dynamic(labels, 1)  # noqa: SLF001
            _check_step(step, loss, model, ref, ids, labels)
    assert (counts.padded, counts.exact) == (1, 0), (vars(counts), counts.fallbacks)


# -- "tpu" device tensors ---------------------------------------------------------------------------
def run_device_dynamic_mlp() -> dict:
    """A device MLP trained over varying batch sizes (dynamic=True): one padded program, grads as CPU's."""
    import tpudist.device  # noqa: F401

    model = _mlp()
    ref = copy.deepcopy(model)
    model = model.to("tpu")
    step = torch.compile(_mlp_loss, backend="tpu", dynamic=True)
    before = dynamic.STATS.snapshot()
    errors, devices = [], set()
    for n in (3, 6, 10, 50):
        x = torch.randn(n, 8)
        got = step(model, x.to("tpu"))
        want = _mlp_loss(ref, x)
        got.backward()
        want.backward()
        devices.add(got.device.type)
        errors.append(abs(got.item() - want.item()))
        errors += [(p.grad.cpu() - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())]
        for p, r in zip(model.parameters(), ref.parameters()):
            p.grad = r.grad = None
    after = dynamic.STATS.snapshot()
    return {"err": max(errors), "devices": sorted(devices),
            "padded": after["padded_programs"] - before["padded_programs"],
            "exact": after["exact_programs"] - before["exact_programs"]}


def test_device_tensors_dynamic_batch():
    with RankPool(1, backend=None, timeout=900, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        out = pool.run(run_device_dynamic_mlp)[0]
    assert out["devices"] == ["tpu"] and (out["padded"], out["exact"]) == (1, 0), out
    assert out["err"] <= 1e-5, out
