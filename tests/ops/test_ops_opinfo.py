"""PyTorch's OpInfo samples through tpudist.ops, compared with CPU eager torch (values and dtypes).

Each selected OpInfo runs its first sample for each of bool, int32, int64, bfloat16 and float32 that it
supports: the sample's tensors become ``JaxValue``s and the op runs under ``JaxMode`` inside one
``jax.jit`` (every aten op it reaches goes through ``tpudist.ops.call``); data-dependent ops fall back to
eager. The first float32 sample of an op with autograd also runs its backward, which exercises the
``*_backward`` lowerings. Samples whose op reaches an aten op with no lowering are skipped with that op
as the reason; a wrong value, dtype or shape, or an error torch does not raise, fails.

Selection keeps the suite inside its time budget: the OpInfos whose aten op has a lowering, plus the
ones listed in ``EXTRA`` (ops the device and compile paths need that reach lowerings by another name).
``TPUDIST_OPS_ALL=1`` runs every OpInfo in op_db (several minutes).
``test_every_lowering_is_exercised`` fails when a registered lowering is reached by no sample here and
no hand-written case in ``test_ops_lowerings.py``; it prints the coverage summary. Under pytest-xdist it
reads what the other workers' ``test_opinfo`` cases already ran (``_publish``) and runs only the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import sys
import time
import warnings

import pytest
import torch

from tpudist.ops import UnsupportedOp, lowered_ops
from tpudist.ops.opcheck import Recorder, compare, recording, run_on_jax

warnings.filterwarnings("ignore", category=UserWarning)
from torch.testing._internal.common_methods_invocations import (  # noqa: E402  (slow import: ~7 s)
    foreach_binary_op_db, foreach_other_op_db, foreach_pointwise_op_db, foreach_reduce_op_db,
    foreach_unary_op_db, op_db)

# OpInfo's sample generators crawl the whole Python stack (inspect.stack) on every call to find the
# unittest method running them, which costs ~50 ms per sample here: there is none to find under pytest.
import torch.testing._internal.common_utils as _common_utils  # noqa: E402
import torch.testing._internal.opinfo.core as _opinfo_core  # noqa: E402

_common_utils.extract_test_fn = _opinfo_core.extract_test_fn = lambda: None

FOREACH_DB = (foreach_unary_op_db + foreach_binary_op_db + foreach_pointwise_op_db + foreach_reduce_op_db
              + foreach_other_op_db)

DTYPES = (torch.bool, torch.int32, torch.int64, torch.bfloat16, torch.float32)

EXTRA = {
    "__getitem__", "index_put", "item", "T", "to", "clone", "contiguous", "matmul", "softmax", "log_softmax",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.embedding", "nn.functional.dropout",
    "nn.functional.layer_norm", "nn.functional.scaled_dot_product_attention", "nn.functional.conv2d",
    "nn.functional.conv1d", "nn.functional.conv_transpose2d", "nn.functional.linear", "nn.functional.gelu",
    "nn.functional.silu", "nn.functional.relu", "nn.functional.elu", "nn.functional.hardswish",
    "nn.functional.hardsigmoid", "nn.functional.mish", "nn.functional.softplus", "nn.functional.leaky_relu",
    "nn.functional.hardtanh", "nn.functional.threshold", "nn.functional.glu", "nn.functional.pad", "flatten",
    "unflatten", "chunk", "reshape", "view", "view_as", "expand_as", "masked_select", "nonzero", "where",
    "sigmoid", "tanh", "mT", "mH", "movedim", "narrow", "tensor_split", "rand_like", "randn_like",
    "bernoulli", "randint_like", "zeros_like", "ones_like", "full_like", "new_full", "new_zeros", "new_ones",
    "new_empty", "empty_like", "linspace", "eye", "trace", "outer", "logit", "nn.functional.avg_pool1d",
    "nn.functional.avg_pool2d", "nn.functional.avg_pool3d", "nn.functional.adaptive_avg_pool1d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.adaptive_avg_pool3d", "fft.fft", "fft.rfft", "fft.irfft",
    "fft.fft2", "fft.ifft", "fft.rfftn", "fft.hfft", "cdist", "nn.functional.pdist", "angle",
    "view_as_real", "view_as_complex", "equal", "index_reduce", "matrix_exp",
    "linalg.svd", "linalg.eigh", "linalg.solve", "linalg.det", "linalg.slogdet", "linalg.inv", "linalg.cholesky",
    "special.modified_bessel_i0", "special.modified_bessel_i1", "special.spherical_bessel_j0", "fft.ihfft2",
}
# Ops whose values are random or uninitialised: only dtypes and shapes are compared.
RANDOM = {"bernoulli", "rand_like", "randn_like", "randint_like", "randint", "nn.functional.dropout", "empty",
          "empty_like", "new_empty", "new_empty_strided", "empty_strided", "normal", "uniform", "exponential",
          "multinomial", "randn", "rand", "empty_permuted", "nn.functional.rrelu", "nn.functional.alpha_dropout",
          "nn.functional.feature_alpha_dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
          "cauchy", "geometric", "log_normal", "randperm",
          "nn.functional.multi_head_attention_forward",  # its samples train with dropout
          "svd_lowrank", "pca_lowrank"}  # random projections (torch.randn inside)


def _column_signs(vectors):
    """Each column's phase (sign, for real) at its largest-magnitude element: singular and eigen vectors
    are unique only up to it, and LAPACK implementations (MKL, OpenBLAS) and TPU algorithms choose
    differently."""
    index = vectors.abs().argmax(dim=-2, keepdim=True)
    pivot = vectors.gather(-2, index)
    magnitude = pivot.abs()
    return torch.where(magnitude == 0, torch.ones_like(pivot), pivot / magnitude).conj()


def _eigh_canonical(out):
    values, vectors = out
    if vectors.numel() == 0:
        return out
    return values, vectors * _column_signs(vectors)


def _svd_canonical(out, v_transposed):
    """The first k = min(m, n) singular vectors (the rest of a full U or V is any orthonormal completion,
    compared as it comes)."""
    u, s, v = out
    k = s.shape[-1]
    if u.numel() == 0 or k == 0:
        return out
    signs = _column_signs(u[..., :k])
    u = torch.cat([u[..., :k] * signs, u[..., k:]], dim=-1)
    if v_transposed:
        return u, s, torch.cat([v[..., :k, :] * signs.mT.conj(), v[..., k:, :]], dim=-2)
    return u, s, torch.cat([v[..., :k] * signs.conj(), v[..., k:]], dim=-1)


# Ops whose vectors are unique up to a sign or phase per vector: both sides are compared (and
# differentiated) after this canonical choice, a function of torch tensors.
CANONICAL = {"linalg.eigh": _eigh_canonical, "linalg.svd": lambda out: _svd_canonical(out, True),
             "svd": lambda out: _svd_canonical(out, False)}


def op_of(info):
    """The OpInfo's op, followed by its canonical form where it has one."""
    canonical = CANONICAL.get(info.name)
    if canonical is None:
        return info.op

    def op(*args, **kwargs):
        out = info.op(*args, **kwargs)
        return canonical(out) if isinstance(out, tuple) and len(out) in (2, 3) and out[-1].ndim else out
    return op


