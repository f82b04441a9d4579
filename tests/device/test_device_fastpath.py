"""The C++ per-op signature (device/csrc/fastpath.cpp) against the Python one it replaces.

A wrong key runs the wrong kernel, silently. Every call of the device's signature during a set of
workloads (every argument kind: lists, keywords, CPU 0-dim scalars, complex conj/neg views, size-1
dims, static floats, devices, a model's training step in Strict and Fused, an optimizer) is checked:
the C++ result must equal the Python one element for element and type for type (torch.Size where
Python has torch.Size), with the same leaf, buffer and scalar objects.
"""

from __future__ import annotations

import pytest
import torch

from tpudist.testing import RankPool


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


def _same(a, b, path="result"):
    """'' if ``a`` and ``b`` are equal with the same types all the way down (and the same objects where
    they are not plain values), else where they differ."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} != {type(b).__name__} ({a!r} vs {b!r})"
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = _same(x, y, f"{path}[{i}]")
            if diff:
                return diff
        return ""
    if isinstance(a, (int, float, str, bool, type(None), torch.dtype)):
        return "" if a == b or (a != a and b != b) else f"{path}: {a!r} != {b!r}"
    return "" if a is b or a == b else f"{path}: {a!r} is not {b!r}"


def _workloads():
    import torch.nn.functional as F

    torch.manual_seed(0)  # the model's initialisation
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g).to("tpu"), torch.randn(6, 5, generator=g).to("tpu")
    i = torch.randint(-5, 5, (6, 5), generator=g).to("tpu")
    c = torch.randn(6, 4, dtype=torch.complex64, generator=g).to("tpu")
    outs = [
        a + b, a + a, a[:, 1:] * a[:, :-1], a[2:5] - b[1:4], a[:, -1:] + a[:, :1], a.t() @ b,
        a * 2.5 + 0.25, a + 3, a * torch.tensor(1.5), i + torch.tensor(7), a * torch.tensor(True),
        a + torch.tensor(0.1, dtype=torch.float64), c.conj() + c, c.conj().imag + a[:, :4], (-c.conj()).real,
        torch.cat([a, b], dim=1), torch.cat((a, b)), torch.stack([a, b, a], 0), torch.sum(a, dim=0, keepdim=True),
        *torch.max(a, dim=1), *torch._foreach_sqrt([a.abs(), b.abs()]), a.clone()[1:].add_(b[1:], alpha=0.5),
        torch.mul(a, b, out=torch.empty_like(a)), (a > 0).to(torch.float32) + i,
        torch.matmul(a.reshape(2, 3, 5), b.t()).mul_(2), torch.zeros(3, 4, device="tpu"),
        torch.full((2, 3), 1.5, device=torch.device("tpu")), torch.arange(5, device="tpu", dtype=torch.float64),
        a.new_zeros(torch.Size([2, 2])), a.unsqueeze(1).expand(6, 3, 5).sum(1), a.view(1, 30)[:, 3:9] * 2,
        torch.where(a > 0, a, b), torch.clamp(a, min=-0.5, max=0.5), F.softmax(a, -1), a.to(torch.bfloat16),
        torch.nn.Parameter(a.clone()) * 2, torch.addcmul(a, a, b, value=0.3), a.index_select(0, i[:, 0].abs()),
        F.pad(a, [1, 2]), a.sum(), a.mean(dim=[0, 1]),
        a.reshape(1, 6, 5, 1).contiguous(memory_format=torch.channels_last) * 2,  # a fresh output with strides
    ]
    outs.append(torch.tensor(3.0).to("tpu") * a)  # a 0-dim tpu tensor
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                                torch.nn.Linear(8, 3)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for mode in ("strict", "fused"):
        with torch.tpu.eager_mode(mode):
            for _ in range(2):
                loss = F.cross_entropy(model(a), i[:, 0].abs() % 3)
                loss.backward()
                opt.step()
                opt.zero_grad()
                outs.append(loss.detach())
            outs.extend([a * 0.5, c * c.conj(), torch.cat([a, b])])
    return [o.cpu() for o in outs]


def _compare_every_call():
    """Runs the workloads with every signature call checked; (calls, first differences, fast in use)."""
    from tpudist.device import _core, _execute

    if _core._fast is None:
        return 0, [], False
    fast, python = _core._fast.signature, _core._signature_py
    checked, diffs = [0], []

    def both(op, args, kwargs, static_floats):
        want = python(op, args, kwargs, static_floats)
        got = fast(op, args, kwargs, static_floats)
        checked[0] += 1
        diff = _same(got, want)
        if diff and len(diffs) < 5:
            diffs.append(f"{op}: {diff}")
        return want

    # every op's signature (_execute) and kernel_for's (growing appends, retries: _core)
    _core._signature = _execute._signature = both
    try:
        _workloads()
        # static floats (ops whose floats are constants), kwargs with lists, devices, an unhashable leaf
        x = torch.ones(2, 3, device="tpu")
        direct = [
            (torch.ops.aten.add.Tensor, (x, x), {"alpha": 2.0}, True),
            (torch.ops.aten.add.Tensor, (x, 1.5), {}, True),
            (torch.ops.aten.add.Tensor, (x, 1.5), {}, False),
            (torch.ops.aten.cat.default, ([x, x],), {"dim": 1}, False),
            (torch.ops.aten.full.default, ([2, 3], 1.0), {"device": torch.device("tpu"), "dtype": torch.float32},
             False),
            (torch.ops.aten.full.default, ([2, 3], 1.0), {"device": torch.device("cpu")}, False),
            (torch.ops.aten.zeros.default, ([[2, 3]],), {}, False),
            (torch.ops.aten.add.Tensor, (x, torch.tensor(2.0)), {}, True),
            (torch.ops.aten.add.Tensor, (x, torch.tensor(2.0, dtype=torch.float64)), {}, False),
            (torch.ops.aten.add.Tensor, (torch.nn.Parameter(x.clone()), x.t().t()), {}, False),
            (torch.ops.aten.add.Tensor, (x, torch.tensor(2)), {}, False),
            (torch.ops.aten.mul.Tensor, (x[:, :1], x[:1]), {}, False),
            (torch.ops.aten.sum.dim_IntList, (x, [0]), {"keepdim": True, "dtype": None}, False),
            (torch.ops.aten.sum.dim_IntList, (x, (0, 1)), {}, False),
            (torch.ops.aten.add.Tensor, (x, 2 ** 70), {}, False),
            (torch.ops.aten.add.Tensor, (x, True), {}, False),
            (torch.ops.aten.add.Tensor, (x, True), {}, True),
            (torch.ops.aten.add.Tensor, (x, 1j), {}, False),
            (torch.ops.aten.add.Tensor, (x, complex(2, 0)), {}, True),
            (torch.ops.aten.add.Tensor, (x, torch.nan), {}, False),
            (torch.ops.aten.add.Tensor, (x,), {"other": x}, False),
            (torch.ops.aten.add.Tensor, (), {}, False),
        ]
        for op, args, kwargs, static in direct:
            both(op, args, kwargs, static)
        # errors: the same exception type and message from both
        for args in ((x, torch.ones(2, 3)), (x, torch.ones(()).to(torch.device("meta")))):
            errors = []
            for fn in (python, fast):
                try:
                    fn(torch.ops.aten.add.Tensor, args, {}, False)
                    errors.append(None)
                except Exception as e:  # noqa: BLE001 - compared below
                    errors.append((type(e), str(e)))
            if errors[0] != errors[1] or errors[0] is None:
                diffs.append(f"errors differ for {args[1].device}: {errors}")
    finally:
        _core._signature = _execute._signature = fast
    return checked[0], diffs, True


def _subclass_goes_to_python():
    """A tensor subclass is not read in C++: the Python signature decides (same key either way)."""
    from tpudist.device import _core

    class Sub(torch.Tensor):
        pass

    x = torch.ones(2, 3, device="tpu")
    s = x.as_subclass(Sub)
    calls = []
    python = _core._signature_py
    _core._fast.init(lambda *a: calls.append(1) or python(*a), _core._host_spec, _core._META_DEVICE, torch.Tensor,
                     torch.nn.Parameter, _core._ATTR)
    try:
        got = _core._fast.signature(torch.ops.aten.add.Tensor, (s, x), {}, False)
        plain = _core._fast.signature(torch.ops.aten.add.Tensor, (x, x), {}, False)
    finally:
        _core._fast.init(python, _core._host_spec, _core._META_DEVICE, torch.Tensor, torch.nn.Parameter, _core._ATTR)
    return len(calls), got[0] == python(torch.ops.aten.add.Tensor, (s, x), {}, False)[0], plain[0] == got[0]


def _fast_in_use():
    from tpudist.device import _core

    return _core._fast is not None


def test_cpp_signature_equals_python_on_every_call(dev):
    checked, diffs, active = dev(_compare_every_call)
    if not active:
        pytest.skip("the C++ fastpath did not build here (no compiler or TPUDIST_CPP_FASTPATH=0)")
    assert diffs == []
    assert checked > 150  # the workloads reached the signature (~200 calls)


def test_tensor_subclass_goes_to_the_python_signature(dev):
    if not dev(_fast_in_use):
        pytest.skip("the C++ fastpath did not build here")
    calls, same, plain_same = dev(_subclass_goes_to_python)
    assert calls == 1  # the subclass call only; the plain one stayed in C++
    assert same and plain_same


def test_workloads_match_with_and_without_the_cpp_signature():
    """The same workloads give the same values on the Python signature (TPUDIST_CPP_FASTPATH=0)."""
    results = []
    for flag in ("1", "0"):
        with RankPool(1, backend=None, timeout=300, env={"TPUDIST_EAGER_MODE": "strict",
                                                         "TPUDIST_CPP_FASTPATH": flag}) as pool:
            active = pool.run(_fast_in_use)[0]
            results.append((active, pool.run(_workloads)[0]))
    assert results[1][0] is False
    for got, want in zip(results[0][1], results[1][1]):
        assert torch.equal(got, want) and got.stride() == want.stride()


def _empty_tensors_alike():
    """C++ create_empty against torch._C._acc.create_empty_tensor: the same tensor metadata."""
    from tpudist.device import _core

    diffs = []
    for shape, dtype in (((64, 64), torch.float32), ((), torch.int64), ((0, 3), torch.bfloat16),
                         ((2, 1, 5), torch.complex64), ((7,), torch.bool)):
        got, want = _core._fast.create_empty(shape, dtype), torch._C._acc.create_empty_tensor(shape, dtype)
        for fact in (lambda t: type(t), lambda t: t.device, lambda t: t.dtype, lambda t: t.shape, lambda t: t.stride(),
                     lambda t: t.storage_offset(), lambda t: t.untyped_storage().nbytes(),
                     lambda t: t.untyped_storage().data_ptr(), lambda t: str(torch._C._dispatch_keys(t)),
                     lambda t: t.requires_grad, lambda t: t.is_contiguous(), lambda t: t.layout):
            if fact(got) != fact(want):
                diffs.append((shape, dtype, fact(got), fact(want)))
    return diffs


def test_cpp_empty_tensor_is_torchs(dev):
    if not dev(_fast_in_use):
        pytest.skip("the C++ fastpath did not build here")
    assert dev(_empty_tensors_alike) == []


def _strided_empty_tensors_alike():
    """C++ create_empty with strides against its Python twin (_storage._create_empty_py): the same
    metadata, neither a view; and the error for strides that do not fit the shape."""
    from tpudist.device import _core, _storage

    diffs = []
    for shape, strides, dtype in (((2, 3, 5, 4), (60, 1, 12, 3), torch.float32), ((4, 6), (1, 4), torch.int64),
                                  ((2, 3, 2, 2, 2), (24, 1, 12, 6, 3), torch.bfloat16), ((3,), (1,), torch.bool)):
        got, want = _core._fast.create_empty(shape, dtype, strides), _storage._create_empty_py(shape, dtype, strides)
        for fact in (lambda t: type(t), lambda t: t.device, lambda t: t.dtype, lambda t: t.shape, lambda t: t.stride(),
                     lambda t: t.storage_offset(), lambda t: t.untyped_storage().nbytes(),
                     lambda t: str(torch._C._dispatch_keys(t)), lambda t: t.requires_grad, lambda t: t._is_view(),
                     lambda t: t.is_contiguous(), lambda t: t.dim() == 4 and t.is_contiguous(
                         memory_format=torch.channels_last), lambda t: t.layout):
            if fact(got) != fact(want):
                diffs.append((shape, strides, dtype, fact(got), fact(want)))
    try:
        _core._fast.create_empty((2, 3), torch.float32, (1,))
        diffs.append("strides of another length were accepted")
    except TypeError as e:
        if "shape and strides must be tuples of ints of one length" not in str(e):
            diffs.append(str(e))
    return diffs


def test_cpp_strided_empty_tensor_is_the_python_ones(dev):
    if not dev(_fast_in_use):
        pytest.skip("the C++ fastpath did not build here")
    assert dev(_strided_empty_tensors_alike) == []
