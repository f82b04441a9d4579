"""``tpudist.device.views``: reads and writes of strided views of a flat storage, against numpy (no device).

Every view here is a slice (start, stop, step per dim) of a small storage, or its transpose, so the
offsets land inside rows (``x[..., 32:]``), at whole rows and at interleavings (phases). ``column()``
starts a view whose offset lies inside its innermost rows at those rows, so the upper half of a head
dim is read and written in place, not through a copy of the whole storage shifted by the offset.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from tpudist.device import views

SHAPES = [(2, 3, 8), (3, 10), (2, 2, 4, 6)]


def _slices(shape):
    """(sizes, strides, offset) of every slice with starts, stops and steps from a few choices, and of
    its reversed-dims transpose."""
    base = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]
    choices = [[(0, s, 1), (0, max(1, s // 2), 1), (s // 2, s, 1), (1, s, 2)] for s in shape]  # all, halves, odd
    for picks in itertools.product(*choices):
        sizes = [len(range(a, b, step)) for a, b, step in picks]
        strides = [stride * step for (_, _, step), stride in zip(picks, base)]
        offset = sum(a * stride for (a, _, _), stride in zip(picks, base))
        yield sizes, strides, offset
        yield sizes[::-1], strides[::-1], offset


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reads_and_writes_of_strided_views_equal_numpy(shape):
    n = int(np.prod(shape))
    flat = np.arange(n, dtype=np.float32) + 100
    rng = np.random.default_rng(0)
    columns = 0
    for sizes, strides, offset in _slices(shape):
        index = views._element_index(sizes, strides, offset)  # noqa: SLF001 - numpy's answer
        assert np.array_equal(np.asarray(views.read(flat, sizes, strides, offset)), flat[index]), \
            (sizes, strides, offset)
        value = rng.standard_normal(sizes).astype(np.float32)
        want = flat.copy()
        want[index] = value
        got = np.asarray(views.write(flat, value, sizes, strides, offset))
        assert np.array_equal(got, want), (sizes, strides, offset)
        dims = views._plan(sizes, strides)  # noqa: SLF001
        columns += bool(dims and views.column([sizes[d] for d in dims], [strides[d] for d in dims], offset))
    assert columns  # the cases above include offsets inside rows


def test_the_upper_half_of_a_head_dim_is_read_and_written_in_its_rows():
    """``x[..., 32:]`` of a (2, 4, 16, 64) storage (HF Llama's rotate_half, and the write of its backward's
    slice_backward): no pad and no 1-d dynamic_update_slice of the storage shifted by 32."""
    shape, sizes = (2, 4, 16, 64), (2, 4, 16, 32)
    strides = (4096, 1024, 64, 1)
    assert views.column(list(sizes), list(strides), 32) == 32
    flat = np.zeros(int(np.prod(shape)), np.float32)
    value = np.ones(sizes, np.float32)
    for jaxpr in (jax.make_jaxpr(lambda f: views.read(f, sizes, strides, 32))(flat),
                  jax.make_jaxpr(lambda f, v: views.write(f, v, sizes, strides, 32))(flat, value)):
        prims = [e.primitive.name for e in jaxpr.eqns]
        assert "pad" not in prims, prims
        flat_updates = [e for e in jaxpr.eqns if e.primitive.name == "dynamic_update_slice"
                        and e.outvars[0].aval.ndim == 1]
        assert not flat_updates, prims
    got = np.asarray(views.write(flat, value, sizes, strides, 32)).reshape(shape)
    assert got[..., 32:].all() and not got[..., :32].any()