# Ops whose indices are implementation-defined where values tie: values only (plus dtypes and shapes).
TIES = {"sort", "argsort", "topk", "kthvalue", "msort", "median", "nanmedian", "mode"}
# Ops that sum many products: XLA's and MKL's summation orders differ, so float32 gets atol 1e-5
# (torch's own default) instead of 1e-6.
ACCUMULATING = {"mm", "bmm", "matmul", "addmm", "addmv", "addbmm", "baddbmm", "mv", "dot", "vdot", "inner",
                "_foreach_mm", "nn.functional.linear", "nn.functional.conv1d", "nn.functional.conv2d",
                "nn.functional.conv_transpose2d", "nn.functional.scaled_dot_product_attention", "einsum",
                "tensordot", "trace", "addr", "outer", "linalg.vector_norm", "cumsum", "sum", "mean", "var",
                "std", "var_mean", "std_mean", "logsumexp", "prod", "cumprod", "nn.functional.layer_norm",
                "native_layer_norm", "softmax", "log_softmax", "nn.functional.cross_entropy"}
# Gradients whose CPU float32 kernel is itself this far off: (rtol, atol) and the measurement.
# ctc_loss (T=50, N=16, C=20): CPU float32 is 2.2e-5 from its own float64 result, the lowering 4.6e-6.
GRAD_TOL = {"nn.functional.ctc_loss": (1e-4, 5e-5)}


