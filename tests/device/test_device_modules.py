"""PyTorch's ModuleInfo database (``module_db``) on "tpu" tensors, compared with CPU eager torch.

For each ModuleInfo (float32) its ``module_inputs_func`` gives constructor and forward inputs. Each input
builds the module on the CPU with a fixed seed; a deep copy is moved with ``.to("tpu")`` and both run:
- ``.to()``: the same Parameter objects before and after (torch's default ``torch.__future__`` flags keep
  them and swap their ``.data``, as on CUDA), as many ``named_parameters()`` as on the CPU, every
  parameter and buffer on "tpu" with its CPU dtype, ``state_dict`` keys equal, and equal values after a
  round trip ``.to("tpu").to("cpu")``;
- forward outputs (values, dtypes, shapes), in train mode;
- backward with a fixed random cotangent per floating output: gradients of the inputs and parameters;
- buffers after the train-mode forward (BatchNorm running stats, ``num_batches_tracked``);
- a second forward in eval mode for modules whose train and eval modes differ;
- the first input that passed, again in Fused mode (forward and backward recorded, run as one program at
  the sync), unless ``TPUDIST_MODULES_FUSED=0``.
Modules whose results are random in train mode are compared on dtypes and shapes there, and checked
against their rule (``RANDOM``: dropout's zeros and scale, RReLU's slope range).

A ModuleInfo fails if any input mismatches or raises an error CPU torch does not; it is unsupported
(a skip naming the op) if an input reaches an op without a lowering (``UnsupportedOp`` or a
``NotImplementedError`` naming an aten op); otherwise it passes. By default ``SUBSET`` runs (the modules
real models use, 40, at most ``MAX_INPUTS`` inputs each, spread over the ModuleInfo's list);
``TPUDIST_MODULES_ALL=1`` runs all of ``module_db`` plus ``EXTRA_MODULES``; ``TPUDIST_MODULES_MAX_INPUTS``
changes the cap. The module prints its counts, the failing modules and the missing ops ranked by the
number of modules each blocks at its end (shown with ``-s``).
Everything runs in one worker process (a ``RankPool`` of one rank without a process group), because
importing ``tpudist.device`` renames PrivateUse1 for the whole process.
"""

from __future__ import annotations

import collections
import os
import re

import pytest

from tpudist.testing import RankPool

ALL = bool(os.environ.get("TPUDIST_MODULES_ALL"))
MAX_INPUTS = int(os.environ.get("TPUDIST_MODULES_MAX_INPUTS") or (6 if ALL else 3))
FUSED = os.environ.get("TPUDIST_MODULES_FUSED", "1") != "0"

# What a model is built from: linear and conv layers, norms, embeddings, recurrent layers, attention and
# transformer blocks, activations, dropout, pooling, losses, reshaping.
SUBSET = (
    "nn.Linear", "nn.Bilinear", "nn.Conv1d", "nn.Conv2d", "nn.Conv3d", "nn.ConvTranspose2d",
    "nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LayerNorm", "nn.RMSNorm", "nn.GroupNorm",
    "nn.InstanceNorm2d", "nn.Embedding", "nn.EmbeddingBag", "nn.LSTM", "nn.GRU", "nn.RNN",
    "nn.MultiheadAttention", "nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer", "nn.Transformer",
    "nn.ReLU", "nn.GELU", "nn.SiLU", "nn.Tanh", "nn.Softmax", "nn.LogSoftmax", "nn.Dropout", "nn.MaxPool2d",
    "nn.AvgPool2d", "nn.AdaptiveAvgPool2d", "nn.CrossEntropyLoss", "nn.MSELoss", "nn.NLLLoss",
    "nn.BCEWithLogitsLoss", "nn.L1Loss", "nn.SmoothL1Loss", "nn.Flatten", "nn.Unflatten", "TiedEmbeddingLinear",
)

