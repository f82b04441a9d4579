"""PyTorch's OpInfo samples on "tpu" tensors, compared with CPU eager torch (values and result dtypes).

``test_ops_opinfo.py`` runs the samples through the lowerings directly; this module runs them the way
a user does: the sample's tensors are moved with ``.to("tpu")``, the OpInfo's op runs on them (torch's
dispatcher -> the device's kernels -> the op table, one cached XLA program per op in Strict mode), and
the results come back with ``.cpu()``. The first sample of each of bool, int32, int64, bfloat16 and
float32 that the OpInfo supports is compared with the same sample on the CPU: dtypes and shapes
always, values unless the op is random. Installing the device renames PrivateUse1 for the whole
process, so the samples run in one worker process (a ``RankPool`` of one rank without a process group).

By default a representative subset runs (``SUBSET``: the op families a model uses, ~40 OpInfos);
``TPUDIST_OPS_ALL=1`` runs every OpInfo ``test_ops_opinfo.py`` selects (the ones whose aten op has a
lowering, plus its ``EXTRA``); the module prints the pass/fail counts at its end (``-s``).
``TPUDIST_OPINFO_SAMPLES=N`` compares the first N samples per dtype instead of the first: later samples
hold the edge cases (scalar arguments, broadcasting, empty and out-of-bounds shapes) that found the bugs
``test_device_edge_cases.py`` pins; some of them differ by design (a dropout sample's random values,
bfloat16 results CPU computes in float32).
An op with no lowering is a skip naming that op (the device raises ``NotImplementedError``); a wrong
value, dtype or shape, or an error CPU torch does not raise, fails.
"""

from __future__ import annotations

import collections
import itertools
import os

import pytest

from tpudist.testing import RankPool

ALL = bool(os.environ.get("TPUDIST_OPS_ALL"))
SAMPLES = int(os.environ.get("TPUDIST_OPINFO_SAMPLES", "1"))  # per OpInfo and dtype, from the first
DTYPE_NAMES = ("bool", "int32", "int64", "bfloat16", "float32")
# The families a transformer step reaches, one or two OpInfos each: elementwise, reductions,
# matmuls, shapes and indexing, normalisation and losses, comparisons and selection, casts, factories.
SUBSET = (
    "add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "rsqrt", "sqrt", "tanh", "sigmoid",
    "clamp", "where", "eq", "lt", "logical_and", "bitwise_and", "sum", "mean", "amax", "argmax", "cumsum",
    "var", "mm", "bmm", "matmul", "cat", "stack", "transpose", "reshape", "expand", "__getitem__",
    "index_select", "gather", "scatter_add", "masked_fill", "softmax", "log_softmax",
    "nn.functional.cross_entropy", "nn.functional.embedding", "nn.functional.silu", "nn.functional.gelu",
    "nn.functional.layer_norm", "nn.functional.scaled_dot_product_attention", "topk", "sort", "to",
    "zeros_like", "full_like", "tril", "repeat_interleave",
)

HOST_ARGS = {"tensor_split"}


def _selection():
    """(name, variant) of the OpInfos to run, in op_db order (run in the pytest process at collection)."""
    import test_ops_opinfo

    infos = test_ops_opinfo.SELECTED
    if not ALL:
        infos = [info for info in infos if info.name in SUBSET and not info.variant_test_name]
    return [(info.name, info.variant_test_name) for info in infos]


SELECTION = _selection()


# -- in the worker ------------------------------------------------------------------------------------


def _find(name, variant):
    import test_ops_opinfo

    for info in test_ops_opinfo.SELECTED if not ALL else test_ops_opinfo.op_db + test_ops_opinfo.FOREACH_DB:
        if info.name == name and info.variant_test_name == variant:
            return info
    raise LookupError(f"no OpInfo {name!r} variant {variant!r}")


def _to(x, device):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


def run_opinfo_on_device(name: str, variant: str) -> list[tuple[str, str, str]]:
    """(dtype, status, detail) for each dtype the OpInfo supports; status as in test_ops_opinfo."""
    import torch

    import test_ops_opinfo as base
    import tpudist.device  # noqa: F401
    from tpudist.ops.opcheck import compare

    info = _find(name, variant)
    supported = info.supported_dtypes("cpu")
    results = []
    for dtype in (getattr(torch, n) for n in DTYPE_NAMES):
        if dtype not in supported:
            continue
        try:
            samples = list(itertools.islice(info.sample_inputs("cpu", dtype, requires_grad=False), SAMPLES))
        except Exception as err:  # noqa: BLE001 - the OpInfo cannot make a sample here
            results.append((str(dtype), "reference_error", f"sample_inputs: {type(err).__name__}"))
            continue
        if not samples:
            results.append((str(dtype), "no_samples", ""))
            continue
        for i, sample in enumerate(samples):
            status, detail = _run_sample(info, sample, dtype, base, compare)
            results.append((str(dtype) if i == 0 else f"{dtype} sample {i}", status, detail))
    return results


