"""torch.compile(backend="tpu") on code nobody here wrote, against CPU eager torch.

- Graph constants (``get_attr``: ``torch.tensor([...])`` inside a forward; Hugging Face's default
  ``use_cache=True`` builds ``torch.tensor([])``) of every kind of dtype, empty ones too, forward and
  backward, on CPU tensors and on "tpu" device tensors.
- Graph breaks on device tensors: Dynamo skips ``nn.RNN``/``nn.GRU``/``nn.LSTM``; their eager part
  runs as device ops, and Dynamo never traces tpudist's device code or JAX (it used to, and failed).
- Hugging Face Llama, GPT-2, T5 and BERT built from their default configs (small sizes only, no
  weights downloaded), a few AdamW steps of the compiled loss: losses within ``LOSS_RTOL`` of CPU
  eager at every step, parameters within ``PARAM_ATOL``. Eval mode: dropout draws differ by design.

Device cases run in one worker process (installing the device renames PrivateUse1 process-wide).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tpudist.testing import RankPool

LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4
STEPS = 3


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=900, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- graph constants -------------------------------------------------------------------------------

def _constant_cases(device: str) -> dict:
    """name -> a function of x (float32, requires grad) using a tensor constant made in the graph."""
    def t(*a, **k):
        return torch.tensor(*a, device=device, **k)

    return {
        "float32": lambda x: (x * t([2.0, -1.5, 0.25])).sum(),
        "int64": lambda x: (x * t([3, -7, 2 ** 40], dtype=torch.int64).to(x.dtype) / 2 ** 40).sum(),
        "int64_index": lambda x: x[t([2, 0, 2])].pow(2).sum(),
        "bool_mask": lambda x: torch.where(t([True, False, True]), x, -x).exp().sum(),
        "empty": lambda x: torch.cat([x, t([])]).mul(3).sum(),  # what HF's default use_cache builds
        "bfloat16": lambda x: (x * t([1.5, 2.0, -3.0], dtype=torch.bfloat16).float()).sum(),
        "float64": lambda x: (x.double() * t([0.1, 0.2, 0.3], dtype=torch.float64)).sum().float(),
    }


def run_constants(device: str) -> dict:
    """name -> (eager value, compiled value, max grad difference) or the error text."""
    if device == "tpu":
        import tpudist.device  # noqa: F401
    out = {}
    references = _constant_cases("cpu")
    for name, fn in _constant_cases(device).items():
        x = torch.tensor([0.5, -1.25, 2.0], requires_grad=True)
        eager = references[name](x)
        (grad_e,) = torch.autograd.grad(eager, x)
        x2 = x.detach().to(device).requires_grad_(True)
        try:
            got = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)(x2)
            got.backward()
        except Exception as e:  # noqa: BLE001 - reported by name to the test process
            out[name] = f"{type(e).__name__}: {str(e)[:600]}"
            continue
        out[name] = (eager.item(), got.item(), (x2.grad.cpu() - grad_e).abs().max().item())
    return out


def _check_constants(results: dict) -> None:
    failed = {k: v for k, v in results.items() if isinstance(v, str)}
    assert not failed, failed
    for name, (eager, got, grad_err) in results.items():
        assert abs(got - eager) <= 1e-6 * max(1.0, abs(eager)), (name, eager, got)
        assert grad_err <= 1e-6, (name, grad_err)


def test_graph_constants_cpu():
    _check_constants(run_constants("cpu"))


def test_graph_constants_device(dev):
    _check_constants(dev(run_constants, "tpu"))


def test_graph_constant_values_are_part_of_the_program_key():
    """Two graphs that differ only in a constant's value are two programs, not one reused."""
    a = torch.compile(lambda x: x * torch.tensor([2.0]), backend="tpu", dynamic=False)
    b = torch.compile(lambda x: x * torch.tensor([3.0]), backend="tpu", dynamic=False)
    x = torch.ones(2)
    assert a(x).tolist() == [2.0, 2.0] and b(x).tolist() == [3.0, 3.0]


# -- graph breaks on device tensors ----------------------------------------------------------------