def _expm_frechet_norm(m: torch.Tensor) -> float:
    """||L(M)||_2 for a float64 square matrix M: the spectral norm of expm's Frechet derivative at M, from its
    n^2 x n^2 Kronecker form, whose column k is L(M, E_k): the upper-right block of expm([[M, E_k], [0, M]])."""
    n = m.shape[-1]
    block = torch.zeros(n * n, 2 * n, 2 * n, dtype=torch.float64)
    block[:, :n, :n] = block[:, n:, n:] = m
    block[:, :n, n:] = torch.eye(n * n, dtype=torch.float64).view(n * n, n, n)
    return torch.linalg.matrix_norm(torch.linalg.matrix_exp(block)[:, :n, n:].reshape(n * n, n * n).T, 2).item()


def _matrix_exp_error(sample, dtype, actual, actual_grads) -> str | None:
    """matrix_exp in float32 against float64, within its algorithm's error bound (elementwise tolerances set
    from one CPU's output failed on another: the gradient's small elements carry the error of its large ones).

    expm by scaling and squaring with a [13/13] Pade approximant (JAX's, torch's) is backward stable: its
    truncation error is a perturbation of M of at most u||M|| (Higham 2005, theta_13), its rounding a
    perturbation of O(n u)||M||; to first order the result is off by L(M, dM), so the Frobenius error is at most
    2n u ||L(M)||_2 ||M||_F, with u the dtype's unit roundoff. The gradient of sum(expm(A)) / 2 is the
    upper-right block of expm(B), B = [[A^T, G], [0, A^T]], G = 1/2 everywhere (torch's backward and JAX's
    Frechet derivative both compute that block matrix's exponential): the same bound with B for M."""
    u = torch.finfo(dtype).eps / 2
    a = sample.input.detach().to(torch.float64)
    want = torch.linalg.matrix_exp(a)
    half = torch.full(a.shape, 0.5, dtype=torch.float64)
    want_grad = torch.func.vjp(torch.linalg.matrix_exp, a)[1](half)[0]
    got_grad = actual_grads[0] if actual_grads else None
    n = a.shape[-1]
    for i, m in enumerate(a.reshape(-1, n, n)):
        block = torch.zeros(2 * n, 2 * n, dtype=torch.float64)
        block[:n, :n] = block[n:, n:] = m.T
        block[:n, n:] = 0.5
        checks = [("value", actual, want, m)] + ([("gradient", got_grad, want_grad, block)] if got_grad is not None
                                                 else [])
        for what, got, ref, perturbed in checks:
            error = torch.linalg.matrix_norm(got.reshape(-1, n, n)[i].to(torch.float64) - ref.reshape(-1, n, n)[i])
            bound = 2 * n * u * _expm_frechet_norm(perturbed) * torch.linalg.matrix_norm(perturbed)
            if not error <= bound:
                return f"{what} of matrix {i}: Frobenius error {error:.3g} > bound 2 n u ||L(M)|| ||M|| = {bound:.3g}"
    return None


