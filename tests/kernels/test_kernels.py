"""custom_jax_kernel and the kernel library on CPU tensors: against torch, eager and compiled.

References are the model's own modules (``tpudist/training/model.py``'s RMSNorm) and torch's SDPA;
gradients are compared input by input. DTensor cases: ``test_kernels_dtensor.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.experimental import pallas as pl

import tpudist.ops
from tpudist import matmul_precision
from tpudist.kernels import KernelGradientError, KernelInputError, custom_jax_kernel
from tpudist.training.model import RMSNorm

from tpudist.kernels.library import KERNELS, attention, attention_kernel, attention_pallas_kernel, rms_norm, rms_norm_kernel

TOL = 1e-5
EPS = 1e-5


def _rms_module(dim=64, dtype=torch.float32):
    module = RMSNorm(dim, EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.linspace(0.5, 1.5, dim))
    return module


def _inputs(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float32).to(dtype).requires_grad_() for s in shapes]


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, g)


def _assert_close(got, want, tol=TOL):
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# -- kernels written for the tests ----------------------------------------------------------------
def _square_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]


def _pallas_square(x):
    return pl.pallas_call(_square_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@custom_jax_kernel("kernels_test::pallas_square", backward=lambda x, g: (2 * x * g,))
def pallas_square(x):
    return _pallas_square(x)


@custom_jax_kernel("kernels_test::pallas_square_no_grad")
def pallas_square_no_grad(x):
    return _pallas_square(x)


@custom_jax_kernel("kernels_test::moments", num_outputs=2)
def moments(x, shift=None, *, axis: int = -1):
    """Mean and variance along ``axis``; an optional tensor shifts x first."""
    if shift is not None:
        x = x - shift
    return x.mean(axis), x.var(axis)


@custom_jax_kernel("kernels_test::add_big")
def add_big(x, *, big: int = 2**40):
    return x + big


@custom_jax_kernel("kernels_test::double")
def double(x):
    return x * 2


TEST_KERNELS = (*KERNELS, pallas_square, pallas_square_no_grad, moments, add_big, double)


# -- opcheck ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_opcheck(kernel):
    if kernel in (attention_kernel, attention_pallas_kernel):
        args, kwargs = _inputs((2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)), {"causal": True, "scale": 0.0}
    else:
        args, kwargs = _inputs((3, 5, 8), (8,)), {"eps": EPS}
    torch.library.opcheck(kernel.op, args, kwargs)


def test_opcheck_test_kernels():
    torch.library.opcheck(pallas_square.op, _inputs((8, 16)))
    x, shift = _inputs((4, 6), (6,))
    torch.library.opcheck(moments.op, (x, shift), {"axis": 0})


def test_results_have_the_fake_strides_in_any_layout(monkeypatch):
    """XLA:TPU lays a program's result out in a dim order of its choosing (on a v5e, a (3, 5, 8) float32
    result as major_to_minor (1, 0, 2)), and np.asarray keeps that order in its strides; the op's
    result must still have the fake kernel's (opcheck; inductor asserts them). Mocked on the CPU: the
    kernel's programs are given that layout."""
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    chip_layout = Format(Layout(major_to_minor=(1, 0, 2)), SingleDeviceSharding(jax.devices("cpu")[0]))
    jit = jax.jit
    monkeypatch.setattr(jax, "jit", lambda fn: jit(fn, out_shardings=chip_layout))
    (x,) = _inputs((3, 5, 8))
    assert np.asarray(jax.jit(lambda a: a * 2)(x.detach().numpy())).strides == (32, 96, 4)  # as on the chip
    torch.library.opcheck(double.op, (x,))
    assert double(x).stride() == (40, 8, 1)


# -- eager against torch ---------------------------------------------------------------------------
@pytest.mark.parametrize("pallas", [False, True], ids=["jnp", "pallas"])
@pytest.mark.parametrize("shape", [(8, 64), (2, 5, 64), (2, 136, 16)])  # the last: 2 Pallas row blocks
def test_rms_norm_matches_model(pallas, shape):
    module = _rms_module(dim=shape[-1])
    (x,) = _inputs(shape)
    out = rms_norm(x, module.weight, EPS, pallas=pallas)
    want = module(x)
    _assert_close(out, want)
    for got, ref in zip(_grads(out, (x, module.weight)), _grads(want, (x, module.weight))):
        _assert_close(got, ref)