def run_recurrent_graph_break(cls_name: str) -> dict:
    """A model whose recurrent layer Dynamo skips: compiled on tpu tensors against CPU eager."""
    import tpudist.device  # noqa: F401
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    rnn, head = getattr(torch.nn, cls_name)(8, 6, batch_first=True), torch.nn.Linear(6, 3)
    x = torch.randn(2, 5, 8)
    ref = head(rnn(x)[0]).square().mean()
    ref.backward()
    d_rnn, d_head = copy.deepcopy(rnn).to("tpu"), copy.deepcopy(head).to("tpu")
    for p in (*d_rnn.parameters(), *d_head.parameters()):
        p.grad = None
    torch._dynamo.reset()  # noqa: SLF001 - counters and caches of this case only
    counters.clear()
    fn = torch.compile(lambda x: d_head(d_rnn(x)[0]).square().mean(), backend="tpu", dynamic=False)
    got = fn(x.to("tpu"))
    got.backward()
    grad_err = max((a.grad - b.grad.cpu()).abs().max().item()
                   for a, b in zip((*rnn.parameters(), *head.parameters()), (*d_rnn.parameters(), *d_head.parameters())))
    # Frames Dynamo converted: the user's lambda and its resumption after the break, nothing of ours.
    frames = dict(counters["frames"])
    return {"ref": ref.item(), "got": got.item(), "grad_err": grad_err, "device": str(got.device),
            "frames": frames, "breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("cls_name", ["RNN", "LSTM"])
def test_recurrent_layer_graph_break_on_device(dev, cls_name):
    out = dev(run_recurrent_graph_break, cls_name)
    assert out["device"].startswith("tpu"), out
    assert abs(out["got"] - out["ref"]) <= 1e-5 * max(1.0, abs(out["ref"])), out
    assert out["grad_err"] <= 1e-5, out
    assert out["breaks"] >= 1, out  # the recurrent layer really ran outside the graph
    assert out["frames"].get("total", 0) <= 3, out  # before: hundreds (the device's kernels and JAX)


def run_device_code_is_not_traced(mode: str) -> list:
    """Every Python frame Dynamo is asked to convert while a graph break runs device ops eagerly."""
    import tpudist.device  # noqa: F401
    from torch._dynamo import convert_frame

    torch._dynamo.reset()  # noqa: SLF001 - every frame of this case is converted afresh
    seen = []
    original = convert_frame.ConvertFrameAssert.__call__

    def spy(self, frame, *args, **kwargs):
        seen.append(frame.f_code.co_filename)
        return original(self, frame, *args, **kwargs)

    convert_frame.ConvertFrameAssert.__call__ = spy
    try:
        rnn = torch.nn.RNN(4, 4).to("tpu")
        with torch.tpu.eager_mode(mode):
            out = torch.compile(lambda x: rnn(x)[0].sum() * 2, backend="tpu", dynamic=False)(torch.randn(3, 2, 4, device="tpu"))
            out.item()
    finally:
        convert_frame.ConvertFrameAssert.__call__ = original
    return seen


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_device_code_is_never_traced_by_dynamo(dev, mode):
    files = dev(run_device_code_is_not_traced, mode)
    ours = [f for f in files if "/tpudist/" in f or "/jax/" in f or "/jaxlib/" in f]
    assert files and not ours, files


# -- Hugging Face models from their default configs -----------------------------------------------

def _hf_model(family: str, tie: bool):
    """A tiny model of ``family`` whose config keeps every default but the sizes."""
    import transformers as T

    small = dict(vocab_size=64, tie_word_embeddings=tie)
    if family == "llama":  # use_cache=True: torch.tensor([]) constants in the forward
        return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, **small))
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=32, **small))
    if family == "t5":  # relative position buckets: an int64 constant
        return T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                                       decoder_start_token_id=0, pad_token_id=0, **small))
    if family == "bert":  # a padding mask
        return T.BertForMaskedLM(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                              intermediate_size=64, max_position_embeddings=32, **small))
    raise ValueError(family)


def _hf_batches(family: str, steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, 64, (2, 10), generator=g)
        labels = torch.randint(0, 64, (2, 10), generator=g)
        if family == "t5":
            out.append({"input_ids": ids, "labels": labels})
        elif family == "bert":
            mask = torch.ones(2, 10, dtype=torch.long)
            mask[1, 7:] = 0
            labels[1, 7:] = -100
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        else:
            out.append({"input_ids": ids, "labels": ids})
    return out


def _hf_loss(model, batch):
    return model(**batch).loss