# Ops compared with float64 within an error bound of their algorithm, in these dtypes, instead of with CPU's result.
ERROR_BOUND = {("matrix_exp", torch.float32): _matrix_exp_error}
# Ops whose backward is not compared, with the reason.
NO_GRAD = {
    "as_strided": "as_strided's backward views a storage-sized buffer; JaxValues have no storage",
    "as_strided_copy": "as_strided's backward views a storage-sized buffer; JaxValues have no storage",
    "as_strided_scatter": "as_strided's backward views a storage-sized buffer; JaxValues have no storage",
}
# CPU kernels that are wrong in a low-precision dtype: the reference is the float32 result rounded to it.
FLOAT32_REFERENCE = {("matrix_exp", torch.bfloat16): "CPU bf16 gives NaN on the OpInfo samples, float32 is finite"}
# Known, intended differences from the CPU kernel: (op name, output index) -> reason.
DTYPE_DEVIATIONS = {
    ("native_layer_norm", 1): "mean/rstd of bf16 input are float32, as torch's meta (and CUDA) kernel says",
    ("native_layer_norm", 2): "mean/rstd of bf16 input are float32, as torch's meta (and CUDA) kernel says",
}


def _selected():
    if os.environ.get("TPUDIST_OPS_ALL"):
        return list(op_db) + FOREACH_DB
    packets = {str(op).split(".")[1] for op in lowered_ops() if str(op).startswith("aten.")}
    return [info for info in op_db + FOREACH_DB
            if info.aten_name in packets or info.name in packets or info.name in EXTRA]


SELECTED = _selected()
RECORDER = Recorder()


@dataclasses.dataclass(frozen=True)
class Outcome:
    dtype: torch.dtype
    status: str  # pass | mismatch | error | unsupported | reference_error | no_samples
    detail: str = ""


def _grads(fn, sample, outputs):
    """Gradients of sum(float outputs * 1/(i+2)) with respect to the sample's float inputs."""
    leaves = [x for x in [sample.input, *sample.args] if isinstance(x, torch.Tensor) and x.requires_grad]
    flat = [o for o in (outputs if isinstance(outputs, (tuple, list)) else [outputs])
            if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad]
    if not leaves or not flat:
        return None
    total = sum((o * (1.0 / (i + 2))).sum() for i, o in enumerate(flat))
    return torch.autograd.grad(total, leaves, allow_unused=True)