# Modules module_db lacks that models use (their inputs are defined below, in the worker's part);
# TiedEmbeddingLinear is an embedding whose weight the output projection shares (GPT-2's weight tying).
EXTRA_MODULES = ("nn.Dropout", "nn.Dropout2d", "nn.RReLU", "nn.EmbeddingBag", "nn.Flatten", "nn.Unflatten",
                 "nn.Identity", "TiedEmbeddingLinear")



def _dropout_rule(module, args, out):
    """Each element of a train-mode dropout is 0 or its input scaled by 1 / (1 - p)."""
    import torch

    x, out = args[0].detach(), out.detach()
    ok = (out == 0) | torch.isclose(out, x / (1 - module.p), rtol=1e-5, atol=1e-6)
    return None if ok.all() else f"{int((~ok).sum())} elements are neither 0 nor input / (1 - p)"


def _rrelu_rule(module, args, out):
    """A train-mode RReLU keeps x >= 0 and scales x < 0 by a slope in [lower, upper]."""
    x, out = args[0].detach(), out.detach()
    neg = x < 0
    slope = out[neg] / x[neg]
    ok = bool((out[~neg] == x[~neg]).all()) and bool(((slope >= module.lower - 1e-6)
                                                       & (slope <= module.upper + 1e-6)).all())
    return None if ok else f"outputs outside the rule (slopes {slope.min():.4f}..{slope.max():.4f})"


# Train-mode results drawn from the RNG: the device draws from JAX's generator, not torch's CPU one, so
# the same seed gives other numbers. In train mode, dtypes and shapes of outputs and gradients are compared
# with CPU torch, and the outputs are checked against the module's rule; in eval mode, values as usual.
RANDOM = {
    "nn.Dropout": ("zeroes elements drawn from the RNG", _dropout_rule),
    "nn.Dropout2d": ("zeroes channels drawn from the RNG", _dropout_rule),
    "nn.RReLU": ("draws its negative slopes from the RNG", _rrelu_rule),
}

# float32 tolerances (rtol, atol). Outputs: torch's assert_close defaults, which its own CPU/CUDA module
# parity test uses (all of module_db passes at them, 2026-12-02). Gradients sum over batch, positions and
# time steps in another order than MKL/oneDNN: the largest differences measured at those defaults were
# 2.5e-5 (ConvTranspose3d weight, 540 elements) and 1.02e-5 (LSTM), so gradients get 1e-5 / 5e-5.
FORWARD_TOL = (1.3e-6, 1e-5)
GRAD_TOL = (1e-5, 5e-5)


def _names():
    if not ALL:
        return list(SUBSET)
    from torch.testing._internal.common_modules import module_db  # ~7 s: only for the full run

    names = [info.name for info in module_db]
    return names + [n for n in EXTRA_MODULES if n not in names]


NAMES = _names()


# -- in the worker ------------------------------------------------------------------------------------