def run_hf(family: str, device: str, tie: bool = True) -> dict:
    """STEPS AdamW steps, CPU eager against the compiled loss on ``device`` tensors."""
    if device == "tpu":
        import tpudist.device  # noqa: F401
    torch.manual_seed(0)
    ref = _hf_model(family, tie).eval()  # eval: no dropout draws to compare
    model = copy.deepcopy(ref).to(device)
    step = torch.compile(_hf_loss, backend="tpu", dynamic=False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for batch in _hf_batches(family, STEPS):
        pair = []
        for net, optim, fn, dev_ in ((ref, opt_ref, _hf_loss, "cpu"), (model, opt, step, device)):
            loss = fn(net, {k: v.to(dev_) for k, v in batch.items()})
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            pair.append(loss.item())
        losses.append(tuple(pair))
    param_err = max((a - b.detach().cpu()).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    return {"losses": losses, "param_err": param_err}


def _check_hf(out: dict) -> None:
    for eager, got in out["losses"]:
        assert abs(got - eager) <= LOSS_RTOL * abs(eager), out
    assert out["param_err"] <= PARAM_ATOL, out


# BERT (no graph constants, a padding mask) and GPT-2/T5 on the device: tests/device/test_model_zoo.py; here
# the families whose default config puts constants in the graph, kept to a minute or so of compiling.
@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_hf_default_config_trains_compiled_cpu(family):
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    _check_hf(run_hf(family, "cpu"))


@pytest.mark.parametrize("family", ["llama"])
def test_hf_default_config_trains_compiled_device(dev, family):
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    _check_hf(dev(run_hf, family, "tpu"))


# -- a compiled optimizer step ----------------------------------------------------------------------

def run_compiled_optimizer(device: str, steps: int = 3) -> float:
    """Max parameter difference after ``steps`` AdamW steps: eager on CPU vs ``torch.compile(opt.step)``.

    Dynamo writes AdamW's addcmul as ``prims.fma`` (an Inductor prim), and on device parameters the
    step counts stay CPU scalars: both reach the backend."""
    if device == "tpu":
        import tpudist.device  # noqa: F401
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))
    model = copy.deepcopy(ref).to(device)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch.compile(opt.step, backend="tpu", dynamic=False)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(7, 8, generator=g)
        ref(x).square().mean().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        model(x.to(device)).square().mean().backward()
        step()
        opt.zero_grad()
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())  # torch's choice, kept
    return max((a - b.detach().cpu()).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))


def test_compiled_adamw_step_cpu():
    assert run_compiled_optimizer("cpu") <= 1e-6


def test_compiled_adamw_step_device(dev):
    assert dev(run_compiled_optimizer, "tpu") <= 1e-6


def run_cpu_batch_moved_in_the_graph() -> dict:
    """A device model, a CPU batch moved with ``.to("tpu")`` inside the compiled function."""
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = copy.deepcopy(ref).to("tpu")
    x = torch.randn(5, 4)
    step = torch.compile(lambda x: model(x.to("tpu")).square().sum(), backend="tpu", dynamic=False)
    got = step(x)
    got.backward()
    want = ref(x).square().sum()
    want.backward()
    return {"got": got.item(), "want": want.item(), "device": str(got.device),
            "grad_err": (model.weight.grad.cpu() - ref.weight.grad).abs().max().item()}


def test_cpu_batch_moved_inside_a_compiled_device_step(dev):
    out = dev(run_cpu_batch_moved_in_the_graph)
    assert out["device"].startswith("tpu") and abs(out["got"] - out["want"]) <= 1e-5 * abs(out["want"]), out
    assert out["grad_err"] <= 1e-5, out


def run_device_results_from_cpu_inputs() -> dict:
    """Graphs whose inputs are all CPU tensors but whose results live on the device."""
    import tpudist.device  # noqa: F401

    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    moved = torch.compile(lambda x: (x.to("tpu") * 2).square().sum(), backend="tpu", dynamic=False)(x)
    moved.backward()
    made = torch.compile(lambda x: torch.ones(3, device="tpu") * x.sum().to("tpu"), backend="tpu",
                         dynamic=False)(torch.tensor([1.0, 2.0]))
    return {"moved": (str(moved.device), moved.item()), "grad": (str(x.grad.device), x.grad.tolist()),
            "made": (str(made.device), made.cpu().tolist())}


def test_device_results_of_a_graph_with_cpu_inputs_stay_on_the_device(dev):
    out = dev(run_device_results_from_cpu_inputs)
    x = torch.tensor([1.0, -2.0, 3.0])
    assert out["moved"] == ("tpu:0", (x * 2).square().sum().item()), out
    assert out["grad"] == ("cpu", (8 * x).tolist()), out
    assert out["made"] == ("tpu:0", [3.0, 3.0, 3.0]), out


def _restride_in_place(x):
    y = x * 2
    y.transpose_(0, 1)
    y.unsqueeze_(0)
    return (y * torch.arange(3.0, device=x.device)).sum()


def run_in_place_views_compiled() -> dict:
    """transpose_ / unsqueeze_ on a graph intermediate: AOTAutograd's functionalization replays these
    metadata mutations on its FunctionalTensor wrapper of the tpu tensor (Swin's window code does)."""
    import tpudist.device  # noqa: F401

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    ref_x = x.clone().requires_grad_()
    want = _restride_in_place(ref_x)
    want.backward()
    dx = x.to("tpu").requires_grad_()
    got = torch.compile(_restride_in_place, backend="tpu", dynamic=False)(dx)
    got.backward()
    return {"got": got.item(), "want": want.item(), "grad_err": (dx.grad.cpu() - ref_x.grad).abs().max().item()}


def test_in_place_views_in_a_compiled_device_graph(dev):
    out = dev(run_in_place_views_compiled)
    assert abs(out["got"] - out["want"]) <= 1e-5 * abs(out["want"]) and out["grad_err"] == 0.0, out