def _run_sample(info, sample, dtype, with_grad):
    fn = op_of(info)
    random = info.name in RANDOM
    try:
        if (info.name, dtype) in FLOAT32_REFERENCE:
            expected = fn(sample.input.float(), *sample.args, **sample.kwargs).to(dtype)
        else:
            expected = fn(sample.input, *sample.args, **sample.kwargs)
        expected_grads = _grads(fn, sample, expected) if with_grad else None
    except Exception as err:  # noqa: BLE001  (torch rejects the sample: nothing to compare)
        return Outcome(dtype, "reference_error", f"{type(err).__name__}")

    def both(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out, _grads(fn, _Sample(args[0], args[1:]), out) if with_grad else None

    try:
        actual, actual_grads = run_on_jax(both, sample.input, *sample.args, **sample.kwargs)
    except UnsupportedOp as err:
        return Outcome(dtype, "unsupported", str(err.reached))
    except Exception as err:  # noqa: BLE001  (reported as a failure with its message)
        if "data is not allocated yet" in str(err):  # a C++ kernel read a tensor argument's data directly
            return Outcome(dtype, "unsupported", "a C++ kernel reading a tensor argument on the host")
        return Outcome(dtype, "error", f"{type(err).__name__}: {str(err)[:300]}")
    if info.name in TIES and isinstance(expected, (tuple, list)):  # median() of everything: one tensor
        expected, actual = expected[0], actual[0]
    for (name, index), _reason in DTYPE_DEVIATIONS.items():
        if name == info.name and isinstance(actual, (list, tuple)) and index < len(actual):
            actual = list(actual)
            actual[index] = actual[index].to(expected[index].dtype)
    bounded = ERROR_BOUND.get((info.name, dtype))
    if bounded is not None:
        why = (compare(expected, actual, values=False)
               or compare([g for g in expected_grads or () if g is not None],
                          [g for g in actual_grads or () if g is not None], values=False)
               or bounded(sample, dtype, actual, actual_grads))
        return Outcome(dtype, "pass" if why is None else "mismatch", why or "")
    atol = 1e-5 if info.name in ACCUMULATING and dtype == torch.float32 else None
    why = compare(expected, actual, values=not random, atol=atol)
    if why is None and expected_grads is not None:
        # gradients go through several ops (and torch's backward formulas): 1e-4 relative, 1e-5 absolute
        why = compare([g for g in expected_grads if g is not None], [g for g in actual_grads if g is not None],
                      values=not random, **dict(zip(("rtol", "atol"), GRAD_TOL.get(info.name, (1e-4, 1e-5)))))
        why = None if why is None else f"gradient: {why}"
    return Outcome(dtype, "pass" if why is None else "mismatch", why or "")


@dataclasses.dataclass
class _Sample:
    input: object
    args: tuple


@functools.cache
def run_opinfo(index: int) -> tuple:
    info = SELECTED[index]
    outcomes = []
    supported = info.supported_dtypes("cpu")
    foreach = info.name.startswith("_foreach_")
    for dtype in DTYPES:
        if dtype not in supported:
            continue
        with_grad = (dtype == torch.float32 and info.supports_autograd and not foreach
                     and info.name not in RANDOM and info.name not in NO_GRAD)
        # foreach OpInfos cycle through their overloads (Scalar, List, ScalarList, Tensor) sample by sample
        count = 6 if foreach and dtype == torch.float32 else 1
        extra = {"num_input_tensors": [2]} if foreach else {}
        try:
            samples = [s for _, s in zip(range(count), info.sample_inputs("cpu", dtype, requires_grad=with_grad,
                                                                           **extra))]
        except Exception as err:  # noqa: BLE001
            outcomes.append(Outcome(dtype, "reference_error", f"sample_inputs: {type(err).__name__}"))
            continue
        if not samples:
            outcomes.append(Outcome(dtype, "no_samples"))
        for sample in samples:
            with recording(RECORDER):
                outcomes.append(_run_sample(info, sample, dtype, with_grad))
    return tuple(outcomes)


def _id(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


# Under pytest-xdist the test_opinfo cases are spread over the workers and test_every_lowering_is_exercised
# runs on one of them, which ran every OpInfo another worker had already run a second time (139 s of a CI
# run). Each worker now publishes what it ran (outcomes, and the lowerings its samples reached) to a file
# in the run's temporary directory, which xdist's workers share; the coverage check takes those and runs
# only the OpInfos no worker has run yet, and test_ops_lowerings' cases only if the lowerings they reached
# on the workers that ran them (published too) leave one uncovered. A file is rewritten whole (os.replace)
# after every case, so a reader sees, for each worker, the outcomes and lowerings of the same finished cases.
_RUN_HERE: set[int] = set()


def _shared_dir(tmp_path_factory):
    """The directory the workers of this xdist run share (their basetemps' parent), or None without xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    path = tmp_path_factory.getbasetemp().parent / f"opinfo-{os.environ.get('PYTEST_XDIST_TESTRUNUID', '')}"
    path.mkdir(exist_ok=True)
    return path


def _publish(tmp_path_factory):
    shared = _shared_dir(tmp_path_factory)
    if shared is None:
        return
    outcomes = {i: [[str(o.dtype), o.status, o.detail] for o in run_opinfo(i)] for i in sorted(_RUN_HERE)}
    seen = set(RECORDER.seen)
    if "test_ops_lowerings" in sys.modules:  # its cases this worker ran (collected before these, so mostly all)
        seen |= sys.modules["test_ops_lowerings"].RECORDER.seen
    data = json.dumps({"outcomes": outcomes, "seen": sorted(str(op) for op in seen)})
    mine = shared / f"{os.environ['PYTEST_XDIST_WORKER']}.json"
    partial = mine.with_suffix(".partial")
    partial.write_text(data)
    os.replace(partial, mine)


def _published(tmp_path_factory) -> tuple[dict[int, tuple], set[str]]:
    """What the workers of this run have published: outcomes by OpInfo index, and the lowerings their
    test_opinfo and test_ops_lowerings cases reached."""
    shared = _shared_dir(tmp_path_factory)
    outcomes, seen = {}, set()
    for path in sorted(shared.glob("*.json")) if shared is not None else ():
        data = json.loads(path.read_text())
        seen.update(data["seen"])
        for index, per_dtype in data["outcomes"].items():
            outcomes[int(index)] = tuple(Outcome(dtype, status, detail) for dtype, status, detail in per_dtype)
    return outcomes, seen


@pytest.mark.parametrize("index", range(len(SELECTED)), ids=[_id(i) for i in SELECTED])
def test_opinfo(index, tmp_path_factory):
    outcomes = run_opinfo(index)
    _RUN_HERE.add(index)
    _publish(tmp_path_factory)
    bad = [o for o in outcomes if o.status in ("mismatch", "error")]
    assert not bad, "\n".join(f"{o.dtype}: {o.status}: {o.detail}" for o in bad)
    if outcomes and all(o.status == "unsupported" for o in outcomes):
        pytest.skip(f"reaches an op with no lowering: {outcomes[0].detail}")


def _aten_lowerings() -> set:
    """The table's aten and prims lowerings (custom kernels' lowerings are their own tests' business)."""
    return {op for op in lowered_ops() if op.namespace in ("aten", "prims")}


@pytest.mark.timeout(1500)  # under xdist it may run every OpInfo itself (6 min alone, more on a loaded machine)
def test_every_lowering_is_exercised(tmp_path_factory):
    started = time.perf_counter()
    elsewhere, seen_elsewhere = _published(tmp_path_factory)  # other xdist workers' test_opinfo cases
    outcomes = [run_opinfo(i) if i in _RUN_HERE or i not in elsewhere else elsewhere[i]
                for i in range(len(SELECTED))]
    import test_ops_lowerings  # the hand-written cases for ops no OpInfo reaches

    table = {str(op) for op in _aten_lowerings()}
    seen = {str(op) for op in RECORDER.seen} | seen_elsewhere
    if table - seen - {str(op) for op in test_ops_lowerings.RECORDER.seen}:
        # its tests did not run in this process (-k, xdist): run its cases here
        with recording(test_ops_lowerings.RECORDER):
            test_ops_lowerings.run_all_cases()
    seen |= {str(op) for op in test_ops_lowerings.RECORDER.seen}
    counts = collections.Counter(o.status for per_op in outcomes for o in per_op)
    reasons = collections.Counter(o.detail for per_op in outcomes for o in per_op if o.status == "unsupported")
    ops_passing = sum(1 for per_op in outcomes if per_op and all(o.status in ("pass", "reference_error",
                                                                               "no_samples") for o in per_op))
    missing = sorted(table - seen)
    print(f"\nOpInfo coverage: {len(SELECTED)} OpInfos ({len(set(elsewhere) - _RUN_HERE)} run by other "
          f"workers), {ops_passing} with every sample passing; samples: {dict(counts)}; lowerings exercised "
          f"{len(seen & table)}/{len(table)} ({time.perf_counter() - started:.0f} s for what had not run yet)")
    for reason, n in reasons.most_common():
        print(f"  skipped {n:3d} samples: reaches {reason} (no lowering)")
    assert not missing, f"{len(missing)} registered lowerings are exercised by no test: {missing}"
