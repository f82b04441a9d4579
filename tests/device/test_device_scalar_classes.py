"""A Python number's class decides a result's dtype: ``torch.full((2,), True)`` is bool, ``(2,), 1`` int64,
``(2,), 1.0`` float32 and ``(2,), 1+0j`` complex64, yet ``True == 1 == 1.0 == 1+0j`` in Python, with equal
hashes. A kernel cache keyed on the value alone hands the second call the first one's kernel: a result
of the wrong dtype, silently (the device once did so for bool and int). Each call here is checked
against CPU eager, value and dtype, after every other class of the same value has run first.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from tpudist.device import _core, _grow

MODES = ("strict", "fused")
EQUAL_NUMBERS = (True, 1, 1.0, complex(1, 0))  # equal, equal hashes, four result dtypes


@pytest.fixture(params=MODES)
def mode(request):
    with torch.tpu.eager_mode(request.param):
        yield request.param


def _calls(device):
    """Ops that take a Python number for a Scalar: (name, fn(number) -> tensor)."""
    i = torch.tensor([[3, -2, 0]], device=device)
    f = torch.tensor([[1.5, -2.0, 0.25]], device=device)
    b = torch.tensor([[True, False, True]], device=device)
    return [
        ("full", lambda n: torch.full((2,), n, device=device)),
        ("int + n", lambda n: i + n),
        ("float * n", lambda n: f * n),
        ("bool | n", lambda n: b | n if isinstance(n, (bool, int)) else None),
        ("where(b, i, n)", lambda n: torch.where(b, i, n)),
        ("int.masked_fill(b, n)", lambda n: i.masked_fill(b, n) if not isinstance(n, complex) else None),
        ("int == n", lambda n: i == n),
    ]


@pytest.mark.parametrize("order", list(itertools.permutations(EQUAL_NUMBERS, 2)), ids=repr)
def test_equal_numbers_of_another_class_get_their_own_kernel(mode, order):
    for n in order:
        for (name, on_tpu), (_, on_cpu) in zip(_calls("tpu"), _calls("cpu"), strict=True):
            want = on_cpu(n)
            if want is None:
                continue
            got = on_tpu(n).cpu()
            assert got.dtype == want.dtype and torch.equal(got, want), (name, order, n, got, want)


def test_token_ids_in_a_capacity_plus_a_float_are_float(mode):
    """Grown token ids (an append seen at a second length moves them into a capacity) go through the grown
    storage's own plan, whose key held a number by value too: ``ids + 1`` then ``ids + 1.0``."""
    ids_cpu = torch.tensor([[5, 1, 4]])
    ids = ids_cpu.to("tpu")
    for step in range(4):
        ids = torch.cat([ids, torch.full((1, 1), step, device="tpu")], dim=-1)
        ids_cpu = torch.cat([ids_cpu, torch.full((1, 1), step)], dim=-1)
    assert _grow.buffer_of(ids) in _grow.CAPACITY, "the appends grew nothing: nothing to test"
    for n in (1, 1.0, True, 1, complex(1, 0)):
        got, want = (ids + n).cpu(), ids_cpu + n
        assert got.dtype == want.dtype and torch.equal(got, want), (n, got, want)


@pytest.mark.parametrize("first,second", [(2, 2.0), (2.0, 2), (True, 1), (1.0, complex(1, 0))])
def test_static_float_signatures_tell_the_classes_apart(first, second):
    """An op whose floats are constants (its lowering branches on one) holds each number in its key by
    value: the keys of two classes must differ. Checked on the signature itself, Python's and C++'s."""
    x = torch.ones(2, 3, device="tpu")
    for signature in filter(None, (_core._signature_py, getattr(_core._fast, "signature", None))):
        keys = [signature(torch.ops.aten.add.Tensor, (x, n), {}, True)[0] for n in (first, second)]
        assert keys[0] != keys[1], (signature, keys)


def test_an_eager_mode_is_its_name_and_says_what_it_does():
    from tpudist.device import _runtime as rt

    seen = {}
    for name in ("debug", "strict", "fused"):
        with torch.tpu.eager_mode(name):
            mode = torch.tpu.get_eager_mode()
            seen[name] = (mode == name, mode.records, mode.checks)
    assert seen == {"debug": (True, False, True), "strict": (True, False, False), "fused": (True, True, False)}
    with pytest.raises(ValueError, match="'eager' is not an eager mode: use one of debug, strict, fused"):
        rt.set_mode("eager")