def _extra_infos():
    """ModuleInfos for EXTRA_MODULES, in module_db's form."""
    from functools import partial

    import torch
    from torch.testing import make_tensor
    from torch.testing._internal.common_modules import FunctionInput, ModuleInfo, ModuleInput

    _TiedEmbeddingLinear = _tied_embedding_linear_class()

    def inputs(cases):
        def fn(module_info, device, dtype, requires_grad, training, **kwargs):
            make = partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad)
            return [ModuleInput(FunctionInput(*ctor_args, **ctor_kwargs), FunctionInput(*forward(make)), desc=desc)
                    for desc, ctor_args, ctor_kwargs, forward in cases]
        return fn

    def bag_input(make):
        return (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 5]))

    cases = {
        "nn.Dropout": [("p0.5", (0.5,), {}, lambda m: (m((4, 10)),)), ("p0", (0.0,), {}, lambda m: (m((3, 5)),))],
        "nn.Dropout2d": [("", (0.5,), {}, lambda m: (m((2, 4, 3, 3)),))],
        "nn.RReLU": [("", (), {}, lambda m: (m((4, 6)),)), ("bounds", (0.1, 0.3), {}, lambda m: (m((3, 5)),))],
        "nn.EmbeddingBag": [
            ("mean_offsets", (10, 3), {}, bag_input),
            ("sum_offsets", (10, 3), {"mode": "sum"}, bag_input),
            ("max_2d", (10, 3), {"mode": "max"}, lambda m: (torch.tensor([[1, 2, 4], [4, 3, 2]]),)),
            ("per_sample_weights", (10, 3), {"mode": "sum"},
             lambda m: (*bag_input(m), m((8,)))),
        ],
        "nn.Flatten": [("", (), {}, lambda m: (m((2, 3, 4, 5)),)), ("dims", (0, 1), {}, lambda m: (m((2, 3, 4)),))],
        "nn.Unflatten": [("", (1, (2, 3)), {}, lambda m: (m((4, 6, 5)),)),
                         ("last", (-1, (2, -1)), {}, lambda m: (m((3, 8)),))],
        "nn.Identity": [("", (), {}, lambda m: (m((3, 4)),))],
        "TiedEmbeddingLinear": [("", (10, 4), {}, lambda m: (torch.tensor([[1, 2, 9], [0, 4, 4]]),))],
    }
    differ = {"nn.Dropout", "nn.Dropout2d", "nn.RReLU"}
    return {name: ModuleInfo(_TiedEmbeddingLinear if name == "TiedEmbeddingLinear" else getattr(torch.nn, name[3:]),
                             module_inputs_func=inputs(c), train_and_eval_differ=name in differ)
            for name, c in cases.items()}


def _tied_embedding_linear_class():
    import torch

    class TiedEmbeddingLinear(torch.nn.Module):
        """A language model's ends: the output projection shares the embedding's weight (GPT-2, T5)."""

        def __init__(self, vocab, dim):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.out = torch.nn.Linear(dim, vocab, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, tokens):
            return self.out(torch.tanh(self.embed(tokens)))

    return TiedEmbeddingLinear


def _find(name):
    from torch.testing._internal.common_modules import module_db

    for info in module_db:
        if info.name == name:
            return info
    extra = _extra_infos()
    if name in extra:
        return extra[name]
    raise LookupError(f"no ModuleInfo {name!r} in module_db or EXTRA_MODULES")


def _spread(items, k):
    """At most ``k`` of ``items``, evenly spread (the first and the last included)."""
    if len(items) <= k:
        return list(items)
    if k == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


def _to_device(x, device, memo=None):
    """Tensors in ``x`` (nested tuples, lists, dicts, PackedSequence) on ``device``: new leaves that keep
    ``requires_grad``, so the device run has gradients of its own to compare. A tensor passed twice (KLDivLoss's
    scalar input is its own target) stays one tensor, so its gradients add up as on the CPU."""
    import torch
    from torch.nn.utils.rnn import PackedSequence

    memo = {} if memo is None else memo
    if isinstance(x, torch.Tensor):
        if id(x) not in memo:
            memo[id(x)] = x.detach().to(device).requires_grad_(x.requires_grad)
        return memo[id(x)]
    if isinstance(x, PackedSequence):
        # batch_sizes stays on the host, as torch requires on every device
        return PackedSequence(_to_device(x.data, device, memo), x.batch_sizes,
                              _to_device(x.sorted_indices, device, memo), _to_device(x.unsorted_indices, device, memo))
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(i, device, memo) for i in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device, memo) for k, v in x.items()}
    return x


def _tensors(x):
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _to_cpu(x):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, x)


class _Problems(list):
    """The differences found for one input, as "phase: what differs" lines (every phase runs)."""

    def check(self, phase, expected, actual, *, values=True, tol=FORWARD_TOL):
        from tpudist.ops.opcheck import compare

        why = compare(expected, actual, values=values, rtol=tol[0], atol=tol[1])
        if why is not None:
            self.append(f"{phase}: {why}")


