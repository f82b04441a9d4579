"""An optimizer step recorded (Fused) or run (Strict) a layer's worth at a time, one program per repeated part
(docs/device.md, Eager modes): ``_groups`` cuts a foreach op's lists where their shapes repeat, ``_parts``
runs a graph's independent repeated parts as programs their repeats share.

Against CPU eager: foreach results (in place and new lists, scalar lists, norms) and AdamW training; the
largest program a step builds does not grow with the model's depth. Shapes of their own per test: the
process's programs are shared by every test of the folder.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tpudist.device  # noqa: F401  (installs the "tpu" device)
from test_device_fused_blocks import _check_equal, _recipe, _train  # the recipe's model trained against CPU eager
from tpudist.device import _fused, _groups, _parts

E, A, B, N = ((50, 8), torch.float32), ((8, 8), torch.float32), ((4, 8), torch.float32), ((8,), torch.float32)


def test_cut_where_the_shapes_repeat():
    layer = [A, B, B, A, N]
    recipe = [E] + layer * 4 + [N, E]          # embedding, 4 layers, final norm, head
    assert _groups.cut(recipe) == ((0, 1), (1, 6), (6, 11), (11, 16), (16, 21), (21, 23))
    assert _groups.cut(layer * 4) == ((0, 5), (5, 10), (10, 15), (15, 20))
    same = [N] * 40                             # 40 repeats of one tensor: 16 groups at most, 3 at a time
    ranges = _groups.cut(same)
    assert len(ranges) <= _groups.MAX_GROUPS and ranges[0] == (0, 3) and ranges[-1] == (39, 40)
    assert [lo for lo, _ in ranges[1:]] == [hi for _, hi in ranges[:-1]]  # every tensor once, in order
    distinct = [((i,), torch.float32) for i in range(1, 30)]
    assert _groups.cut([A, B] * 4 + distinct[:10]) is None  # the repeats cover under half of the list
    assert _groups.cut(distinct) is None                    # nothing repeats


def _lists(n_layers, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [E[0]] + [A[0], B[0], B[0], A[0], N[0]] * n_layers + [N[0], E[0]]
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("mode", ["fused", "strict"], indirect=True)
def test_foreach_ops_cut_into_groups_match_cpu(mode):
    xs, ys, zs = _lists(4, 0), _lists(4, 1), [t.abs() + 0.5 for t in _lists(4, 2)]
    scalars = [0.5 + i / 10 for i in range(len(xs))]
    assert _groups.cut([(tuple(t.shape), t.dtype) for t in xs]) is not None

    def run(device):
        x, y, z = ([t.to(device) for t in ts] for ts in (xs, ys, zs))
        new = torch._foreach_add(x, y, alpha=0.5)     # a new list, joined in order
        torch._foreach_mul_(x, scalars)               # a scalar list, cut with the tensors
        torch._foreach_addcdiv_(x, y, z, 0.25)
        norms = torch._foreach_norm(new)
        return [t.cpu() for t in (*new, *x, *norms)]

    counted = "recorded_ops" if mode == "fused" else "ops"
    before = torch.tpu.cache_stats()
    got = run("tpu")
    assert torch.tpu.cache_stats()[counted] - before[counted] >= 4 * 6  # each op recorded (or run) in 6 parts
    for g, r in zip(got, run("cpu"), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_lists_of_other_lengths_raise_torch_error(mode):
    xs = [t.to("tpu") for t in _lists(4, 0)]
    with pytest.raises(RuntimeError, match=f"got {len(xs)} and {len(xs) - 1}"):
        torch._foreach_add_(xs, xs[:-1])


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
def test_optimizer_step_runs_a_layer_at_a_time(mode, monkeypatch):
    """AdamW trains as on the CPU, and the largest program built (counted in tensors read and written)
    is as large at 6 layers as at 3: one layer's update, not the whole model's. Each depth starts from
    an empty program table, so neither reuses the other's programs. The parts' programs (a layer's
    update, the rest) and the optimizer state's are built in threads, several at once."""
    built, threads = [], set()
    compile_ = _fused._load_or_compile  # noqa: SLF001

    def counting(g, *args, **kwargs):
        built.append(sum(len(kernel.slots) for kernel, _, _ in g.nodes))
        threads.add(threading.get_ident())
        return compile_(g, *args, **kwargs)

    monkeypatch.setattr(_fused, "_load_or_compile", counting)
    largest, parted = [], []
    for layers in (3, 6):
        _fused._PROGRAMS.clear()  # noqa: SLF001
        built.clear()
        before = torch.tpu.cache_stats().get("parted_graphs", 0)
        ref = _train(_recipe(32, layers), "cpu")
        _check_equal(ref, _train(_recipe(32, layers).to("tpu"), "tpu"))
        largest.append(max(built))
        parted.append(torch.tpu.cache_stats().get("parted_graphs", 0) - before)
    assert largest[0] == largest[1], largest
    assert parted[0] >= 1 and parted[1] >= 1, parted
    assert len(threads - {threading.get_ident()}) >= 2, threads


@pytest.mark.parametrize("mode", ["fused"], indirect=True)
@pytest.mark.parametrize("count", [2, _parts.MAX_PARTS + 1])
def test_independent_repeats_run_apart_unless_too_many(mode, count):
    """A graph of ``count`` independent repeats of the same ops (and one other op) runs as parts when
    there are a few of them, whole when one program each would be too many; the values are CPU's either way."""
    xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) for i in range(count)]
    w = torch.randn(5, 7)

    def run(device):
        out = [(x.to(device) * 1.5 + 0.25).exp() for x in xs]
        other = w.to(device).sum(0)
        return [t.cpu() for t in (*out, other)]

    before = torch.tpu.cache_stats().get("parted_graphs", 0)
    got = run("tpu")
    parted = torch.tpu.cache_stats().get("parted_graphs", 0) - before
    for g, r in zip(got, run("cpu"), strict=True):
        torch.testing.assert_close(g, r)
    assert parted == (1 if count <= _parts.MAX_PARTS else 0)


@pytest.mark.parametrize("mode", ["strict"], indirect=True)
def test_strict_adamw_compiles_nothing_after_step_one(mode, monkeypatch):
    """AdamW's state is made by kernels that read no array (zeros_like); their results are committed to
    the device as every other kernel's are, so the kernels reading them in step 1 are the ones step 2
    runs: no XLA compile after step 1 (every compile counted, whatever asked for it, JAX's persistent
    cache's hits too: on a fresh chip each is a compile)."""
    import jax._src.compiler as jax_compiler

    compiles, original = [], jax_compiler.compile_or_get_cached

    def counted(*args, **kwargs):
        compiles.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax_compiler, "compile_or_get_cached", counted)
    ref = _train(_recipe(48, 2), "cpu")
    per_step = []
    model = _recipe(48, 2).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        before = len(compiles)
        x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x.to("tpu")).flatten(0, 1), y.to("tpu").flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        per_step.append(len(compiles) - before)
    assert losses == pytest.approx([loss for loss, _, _ in ref[0]], rel=1e-5)
    assert per_step[0] > 0 and per_step[1:] == [0, 0], per_step