def _run_sample(info, sample, dtype, base, compare):
    import torch

    try:
        torch.manual_seed(0)
        if (info.name, dtype) in base.FLOAT32_REFERENCE:
            expected = base.op_of(info)(sample.input.float(), *sample.args, **sample.kwargs).to(dtype)
        else:
            expected = base.op_of(info)(sample.input, *sample.args, **sample.kwargs)
    except Exception as err:  # noqa: BLE001 - torch rejects the sample: nothing to compare
        return "reference_error", type(err).__name__
    # torch requires some arguments on the host whatever the device (tensor_split's sections, as on CUDA)
    host_args = info.name in HOST_ARGS
    device_sample = (_to(sample.input, "tpu"), *(_to((sample.args, sample.kwargs), "tpu") if not host_args
                                                  else (sample.args, sample.kwargs)))
    try:
        torch.manual_seed(0)
        actual = base.op_of(info)(device_sample[0], *device_sample[1], **device_sample[2])
        actual = _to(actual, "cpu")
    except NotImplementedError as err:
        return "unsupported", str(err).splitlines()[0][:200]
    except TypeError as err:
        if "has no JAX equivalent" not in str(err):  # complex32, uint64...: a dtype XLA lacks
            return "error", f"TypeError: {str(err)[:300]}"
        return "unsupported", str(err).split(";")[0]
    except Exception as err:  # noqa: BLE001 - reported with its message
        return "error", f"{type(err).__name__}: {str(err)[:300]}"
    if info.name in base.TIES and isinstance(expected, (tuple, list)):  # median() of everything: one tensor
        expected, actual = expected[0], actual[0]
    for (op_name, index), _reason in base.DTYPE_DEVIATIONS.items():
        if op_name == info.name and isinstance(actual, (list, tuple)) and index < len(actual):
            actual = list(actual)
            actual[index] = actual[index].to(expected[index].dtype)
    bounded = base.ERROR_BOUND.get((info.name, dtype))
    if bounded is not None:  # within the algorithm's error bound of float64 (forward only here)
        why = compare(expected, actual, values=False) or bounded(sample, dtype, actual, None)
    else:
        atol = 1e-5 if info.name in base.ACCUMULATING and dtype == torch.float32 else None
        why = compare(expected, actual, values=info.name not in base.RANDOM, atol=atol)
    return ("pass", "") if why is None else ("mismatch", why)


# -- tests --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=600, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a: pool.run(fn, *a)[0]


OUTCOMES: dict = {}


@pytest.mark.parametrize("name,variant", SELECTION, ids=[f"{n}.{v}" if v else n for n, v in SELECTION])
def test_opinfo_on_device(dev, name, variant):
    outcomes = OUTCOMES[(name, variant)] = dev(run_opinfo_on_device, name, variant)
    bad = [o for o in outcomes if o[1] in ("mismatch", "error")]
    assert not bad, "\n".join(f"{d}: {s}: {detail}" for d, s, detail in bad)
    if outcomes and all(o[1] == "unsupported" for o in outcomes):
        pytest.skip(f"not on the device: {outcomes[0][2]}")


@pytest.fixture(scope="module", autouse=True)
def summary():
    """Prints the counts of the OpInfos run in this module when it ends (shown with ``-s``)."""
    yield
    if not OUTCOMES:
        return
    per_op = collections.Counter()
    failing = []
    for key, outcomes in OUTCOMES.items():
        statuses = {s for _, s, _ in outcomes}
        kind = ("fail" if statuses & {"mismatch", "error"} else
                "unsupported" if statuses == {"unsupported"} else "pass")
        per_op[kind] += 1
        if kind == "fail":
            failing.append(".".join(filter(None, key)))
    samples = collections.Counter(s for outcomes in OUTCOMES.values() for _, s, _ in outcomes)
    print(f"\nOpInfo on the tpu device: {len(OUTCOMES)} OpInfos: {dict(per_op)}; samples: {dict(samples)}"
          f"\nfailing: {' '.join(failing)}")