def _check_move(cpu_module, problems):
    """``.to("tpu")`` on a deep copy of ``cpu_module``; returns the moved copy after checking it."""
    import copy

    import torch

    moved = copy.deepcopy(cpu_module)
    params_before = list(moved.parameters())
    moved.to("tpu")
    _move_plain_tensors(moved)
    params_after = list(moved.parameters())
    if [id(p) for p in params_after] != [id(p) for p in params_before]:
        problems.append(".to identity: Parameter objects replaced (torch keeps them and swaps their .data "
                        "for CPU/CUDA tensors)")
    n_cpu, n_dev = len(list(cpu_module.named_parameters())), len(list(moved.named_parameters()))
    if n_cpu != n_dev:
        problems.append(f".to: named_parameters() count {n_dev}, torch gives {n_cpu}")
    expected = dict(cpu_module.named_parameters()) | dict(cpu_module.named_buffers())
    for key, t in [*moved.named_parameters(), *moved.named_buffers()]:
        if key not in expected:
            problems.append(f".to: {key} is listed, the CPU module lists no such parameter or buffer (a shared "
                            "parameter split in two?)")
        elif t.device.type != "tpu" or t.dtype != expected[key].dtype:
            problems.append(f".to: {key} is {t.device}/{t.dtype}, expected tpu/{expected[key].dtype}")
    cpu_state = cpu_module.state_dict()
    if list(moved.state_dict()) != list(cpu_state):
        problems.append(f".to: state_dict keys {list(moved.state_dict())}, torch gives {list(cpu_state)}")
    back = copy.deepcopy(cpu_module).to("tpu").to("cpu").state_dict()
    for key, value in cpu_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if back[key].device.type != "cpu" or back[key].dtype != value.dtype or not torch.equal(back[key], value):
            problems.append(f".to round trip: state_dict[{key!r}] differs after .to('tpu').to('cpu')")
    return moved


def _move_plain_tensors(module):
    """Tensor attributes that are neither parameters nor buffers stay where ``.to`` found them (on CUDA as
    here): FractionalMaxPool's ``_random_samples`` is one. A user moves them by hand; so does this test."""
    import torch

    for sub in module.modules():
        for key, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor):
                setattr(sub, key, value.to("tpu"))


def _cotangents(outputs):
    """A fixed random cotangent for each floating output that requires grad (same seed on both sides)."""
    import torch

    g = torch.Generator().manual_seed(1)
    flat = [o for o in _tensors(outputs) if o.requires_grad and o.dtype.is_floating_point]
    return flat, [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in flat]


def _backward(outputs, device):
    import torch

    flat, cots = _cotangents(outputs)
    if flat:
        torch.autograd.backward(flat, [c.to(device) for c in cots])
    return bool(flat)


def _grads(module, inputs):
    return ([t.grad for t in _tensors(inputs) if t.requires_grad],
            [p.grad for p in module.parameters()])


def _compare_grads(problems, cpu_grads, dev_grads, values=True):
    (cpu_in, cpu_params), (dev_in, dev_params) = cpu_grads, dev_grads
    for kind, exp, act in (("input", cpu_in, dev_in), ("parameter", cpu_params, dev_params)):
        for i, (e, a) in enumerate(zip(exp, act)):
            if (e is None) != (a is None):
                problems.append(f"backward: {kind} {i} grad is {'None' if a is None else 'set'}, torch's is "
                                f"{'None' if e is None else 'set'}")
            elif e is not None:
                problems.check(f"backward: {kind} {i} grad", e, _to_cpu(a), values=values, tol=GRAD_TOL)


def _named(tensors: dict):
    """A name -> tensor dict as a comparable list (opcheck.compare compares sequences)."""
    return [*tensors, *(_to_cpu(t) for t in tensors.values())]


class _ReferenceError(Exception):
    """CPU torch itself rejects the input: nothing to compare (not counted against the device)."""