def test_rms_norm_dtypes_follow_torch():
    """bf16 x with f32 weight gives f32 (torch's promotion); float64 runs in 64 bits (x64 on)."""
    module = _rms_module()
    (x,) = _inputs((4, 64), dtype=torch.bfloat16)
    out = rms_norm(x, module.weight, EPS)
    assert out.dtype == module(x).dtype == torch.float32
    _assert_close(out, module(x), tol=1e-2)
    (x64,) = _inputs((4, 64), dtype=torch.float64)
    m64 = _rms_module(dtype=torch.float64)
    assert rms_norm(x64, m64.weight, EPS).dtype == torch.float64
    _assert_close(rms_norm(x64, m64.weight, EPS), m64(x64))


@pytest.mark.parametrize("pallas", [False, True], ids=["jnp", "pallas"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q", [7, 16])
def test_attention_matches_sdpa(causal, pallas, seq_q):
    q, k, v = _inputs((2, 4, seq_q, 8), (2, 4, 9, 8), (2, 4, 9, 8))
    out = attention(q, k, v, causal=causal, pallas=pallas)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    _assert_close(out, want)
    for got, ref in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        _assert_close(got, ref)


def test_pallas_attention_several_query_blocks():
    q, k, v = _inputs((1, 1, 136, 8), (1, 1, 136, 8), (1, 1, 136, 8))  # 17 blocks of 8 queries
    out = attention(q, k, v, causal=True, pallas=True)
    _assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_pallas_kernel_with_user_backward():
    (x,) = _inputs((8, 16))
    out = pallas_square(x)
    _assert_close(out, x * x)
    (grad,) = _grads(out, (x,))
    (want,) = _grads(x * x, (x,))
    _assert_close(grad, want)


def test_pallas_kernel_without_gradient_says_so():
    (x,) = _inputs((8, 16))
    out = pallas_square_no_grad(x)
    _assert_close(out, x * x)
    with pytest.raises(KernelGradientError, match=r"kernels_test::pallas_square_no_grad: .*pallas_call.*"
                                                  r"no reverse-mode gradient.*backward=.*reference="):
        out.sum().backward()


def test_several_outputs_and_an_optional_tensor():
    x, shift = _inputs((4, 6), (6,))
    mean, var = moments(x, shift, axis=0)
    ref_mean, ref_var = (x - shift).mean(0), (x - shift).var(0, unbiased=False)
    _assert_close(mean, ref_mean)
    _assert_close(var, ref_var)
    got = torch.autograd.grad(mean.sum() + var.sum(), (x, shift))
    want = torch.autograd.grad(ref_mean.sum() + ref_var.sum(), (x, shift))
    for a, b in zip(got, want):
        _assert_close(a, b)
    mean_only, _ = moments(x)  # shift absent
    _assert_close(mean_only, x.mean(-1))


def test_int64_crosses_in_64_bits():
    x = torch.tensor([1, 2**33], dtype=torch.int64)
    assert add_big(x).tolist() == [2**40 + 1, 2**40 + 2**33]
    assert not jax.config.jax_enable_x64  # the user's setting is left alone


@pytest.mark.skipif(jax.devices()[0].platform != "cpu",
                    reason="zero-copy inputs are XLA:CPU's: a chip's programs read their own memory")
def test_cpu_inputs_are_not_copied():
    """What a kernel hands its jitted program aliases the torch buffer, and XLA:CPU takes it in place."""
    run_key = None
    x = torch.randn(4, 64)
    rms_norm(x, torch.ones(64), EPS)
    for key, run in rms_norm_kernel._runners.items():  # noqa: SLF001
        if key[0][0] == (x.shape, x.dtype):
            run_key = key
    assert run_key is not None
    from tpudist.bridge import numpy_view

    view, _ = numpy_view(x)
    assert view.ctypes.data == x.data_ptr()
    assert jax.device_put(view).unsafe_buffer_pointer() == x.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_inputs_stay_resizable(dtype):
    """A kernel's CPU inputs keep resizable storages: FSDP2 frees unsharded parameters with
    ``resize_(0)``, which Tensor.numpy() would forbid for good."""
    x, weight = torch.randn(4, 64, dtype=dtype), torch.ones(64, dtype=dtype, requires_grad=True)
    out = rms_norm(x, weight, EPS)
    out.float().sum().backward()
    expected = rms_norm(x.clone(), weight.detach().clone(), EPS)
    torch.testing.assert_close(out, expected)
    for t in (x, weight):
        t.untyped_storage().resize_(0)  # raises "not resizable" after Tensor.numpy()
        assert t.untyped_storage().nbytes() == 0


# -- compiled -----------------------------------------------------------------------------------------
def _block(x, weight, q, k, v):
    return rms_norm(x, weight, EPS) * 2, attention(q, k, v, causal=True) + 1


def test_inductor_fullgraph():
    torch._dynamo.reset()  # noqa: SLF001
    module = _rms_module(dim=8)
    x, q, k, v = _inputs((3, 8), (1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    compiled = torch.compile(_block, backend="inductor", fullgraph=True, dynamic=False)
    got = compiled(x, module.weight, q, k, v)
    want = _block(x, module.weight, q, k, v)
    inputs = (x, module.weight, q, k, v)
    for a, b in zip(got, want):
        _assert_close(a, b)
    got_grads = torch.autograd.grad(got[0].sum() + (got[1] * got[1]).sum(), inputs)
    want_grads = torch.autograd.grad(want[0].sum() + (want[1] * want[1]).sum(), inputs)
    for a, b in zip(got_grads, want_grads):
        _assert_close(a, b)


def _shapes_run() -> set[tuple[int, ...]]:
    """Input shapes the library kernels ran eagerly on CPU (their per-signature program cache)."""
    shapes = set()
    for kernel in KERNELS:
        for key in kernel._runners:  # noqa: SLF001
            signature = key[1] if key[0] == "backward" else key[0]
            shapes |= {tuple(entry[0]) for entry in signature if entry is not None}
    return shapes


@pytest.mark.skipif(importlib.util.find_spec("tpudist.compile") is None, reason="tpudist.compile not built yet")
def test_tpu_compile_backend_inlines_the_kernel():
    torch._dynamo.reset()  # noqa: SLF001
    module = _rms_module(dim=8)
    x, q, k, v = _inputs((5, 8), (1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    inputs = (x, module.weight, q, k, v)
    compiled = torch.compile(_block, backend="tpu", fullgraph=True, dynamic=False)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got[0].sum() + (got[1] * got[1]).sum(), inputs)
    # Inlined into the XLA program: the kernels' own CPU programs never ran for these shapes.
    assert not {(5, 8), (1, 2, 3, 4)} & _shapes_run()
    want = _block(*inputs)
    assert {(5, 8), (1, 2, 3, 4)} <= _shapes_run()  # (the check above can fail)
    for a, b in zip(got, want):
        _assert_close(a, b)
    want_grads = torch.autograd.grad(want[0].sum() + (want[1] * want[1]).sum(), inputs)
    for a, b in zip(got_grads, want_grads):
        _assert_close(a, b)


def _host_copy(array) -> torch.Tensor:
    """A torch copy of a JAX array on any device (DLPack hands over CPU and GPU arrays only)."""
    return torch.tensor(np.asarray(array))


def test_lowering_table_runs_the_kernels():
    """tpudist.ops.call on JAX arrays (what the device and the compile backend do), inside jax.jit too."""
    module = _rms_module(dim=8)
    (x,) = _inputs((3, 8))
    xj, wj = jnp.asarray(x.detach().numpy()), jnp.asarray(module.weight.detach().numpy())
    assert tpudist.ops.lowering_for(rms_norm_kernel.op) is not None
    out = tpudist.ops.call(rms_norm_kernel.op, xj, wj, eps=EPS)
    _assert_close(_host_copy(out), module(x))
    g = jnp.ones_like(out)
    fused = jax.jit(lambda a, b: tpudist.ops.call(rms_norm_kernel.backward_op, a, b, [g], eps=EPS))
    gx, gw = fused(xj, wj)
    want = torch.autograd.grad(module(x).sum(), (x, module.weight))
    _assert_close(_host_copy(gx), want[0])
    _assert_close(_host_copy(gw), want[1])
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 5, 4), dtype=np.float32))
    with matmul_precision.scope(matmul_precision.current()):  # as the device and the compile backend trace
        out = tpudist.ops.call(attention_kernel.op, q, q, q, causal=True, scale=0.0)
    qt = _host_copy(q)
    _assert_close(_host_copy(out), F.scaled_dot_product_attention(qt, qt, qt, is_causal=True))


# -- bad input ------------------------------------------------------------------------------------
def test_wrong_shape_names_kernel_got_and_expects():
    with pytest.raises(KernelInputError, match=r"kernel tpudist::rms_norm: got x=float32\[8, 64\], "
                                               r"weight=float32\[32\], eps=1e-05; expects x of shape \(\.\.\., dim\) "
                                               r"and weight of shape \(dim,\)"):
        rms_norm(torch.randn(8, 64), torch.ones(32), EPS)
    q, k = torch.randn(1, 4, 5, 4), torch.randn(1, 3, 5, 4)  # 4 query heads cannot share 3 kv heads
    with pytest.raises(KernelInputError, match=r"tpudist::attention: got q=float32\[1, 4, 5, 4\], "
                                               r"k=float32\[1, 3, 5, 4\].*expects .*heads a multiple of kv_heads"):
        attention(q, k, k)


def test_wrong_dtype_names_kernel_got_and_expects():
    with pytest.raises(KernelInputError, match=r"tpudist::rms_norm: got x=int64\[8, 64\].*expects "
                                               r"floating-point x and weight"):
        rms_norm(torch.ones(8, 64, dtype=torch.int64), torch.ones(64), EPS)
    with pytest.raises(KernelInputError, match=r"tpudist::attention: .*expects q, k, v of one floating-point"):
        attention(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2).double(), torch.randn(1, 1, 2, 2))
    with pytest.raises(KernelInputError, match=r"kernels_test::pallas_square: got x=uint16\[3\]; expects"):
        pallas_square(torch.zeros(3, dtype=torch.uint16))


def test_error_from_jax_names_kernel_and_what_it_got():
    """No check= given: JAX's complaint is passed on, with the kernel and the argument shapes."""
    with pytest.raises(KernelInputError, match=r"kernels_test::moments: got x=float32\[4, 6\], "
                                               r"shift=float32\[5\], axis=-1; expects inputs the JAX function "
                                               r"accepts; JAX said: .*"):
        moments(torch.randn(4, 6), torch.randn(5))
    # Under torch.compile the fake kernel raises it while Dynamo traces (Dynamo wraps it, text kept).
    with pytest.raises(Exception, match=r"kernel tpudist::rms_norm: got x=float32\[2, 4\], weight=float32\[3\]"):
        torch.compile(lambda a: rms_norm(a, torch.ones(3), EPS), backend="inductor", fullgraph=True)(
            torch.randn(2, 4))


def test_bad_definitions():
    with pytest.raises(ValueError, match=r"name='rms' must be a qualified operator name 'namespace::op'"):
        custom_jax_kernel("rms")(lambda x: x)
    with pytest.raises(TypeError, match=r"parameter eps=1e-06 looks static; make it keyword-only"):
        custom_jax_kernel("kernels_test::bad1")(lambda x, eps=1e-6: x)
    with pytest.raises(TypeError, match=r"static argument mode must be a float, int, bool or str"):
        custom_jax_kernel("kernels_test::bad2")(lambda x, *, mode=(1, 2): x)
    with pytest.raises(ValueError, match=r"shard_dims='_ -> b' .* label 'b'|label"):
        custom_jax_kernel("kernels_test::bad3", shard_dims="b -> _")(lambda x: x)
    with pytest.raises(ValueError, match=r"pass backward= or reference=, not both"):
        custom_jax_kernel("kernels_test::bad4", backward=lambda x, g: g, reference=lambda x: x)(lambda x: x)


# -- shard_dims plans (no processes: placements on stand-ins for DTensors) ---------------------------
def _dt(ndim, *placements):
    from types import SimpleNamespace

    return SimpleNamespace(ndim=ndim, placements=placements)


def test_shard_dims_plan_outputs_and_grads():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tpudist.kernels.shard_spec import ShardDims, plan_local

    norm = ShardDims.parse("... _, _ -> ... _", 2, 1, "k")
    plan = plan_local(norm, "k", ["x", "w"], [_dt(3, Shard(0), Shard(1)), _dt(1, Replicate(), Replicate())],
                      ["dp", "tp"], [3])
    assert plan.output_placements == ((Shard(0), Shard(1)),)
    assert plan.grad_placements == ((Shard(0), Shard(1)), (Partial(), Partial()))
    attn = ShardDims.parse("b h _ _, b h _ _, b h _ _ -> b h _ _", 3, 1, "k")
    qkv = [_dt(4, Shard(0), Shard(1))] * 3
    plan = plan_local(attn, "k", ["q", "k", "v"], qkv, ["dp", "tp"], [4])
    assert plan.output_placements == ((Shard(0), Shard(1)),)
    assert plan.grad_placements == ((Shard(0), Shard(1)),) * 3
    plan = plan_local(attn, "k", ["q", "k", "v"], [_dt(4, Replicate())] * 3, ["tp"], [4])
    assert plan.output_placements == ((Replicate(),),) and plan.grad_placements == ((Replicate(),),) * 3


def test_shard_dims_errors_say_which_redistribute():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tpudist.kernels import KernelShardingError
    from tpudist.kernels.shard_spec import ShardDims, plan_local

    norm = ShardDims.parse("... _, _ -> ... _", 2, 1, "lib::norm")
    with pytest.raises(KernelShardingError, match=re.escape(
            "kernel lib::norm: x is sharded on dim 2 (mesh axis 'tp', placements=(S(0), S(2))), but the kernel "
            "needs that dim whole (shard_dims='... _, _ -> ... _'); redistribute it first: x = x.redistribute("
            "x.device_mesh, [Shard(dim=0), Replicate()])")):
        plan_local(norm, "lib::norm", ["x", "w"], [_dt(3, Shard(0), Shard(2)), _dt(1, Replicate(), Replicate())],
                   ["dp", "tp"], [3])
    with pytest.raises(KernelShardingError, match=r"w is sharded on dim 0 .*w = w.redistribute"):
        plan_local(norm, "lib::norm", ["x", "w"], [_dt(2, Replicate()), _dt(1, Shard(0))], ["tp"], [2])
    with pytest.raises(KernelShardingError, match=r"x is Partial\(sum\) on mesh axis 'tp', a pending reduction"):
        plan_local(norm, "lib::norm", ["x", "w"], [_dt(2, Partial()), _dt(1, Replicate())], ["tp"], [2])
    attn = ShardDims.parse("b h _ _, b h _ _, b h _ _ -> b h _ _", 3, 1, "lib::attn")
    with pytest.raises(KernelShardingError, match=re.escape(
            "mesh axis 'tp' shards q, v on dim 'h' but k, which has that dim too, is Replicate() there; shard "
            "them alike: k = k.redistribute(k.device_mesh, [Shard(1)])")):
        plan_local(attn, "lib::attn", ["q", "k", "v"], [_dt(4, Shard(1)), _dt(4, Replicate()), _dt(4, Shard(1))],
                   ["tp"], [4])
    with pytest.raises(KernelShardingError, match=r"shards different dims of the inputs \(q on dim 'h', "):
        plan_local(attn, "lib::attn", ["q", "k", "v"], [_dt(4, Shard(1)), _dt(4, Shard(0)), _dt(4, Shard(1))],
                   ["tp"], [4])


# -- warmup ---------------------------------------------------------------------------------------
def test_warmup_fills_the_persistent_cache(tmp_path):
    """`tpudist warmup` compiles the library; fresh jitted programs of eager calls then hit that cache."""
    env = dict(os.environ, TPUDIST_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    script = (
        "import jax, torch\n"
        "from jax import monitoring\n"
        "from tpudist.__main__ import main\n"
        "assert main(['warmup', '--batch', '2', '--seq-len', '4', '--dim', '8', '--heads', '2']) == 0\n"
        "from tpudist.kernels.library import KERNELS, rms_norm, attention\n"
        "for kernel in KERNELS:\n"
        "    kernel._runners.clear()\n"
        "jax.clear_caches()\n"
        "hits = []\n"
        "monitoring.register_event_listener(lambda n, **k: hits.append(n) if n.endswith('cache_hits') else None)\n"
        "x = torch.randn(2, 4, 8, requires_grad=True)\n"
        "rms_norm(x, torch.ones(8), 1e-5).sum().backward()\n"
        "q = torch.randn(2, 2, 4, 4, requires_grad=True)\n"
        "attention(q, q, q).sum().backward()\n"
        "print('hits', len(hits))\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "8 kernel programs" in done.stdout and "8 compiled, 0 already there" in done.stdout, done.stdout
    assert len(list(tmp_path.iterdir())) >= 8
    assert "hits 4" in done.stdout, done.stdout  # rms_norm and attention, forward and backward
