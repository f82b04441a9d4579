"""The envelope path in one process: rows packed by every simulated rank, exchanged as XLA's
all_to_all would, finished on each receiver, against numpy references of each op."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tpudist.process_group import envelope
from tpudist.process_group.keys import ProgramKey

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
          "complex64", "complex128"]


def _exchange(key: ProgramKey, blocks: list[np.ndarray]) -> list[np.ndarray]:
    """What each rank receives: row r of rank me's input is rank r's row me."""
    n = len(key.group)
    sent = [envelope.pack(envelope.plan(key, r, carries_data=True), b,
                          np.full(envelope.FP_WORDS, 7, np.int32)) for r, b in enumerate(blocks)]
    return [np.stack([sent[r][me] for r in range(n)]) for me in range(n)]


def _blocks(shape, dtype: str, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        values = rng.integers(-3, 4, size=shape)
        if dtype == "uint8":
            values = np.abs(values)
        if dtype.startswith("complex"):
            values = values + 1j * rng.integers(-3, 4, size=shape)
        out.append(np.asarray(values).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))
    return out


def _results(key, blocks):
    received = _exchange(key, blocks)
    for rows in received:
        assert (envelope.fingerprints(rows) == 7).all()
    return [envelope.finish(envelope.plan(key, me, carries_data=True), rows)
            for me, rows in enumerate(received)]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_sum_and_all_gather(n, dtype):
    blocks = _blocks((3, 2), dtype, n)
    key = ProgramKey("all_reduce", (3, 2), np.dtype(blocks[0].dtype).name, tuple(range(n)), "sum")
    wide = [b.astype(np.float32) if dtype in ("float16", "bfloat16") else b for b in blocks]
    expected = sum(wide[1:], wide[0]).astype(blocks[0].dtype)
    for got in _results(key, blocks):
        assert got.dtype == blocks[0].dtype and got.shape == (3, 2)
        np.testing.assert_array_equal(got, expected)
    gather = ProgramKey("all_gather", (3, 2), key.dtype, key.group)
    for got in _results(gather, blocks):
        np.testing.assert_array_equal(got, np.stack(blocks))


@pytest.mark.parametrize("reduce", ["avg", "premul_sum", "product", "min", "max"])
def test_float_reduce_ops(reduce):
    blocks = _blocks((5,), "float32", 4, seed=3)
    key = ProgramKey("all_reduce", (5,), "float32", (0, 1, 2, 3), reduce,
                     (0.5,) if reduce == "premul_sum" else ())
    stack = np.stack(blocks)
    expected = {"avg": stack.sum(0) / 4, "premul_sum": (stack * 0.5).sum(0), "product": stack.prod(0),
                "min": stack.min(0), "max": stack.max(0)}[reduce]
    for got in _results(key, blocks):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("reduce", ["band", "bor", "bxor", "sum"])
def test_integer_ops_wrap(reduce):
    blocks = [np.array([100, -7, 3], np.int8), np.array([100, 12, -128], np.int8)]
    key = ProgramKey("all_reduce", (3,), "int8", (0, 1), reduce)
    fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor, "sum": np.add}[reduce]
    expected = fn(blocks[0], blocks[1])
    for got in _results(key, blocks):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_scatter_all_to_all_scatter_broadcast(n):
    blocks = _blocks((n, 3), "int32", n, seed=5)
    group = tuple(range(n))
    rs = _results(ProgramKey("reduce_scatter", (n, 3), "int32", group, "sum"), blocks)
    a2a = _results(ProgramKey("all_to_all", (n, 3), "int32", group), blocks)
    root = n - 1
    scatter = _results(ProgramKey("scatter", (n, 3), "int32", group, static=(root,)), blocks)
    bcast = _results(ProgramKey("broadcast", (n, 3), "int32", group, static=(root,)), blocks)
    for me in range(n):
        np.testing.assert_array_equal(rs[me], sum(b[me] for b in blocks))
        np.testing.assert_array_equal(a2a[me], np.stack([blocks[r][me] for r in range(n)]))
        np.testing.assert_array_equal(scatter[me], blocks[root][me])
        np.testing.assert_array_equal(bcast[me], blocks[root])


def test_permute_takes_the_source_row_or_zeros():
    blocks = _blocks((4,), "int32", 3, seed=9)
    key = ProgramKey("permute", (4,), "int32", (0, 1, 2), static=((0, 2), (2, 0)))
    got = _results(key, blocks)
    np.testing.assert_array_equal(got[2], blocks[0])
    np.testing.assert_array_equal(got[0], blocks[2])
    np.testing.assert_array_equal(got[1], np.zeros(4, np.int32))


@pytest.mark.parametrize("shape", [(), (0,), (256,)])
def test_edge_shapes(shape):
    blocks = _blocks(shape, "float32", 2)
    key = ProgramKey("all_reduce", shape, "float32", (0, 1), "sum")
    assert envelope.fits(key)
    for got in _results(key, blocks):
        assert got.shape == shape
        np.testing.assert_array_equal(got, blocks[0] + blocks[1])


def test_what_fits():
    group = (0, 1, 2, 3)
    limit = envelope.PAYLOAD_BYTES // 4
    assert envelope.fits(ProgramKey("all_reduce", (limit,), "float32", group, "sum"))
    assert not envelope.fits(ProgramKey("all_reduce", (limit + 1,), "float32", group, "sum"))
    # per-row ops carry one row per destination: the whole block may be n times the payload
    assert envelope.fits(ProgramKey("reduce_scatter", (4, limit), "float32", group, "sum"))
    assert not envelope.fits(ProgramKey("reduce_scatter", (4, limit + 1), "float32", group, "sum"))
    assert envelope.fits(ProgramKey("barrier", (1,), "int32", group))


def test_mismatched_senders_show_in_the_fingerprints():
    key = ProgramKey("all_reduce", (2,), "float32", (0, 1), "sum")
    plan = envelope.plan(key, 0, carries_data=True)
    a = envelope.pack(plan, np.ones(2, np.float32), np.arange(envelope.FP_WORDS, dtype=np.int32))
    b = envelope.pack(plan, np.ones(2, np.float32), np.zeros(envelope.FP_WORDS, np.int32))
    fps = envelope.fingerprints(np.stack([a[0], b[0]]))
    assert not (fps == fps[0]).all()
