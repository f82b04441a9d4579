"""Where real models go on the "tpu" device: recurrent layers, complex numbers (RoPE), runtime
assertions, the CPU fallback and the ``torch.tpu`` memory/properties API, against CPU eager torch.

As in ``test_device.py``, every case runs in one worker process (a ``RankPool`` of one rank without a
process group) that imports ``tpudist.device``; this pytest process never does.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tpudist.testing import RankPool

MODES = ("strict", "fused")
ALL_MODES = ("debug", "strict", "fused")  # where debug is cheap (a few small ops)


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _max_diff(expected, actual) -> float:
    return max((e.float() - a.cpu().float()).abs().max().item() if e.numel() else 0.0
               for e, a in zip(expected, actual))


# -- recurrent layers ----------------------------------------------------------------------------------

RNN_CASES = [  # (module, constructor kwargs, lengths of a packed batch or None)
    ("LSTM", {}, None),
    ("LSTM", {"num_layers": 2, "bidirectional": True, "batch_first": True}, None),
    ("LSTM", {"bias": False, "proj_size": 3}, None),
    ("LSTM", {"bidirectional": True}, [5, 2, 3]),
    ("GRU", {}, None),
    ("GRU", {"num_layers": 2, "bidirectional": True, "bias": False}, None),
    ("GRU", {"batch_first": True}, [4, 5, 1]),
    ("RNN", {"nonlinearity": "relu", "num_layers": 2}, None),
    ("RNN", {"bidirectional": True, "batch_first": True}, [3, 5, 2]),
]


def _run_rnn(module, kwargs, lengths, device, with_state):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    m = copy.deepcopy(module).to(device)
    batch_first = kwargs.get("batch_first", False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn((3, 5, 4) if batch_first else (5, 3, 4), generator=g).to(device).requires_grad_()
    state = None
    if with_state:
        layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
        h0 = torch.randn(layers, 3, kwargs.get("proj_size", 0) or 6, generator=g).to(device).requires_grad_()
        c0 = torch.randn(layers, 3, 6, generator=g).to(device).requires_grad_()
        state = (h0, c0) if isinstance(m, torch.nn.LSTM) else h0
    inp = x if lengths is None else pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first,
                                                        enforce_sorted=False)
    out, hn = m(inp, state)
    if lengths is not None:
        out = pad_packed_sequence(out, batch_first=batch_first)[0]
    hn = hn if isinstance(hn, tuple) else (hn,)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device)
    ((out * weights).sum() + sum((h * h).sum() for h in hn)).backward()
    inputs = [x] + (list(state) if isinstance(state, tuple) else [state] if state is not None else [])
    return [out.detach(), *(h.detach() for h in hn), *(t.grad for t in inputs), *(p.grad for p in m.parameters())]


def run_rnn_cases(mode):
    """Largest |device - CPU| over outputs, final states and gradients of each case."""
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    results = []
    before = torch.tpu.cache_stats()["cpu_fallback_ops"]
    with torch.tpu.eager_mode(mode):
        for i, (name, kwargs, lengths) in enumerate(RNN_CASES):
            module = getattr(torch.nn, name)(4, 6, **kwargs)
            with_state = i % 2 == 0
            expected = _run_rnn(module, kwargs, lengths, "cpu", with_state)
            actual = _run_rnn(module, kwargs, lengths, "tpu", with_state)
            results.append(_max_diff(expected, actual))
    after = torch.tpu.cache_stats()["cpu_fallback_ops"]
    return results, {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}


@pytest.mark.parametrize("mode", MODES)
def test_rnn_layers_match_cpu(dev, mode):
    diffs, fallbacks = dev(run_rnn_cases, mode)
    assert fallbacks == {}
    for (name, kwargs, lengths), diff in zip(RNN_CASES, diffs):
        assert diff < 1e-5, f"{name}({kwargs}, packed={lengths}): max |tpu - cpu| = {diff}"


def run_cells_and_double_backward():
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, h = torch.randn(3, 4, generator=g), torch.randn(3, 6, generator=g)
    diffs = {}
    for name in ("LSTMCell", "GRUCell", "RNNCell"):
        module = getattr(torch.nn, name)(4, 6)
        runs = []
        for device in ("cpu", "tpu"):
            m = copy.deepcopy(module).to(device)
            xd, hd = x.clone().to(device).requires_grad_(), h.clone().to(device).requires_grad_()
            out = m(xd, (hd, hd * 0.5)) if name == "LSTMCell" else (m(xd, hd),)
            sum((o * o).sum() for o in out).backward()
            runs.append([*(o.detach() for o in out), xd.grad, hd.grad, *(p.grad for p in m.parameters())])
        diffs[name] = _max_diff(*runs)
    for name in ("LSTM", "GRU"):  # create_graph: autograd takes the differentiable composite backward
        module = getattr(torch.nn, name)(4, 6)
        runs = []
        for device in ("cpu", "tpu"):
            m = copy.deepcopy(module).to(device)
            xd = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
            grad, = torch.autograd.grad(m(xd)[0].pow(2).sum(), xd, create_graph=True)
            grad.pow(2).sum().backward()
            runs.append([grad.detach(), xd.grad, *(p.grad for p in m.parameters())])
        diffs[f"{name} double backward"] = _max_diff(*runs)
    return diffs


def test_rnn_cells_and_double_backward_match_cpu(dev):
    for name, diff in dev(run_cells_and_double_backward).items():
        assert diff < 1e-5, f"{name}: max |tpu - cpu| = {diff}"


def run_bf16_lstm():
    import tpudist.device  # noqa: F401

    torch.manual_seed(0)
    module = torch.nn.LSTM(4, 6)
    runs = []
    for device in ("cpu", "tpu"):
        m = copy.deepcopy(module).to(device).bfloat16()
        x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
        runs.append([m(x)[0].detach()])
    return _max_diff(*runs), runs[1][0].dtype


def test_bf16_lstm_within_bf16_rounding_of_cpu(dev):
    # CPU rounds after each op of its unfused cell; the device computes the cell in float32 and rounds once
    diff, dtype = dev(run_bf16_lstm)
    assert dtype == torch.bfloat16 and diff <= 2 ** -6


# -- complex numbers -------------------------------------------------------------------------------------


def _complex_cases():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    z = torch.complex(x, y)

    def write_parts(d):
        c = z.clone().to(d)
        c.real.mul_(2)
        c.imag[0] = 5.0
        return c

    def write_complex_view(d):
        r = x.clone().to(d).reshape(3, 2, 2)
        torch.view_as_complex(r).mul_(1j)
        return r

    def write_byte_view(d):
        f = torch.zeros(2).to(d)
        f.view(torch.uint8)[3] = 63  # the high byte of element 0: 0.5
        return f

    def rope(d):
        xq = x.clone().reshape(1, 3, 1, 4).to(d).requires_grad_()
        freqs = torch.outer(torch.arange(3, device=d).float(),
                            1.0 / (10000 ** (torch.arange(0, 4, 2, device=d).float() / 4)))
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs).view(1, 3, 1, 2)
        xq_ = torch.view_as_complex(xq.float().reshape(1, 3, 1, 2, 2))
        out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
        (out * torch.arange(12.0, device=d).reshape(1, 3, 1, 4)).sum().backward()
        return out.detach(), xq.grad

    def polar_grads(d):
        a, b = x.clone().to(d).requires_grad_(), y.clone().to(d).requires_grad_()
        w = torch.polar(a.abs() + 0.1, b) * torch.complex(b, a)
        (w.abs().sum() + w.angle().sum() + w.real.sum() - w.imag.sum()).backward()
        return a.grad, b.grad

    return {
        "to_and_back": lambda d: z.to(d),
        "complex": lambda d: torch.complex(x.to(d), y.to(d)),
        "polar": lambda d: torch.polar(x.abs().to(d), y.to(d)),
        "mul_add": lambda d: z.to(d) * z.flip(0).to(d) + 1j,
        "abs_angle": lambda d: (z.to(d).abs(), z.to(d).angle()),
        "real_imag": lambda d: (z.to(d).real, z.to(d).imag * 2),
        "view_as_real": lambda d: torch.view_as_real(z.to(d)),
        "view_as_complex": lambda d: torch.view_as_complex(x.to(d).reshape(3, 2, 2)),
        "conj": lambda d: (z.to(d).conj() * 1, z.to(d).conj()),
        "write_parts": write_parts,
        "write_complex_view": write_complex_view,
        "uint8_view": lambda d: x.to(d).view(torch.uint8)[1:],
        "bool_byte_views": lambda d: (torch.tensor([True, False, True]).to(d).view(torch.int8),
                                      torch.tensor([1, 0, 1], dtype=torch.uint8).to(d).view(torch.bool)),
        "write_byte_view": write_byte_view,
        "rope": rope,
        "polar_grads": polar_grads,
    }


def run_complex_cases(mode):
    import tpudist.device  # noqa: F401
    from torch.utils._pytree import tree_flatten

    results = {}
    with torch.tpu.eager_mode(mode):
        for name, fn in _complex_cases().items():
            expected, actual = tree_flatten(fn("cpu"))[0], tree_flatten(fn("tpu"))[0]
            same_meta = all(e.dtype == a.dtype and e.shape == a.shape for e, a in zip(expected, actual))
            results[name] = (same_meta, _max_diff([e if not e.is_complex() else torch.view_as_real(e.resolve_conj())
                                                   for e in expected],
                                                  [a.cpu() if not a.is_complex() else
                                                   torch.view_as_real(a.cpu().resolve_conj()) for a in actual]))
    return results


@pytest.mark.parametrize("mode", ALL_MODES)
def test_complex_tensors_match_cpu(dev, mode):
    for name, (same_meta, diff) in dev(run_complex_cases, mode).items():
        assert same_meta, f"{name}: dtypes or shapes differ from CPU"
        assert diff < 1e-5, f"{name}: max |tpu - cpu| = {diff}"


# -- runtime assertions ----------------------------------------------------------------------------------


def run_assertions(mode):
    import tpudist.device  # noqa: F401

    aten = torch.ops.aten
    outcomes = {}

    def attempt(name, fn):
        try:
            fn()
            torch.tpu.synchronize()
            outcomes[name] = "ok"
        except RuntimeError as e:
            outcomes[name] = str(e)

    with torch.tpu.eager_mode(mode):
        attempt("true", lambda: torch._assert_async(torch.tensor(True, device="tpu")))
        attempt("zero", lambda: torch._assert_async(torch.tensor([1.0, 0.0], device="tpu")[1]))
        attempt("msg", lambda: aten._assert_async.msg(torch.tensor(0, device="tpu"), "custom message"))
        attempt("several", lambda: torch._assert_async(torch.ones(2, device="tpu")))
        attempt("functional", lambda: aten._functional_assert_async.msg(
            torch.tensor(False, device="tpu"), "functional message", torch.empty(0, device="tpu")).cpu())
        attempt("after", lambda: torch.ones(2, device="tpu").sum().item())
    return outcomes


@pytest.mark.parametrize("mode", ALL_MODES)
def test_assertions_raise_on_the_device(dev, mode):
    out = dev(run_assertions, mode)
    assert out["true"] == "ok" and out["after"] == "ok"
    assert "Expected Tensor with single nonzero value, but got zero" in out["zero"]
    assert "custom message" in out["msg"]
    assert "more than one value" in out["several"]
    assert "functional message" in out["functional"]


def run_host_check_waits(mode):
    """How often a program with an assert, then one without, waited for its host checks."""
    import tpudist.device  # noqa: F401
    from tpudist.ops import host_checks

    calls, real = [], host_checks.raise_failed
    host_checks.raise_failed = lambda: (calls.append(1), real())[1]
    try:
        if mode == "compiled":  # torch.linalg.inv checks its factorization's info on the host
            import tpudist.compile  # noqa: F401 - the "tpu" compile backend

            checked = torch.compile(torch.linalg.inv, backend="tpu", fullgraph=True, dynamic=False)
            plain = torch.compile(lambda x: x * 2, backend="tpu", fullgraph=True, dynamic=False)
        else:
            checked = lambda x: torch._assert_async((x + 1).sum())  # noqa: E731
            plain = lambda x: x * 2  # noqa: E731
        with torch.tpu.eager_mode("strict" if mode == "compiled" else mode):
            for _ in range(2):  # traced, then from the caches
                checked(torch.eye(3, device="tpu"))
                torch.tpu.synchronize()
            with_assert = len(calls)
            plain(torch.ones(3, device="tpu")).sum().item()
        return with_assert, len(calls) - with_assert
    finally:
        host_checks.raise_failed = real


@pytest.mark.parametrize("mode", [*ALL_MODES, "compiled"])
def test_a_program_with_an_assert_waits_for_its_host_check(dev, mode):
    # a TPU's runtime gives a failed host check's error to the program's runtime token alone, not to the
    # call (XLA:CPU raises it in the call): the device waits on the token after such a program, each run
    assert dev(run_host_check_waits, mode) == (2, 0)


# -- the CPU fallback ------------------------------------------------------------------------------------


def run_fallback():
    import warnings

    import tpudist.device  # noqa: F401
    from tpudist.ops import UnsupportedOp

    lib = torch.library.Library("tpudist_fallback_probe", "DEF")
    lib.define("cuda_only(Tensor x) -> Tensor")
    lib.impl("cuda_only", lambda x: x * 2, "CUDA")
    lib.define("cpu_only(Tensor x) -> Tensor")
    lib.impl("cpu_only", lambda x: x * 3, "CPU")
    lib.define("composite(Tensor x) -> Tensor")
    lib.impl("composite", lambda x: torch.ops.tpudist_fallback_probe.cpu_only(x) + 1, "CompositeExplicitAutograd")
    probe = torch.ops.tpudist_fallback_probe
    x = torch.arange(3.0, device="tpu")
    out = {}
    torch.tpu.set_cpu_fallback(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["cpu_only"] = [probe.cpu_only(x).cpu() for _ in range(2)][-1]
            out["composite"] = probe.composite(x).cpu()
            out["eig"] = torch.linalg.eigvals(_EIG.to("tpu")).cpu()  # an aten op with no lowering
        out["warnings"] = sorted(str(w.message).split(" has no")[0] for w in caught
                                 if "no JAX lowering" in str(w.message))
        try:
            probe.cuda_only(x)
        except UnsupportedOp as e:
            out["cuda_only"] = str(e)
    finally:
        torch.tpu.set_cpu_fallback(False)
    try:
        probe.cpu_only(x)
    except UnsupportedOp as e:
        out["off"] = str(e)
    return out


_EIG = torch.tensor([[2.0, 1.0], [1.0, 3.0]])


def test_cpu_fallback_runs_cpu_and_composite_kernels_and_names_ops_it_cannot(dev):
    out = dev(run_fallback)
    assert torch.equal(out["cpu_only"], torch.arange(3.0) * 3)
    assert torch.equal(out["composite"], torch.arange(3.0) * 3 + 1)
    assert torch.equal(out["eig"], torch.linalg.eigvals(_EIG))
    # one warning per op, however often it runs
    assert out["warnings"] == ["aten op aten._linalg_eigvals.default", "aten op tpudist_fallback_probe.cpu_only.default"]
    assert "tpudist_fallback_probe.cuda_only.default" in out["cuda_only"]
    assert "no CPU or composite kernel" in out["cuda_only"] and "@tpudist.ops.lowers" in out["cuda_only"]
    assert "tpudist_fallback_probe.cpu_only.default has no JAX lowering" in out["off"]


# -- torch.tpu: memory, properties, events -----------------------------------------------------------------


def run_memory_api():
    import gc

    import tpudist.device  # noqa: F401

    tpu = torch.tpu
    out = {}
    (torch.ones(1000, 257, device="tpu") * 2).sum().item()  # its programs loaded first: a TPU's allocator
    # counts them too
    gc.collect()
    tpu.synchronize()
    tpu.reset_peak_memory_stats()
    out["ooms_before"] = tpu.memory_stats()["num_ooms"]  # the process's: earlier tests may have raised some
    base = tpu.memory_allocated()
    x = torch.ones(1000, 257, device="tpu") * 2  # 1,028,000 bytes of float32 (one buffer: the product)
    tpu.synchronize()
    out["grown"] = tpu.memory_allocated() - base
    out["stats_with_x"] = tpu.memory_stats()
    del x
    gc.collect()
    out["after_del"] = tpu.memory_allocated() - base
    out["peak_over_base"] = tpu.max_memory_allocated() - base
    out["reserved"], out["max_reserved"] = tpu.memory_reserved(), tpu.max_memory_reserved()
    out["stats"] = tpu.memory_stats()
    tpu.reset_peak_memory_stats()
    out["peak_after_reset"] = tpu.max_memory_allocated() - tpu.memory_allocated()
    props = tpu.get_device_properties("tpu:0")
    out["props"] = (props.name, props.total_memory, props.multi_processor_count, props.major, props.is_emulated)
    out["name"], out["capability"] = tpu.get_device_name(), tpu.get_device_capability()
    out["mem_get_info"], out["bf16"] = tpu.mem_get_info(), tpu.is_bf16_supported()
    try:
        tpu.get_device_properties(1)
    except ValueError as e:
        out["bad_index"] = str(e)
    start, end = tpu.Event(enable_timing=True), tpu.Event(enable_timing=True)
    start.record()
    y = torch.randn(256, 256, device="tpu") @ torch.randn(256, 256, device="tpu")
    end.record()
    end.synchronize()
    out["elapsed"], out["query"] = start.elapsed_time(end), end.query()
    try:
        tpu.Event().elapsed_time(tpu.Event())
    except RuntimeError as e:
        out["untimed"] = str(e)
    out["stream"] = tpu.current_stream() == tpu.Stream()
    del y
    return out


def test_memory_stats_properties_and_events(dev):
    import os

    out = dev(run_memory_api)
    assert out["grown"] == 1000 * 257 * 4
    assert out["after_del"] == 0 and out["peak_over_base"] >= 1000 * 257 * 4
    with_x = out["stats_with_x"]
    assert with_x["active_bytes.all.current"] == with_x["allocated_bytes.all.current"] >= 1000 * 257 * 4
    stats = out["stats"]
    for key in ("active_bytes.all.peak", "active_bytes.all.current", "reserved_bytes.all.peak",
                "reserved_bytes.all.current", "allocated_bytes.all.peak", "num_alloc_retries", "num_ooms"):
        assert key in stats, key
    assert stats["active_bytes.all.peak"] >= with_x["active_bytes.all.current"]
    assert stats["reserved_bytes.all.peak"] == out["max_reserved"] >= out["reserved"]
    assert stats["num_alloc_retries"] == 0 and stats["num_ooms"] == out["ooms_before"]
    assert out["peak_after_reset"] == 0
    name, total, cores, major, emulated = out["props"]
    host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (name, total, cores, major, emulated) == ("cpu", host_total, len(os.sched_getaffinity(0)), 0, True)
    assert out["name"] == "cpu" and out["capability"] == (0, 0) and out["bf16"] is True
    free, total = out["mem_get_info"]
    assert total == host_total and 0 < free <= total
    assert "device index 1 does not exist" in out["bad_index"]
    assert out["elapsed"] > 0 and out["query"] is True
    assert "enable_timing=True" in out["untimed"]
    assert out["stream"]