def _run_input(name, info, module_input, training, fused) -> list[str]:
    """Compares one ModuleInput on the device with CPU torch; the differences found."""
    import copy

    import torch

    problems = _Problems()
    ctor, fwd = module_input.constructor_input, module_input.forward_input
    random = name in RANDOM and training
    cpu_args, cpu_kwargs = fwd.args, fwd.kwargs
    try:
        torch.manual_seed(0)
        cpu_module = info.module_cls(*ctor.args, **ctor.kwargs).to(torch.float32)
        if info.is_lazy:  # lazy parameters take their shapes from a first input
            with torch.no_grad():
                cpu_module(*cpu_args, **cpu_kwargs)
        cpu_module.train(training)
        pristine = copy.deepcopy(cpu_module)  # the train-mode forward changes buffers, backward sets grads
        for t in _tensors((cpu_args, cpu_kwargs)):  # inputs made by a view (Transformer's transposed src)
            if t.requires_grad and not t.is_leaf:
                t.retain_grad()
        expected = cpu_module(*cpu_args, **cpu_kwargs)
        has_grad = _backward(expected, "cpu")
    except Exception as err:  # noqa: BLE001
        raise _ReferenceError(f"{type(err).__name__}: {str(err)[:200]}") from err

    dev_module = _check_move(pristine, problems)
    dev_args, dev_kwargs = _to_device((cpu_args, cpu_kwargs), "tpu")
    with torch.tpu.eager_mode("fused" if fused else "strict"):
        actual = dev_module(*dev_args, **dev_kwargs)
        problems.check("forward", expected, _to_cpu(actual), values=not random)
        if random and (why := RANDOM[name][1](dev_module, _to_cpu(dev_args), _to_cpu(actual))):
            problems.append(f"forward (random): {why}")
        if has_grad:
            _backward(actual, "tpu")
            _compare_grads(problems, _grads(cpu_module, (cpu_args, cpu_kwargs)),
                           _grads(dev_module, (dev_args, dev_kwargs)), values=not random)
    problems.check("buffers after forward", _named(dict(cpu_module.named_buffers())),
                   _named(dict(dev_module.named_buffers())))
    if info.train_and_eval_differ and training and not fused:
        cpu_module.eval()
        dev_module.eval()
        with torch.no_grad():
            expected = cpu_module(*cpu_args, **cpu_kwargs)
            actual = dev_module(*dev_args, **dev_kwargs)
        problems.check("eval forward", expected, _to_cpu(actual))
    return problems


_LOWERS = re.compile(r"lowers\((torch\.ops\.[\w.]+)\)")
_ATEN = re.compile(r"(aten::[\w.]+)")


def _unsupported_op(err) -> str | None:
    """The op an error says has no lowering on the device, or None if it is not such an error."""
    reached = getattr(err, "reached", None)
    if reached is not None:
        return str(reached)
    if not isinstance(err, NotImplementedError):
        return None
    text = str(err)
    found = _LOWERS.search(text) or _ATEN.search(text)
    if found is None:
        return None
    return found.group(1).replace("torch.ops.", "").replace("::", ".")


def run_module_on_device(name: str) -> dict:
    """Outcomes of one ModuleInfo: {"inputs": n, "outcomes": [(desc, status, detail)]}.

    status: pass | mismatch | error | unsupported (detail: the op) | reference_error (CPU torch raised).
    """
    import warnings
    import zlib

    import torch

    import tpudist.device  # noqa: F401

    warnings.filterwarnings("ignore")
    info = _find(name)
    training = True
    # the inputs are random (make_tensor: uniform in [-9, 9]): seeded by the module's name, so they do not
    # depend on which tests ran before in this worker (a saturated softmax once moved a gradient past the
    # tolerance on one draw of TransformerEncoderLayer's)
    torch.manual_seed(zlib.crc32(name.encode()))
    # torch's own generators make every input on the CPU; the device copies them
    all_inputs = list(info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                              training=training))
    def desc(index):
        return all_inputs[index].desc or f"#{index}"

    indices = _spread(range(len(all_inputs)), MAX_INPUTS)
    outcomes = [(desc(i), *_outcome(name, info, all_inputs[i], training, fused=False)) for i in indices]
    first_pass = next((i for i, o in zip(indices, outcomes) if o[1] == "pass"), None)
    if FUSED and first_pass is not None:
        # fresh inputs: the strict run's input grads must not add up with the fused run's
        fresh = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                        training=training)
        outcomes.append((f"fused:{desc(first_pass)}", *_outcome(name, info, fresh[first_pass], training, fused=True)))
    return {"inputs": len(all_inputs), "outcomes": outcomes}


def _outcome(name, info, module_input, training, fused):
    try:
        problems = _run_input(name, info, module_input, training, fused)
    except _ReferenceError as err:
        return "reference_error", str(err)
    except Exception as err:  # noqa: BLE001 - classified, reported with its message
        op = _unsupported_op(err)
        if op is not None:
            return "unsupported", op
        return "error", f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
    return ("mismatch", " | ".join(p[:300] for p in problems)) if problems else ("pass", "")


# -- tests --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=900, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a: pool.run(fn, *a)[0]


RESULTS: dict = {}


def _kind(outcomes) -> str:
    statuses = {s for _, s, _ in outcomes}
    if statuses & {"mismatch", "error"}:
        return "fail"
    if "unsupported" in statuses:
        return "unsupported"
    return "pass"


@pytest.mark.parametrize("name", NAMES)
def test_module_on_device(dev, name):
    result = RESULTS[name] = dev(run_module_on_device, name)
    outcomes = result["outcomes"]
    bad = [o for o in outcomes if o[1] in ("mismatch", "error")]
    assert not bad, "\n".join(f"{desc}: {status}: {detail}" for desc, status, detail in bad)
    missing = sorted({detail for _, s, detail in outcomes if s == "unsupported"})
    if missing:
        passed = sum(1 for o in outcomes if o[1] == "pass")
        pytest.skip(f"reaches ops with no lowering: {', '.join(missing)} ({passed}/{len(outcomes)} inputs pass)")


def _failure_kinds(outcomes) -> list[str]:
    """One line per kind of failure (the phase of a mismatch, or an error): how many inputs, the first."""
    kinds: dict = {}
    for desc, status, detail in outcomes:
        problems = detail.split(" | ") if status == "mismatch" else [detail] if status == "error" else []
        for problem in problems:
            phase = problem.split(":")[0] if status == "mismatch" else "error"
            first, inputs = kinds.setdefault(phase, (f"{desc}: {problem[:200]}", set()))
            inputs.add(desc)
    return [f"[{phase}] {len(inputs)}/{len(outcomes)} inputs, e.g. {first}" for phase, (first, inputs) in kinds.items()]


@pytest.fixture(scope="module", autouse=True)
def summary():
    """Prints counts, failing modules and missing ops (ranked by modules blocked) at the end (``-s``)."""
    yield
    if not RESULTS:
        return
    kinds = collections.Counter(_kind(r["outcomes"]) for r in RESULTS.values())
    samples = collections.Counter(s for r in RESULTS.values() for _, s, _ in r["outcomes"])
    blocked = collections.defaultdict(set)
    lines = []
    for name, r in RESULTS.items():
        for _, status, detail in r["outcomes"]:
            if status == "unsupported":
                blocked[detail].add(name)
        if _kind(r["outcomes"]) == "fail":
            lines.append(f"  FAIL {name}: " + "; ".join(_failure_kinds(r["outcomes"])))
    print(f"\nModuleInfo on the tpu device: {len(RESULTS)} modules: {dict(kinds)}; inputs: {dict(samples)}")
    print("\n".join(lines))
    for op, names in sorted(blocked.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"  missing {op}: blocks {len(names)} modules: {' '.join(sorted(names))}")
