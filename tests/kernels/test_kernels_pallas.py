"""The Pallas TPU kernels (flash attention, RMSNorm) against pure-JAX references.

Three tiers: values and gradients in interpret mode on CPU (small shapes: interpret mode is ~30x slower
than jnp); the TPU lowering through ``jax.export(platforms=["tpu"])`` on CPU, reading the Mosaic module
it serializes (int32 index maps, no 64-bit values, under x64 on and off: what failed on the chip);
and compiled runs on a TPU (skipped elsewhere). No torch: the kernels are pure JAX.
"""

from __future__ import annotations

import base64
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpudist.kernels import flash_attention as fa
from tpudist.kernels import pallas_rms_norm as rn
from tpudist.kernels.tpu_blocks import pallas_interpret_unless_tpu

ON_TPU = jax.default_backend() == "tpu"
chip_only = pytest.mark.skipif(not ON_TPU, reason="needs a TPU (jax.default_backend() is not 'tpu')")


# -- references ----------------------------------------------------------------------------------------
def attention_reference(q, k, v, causal, scale=None):
    """SDPA in float32 at full precision, k and v repeated for grouped-query attention."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, 1), jnp.repeat(v, group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v.astype(jnp.float32), precision=hi)
    return out, jax.nn.logsumexp(s, -1)


def rms_norm_reference(x, w, eps):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * w


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _attention_inputs(batch, q_heads, kv_heads, seq_q, seq_k, head_dim, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (_normal(keys[0], (batch, q_heads, seq_q, head_dim), dtype),
            _normal(keys[1], (batch, kv_heads, seq_k, head_dim), dtype),
            _normal(keys[2], (batch, kv_heads, seq_k, head_dim), dtype),
            _normal(keys[3], (batch, q_heads, seq_q, head_dim), dtype))


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


# bf16: operands rounded to 8 bits before the MXU (p and ds too). float32 on a v5e: the gradients were
# 2-6e-5 from XLA's HIGHEST-precision reference (measured 2026-12-05; the output 8e-7), 1e-6 on CPU; most
# of that was the chip's log in the logsumexp (now refined: fa._log), and the reference's own logsumexp
# takes XLA's default log there, so the chip's bound waits for a new measurement
TOL = {"float32": 2e-4 if ON_TPU else 1e-5, "bfloat16": 2e-2}


def _check_attention(case, *, causal, dtype, blocks=(128, 128), x64=False, scale=None):
    with jax.enable_x64(x64), pallas_interpret_unless_tpu():
        q, k, v, g = _attention_inputs(*case, dtype)
        kernel = functools.partial(fa.flash_attention, causal=causal, scale=scale, block_q=blocks[0],
                                   block_k=blocks[1])
        out, pull = jax.vjp(kernel, q, k, v)
        grads = pull(g)
        _, lse = fa.flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=blocks[0],
                                            block_k=blocks[1])
        want, want_lse = attention_reference(q, k, v, causal, scale)
        _, want_pull = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal, scale)[0], q, k, v)
        want_grads = want_pull(g.astype(jnp.float32))
    assert out.dtype == q.dtype and lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    tol = TOL[jnp.dtype(dtype).name]
    errors = {"out": _rel(out, want), "lse": _rel(lse, want_lse)}
    errors.update({f"d{n}": _rel(a, b) for n, a, b in zip("qkv", grads, want_grads)})
    assert all(e < tol for e in errors.values()), f"relative errors {errors} above {tol}"
    for x, dx in zip((q, k, v), grads):
        assert dx.shape == x.shape and dx.dtype == x.dtype


# -- flash attention: values and gradients (interpret mode) ---------------------------------------------
# (batch, q_heads, kv_heads, seq_q, seq_k, head_dim): several blocks of 128, padded ends, grouped heads
@pytest.mark.parametrize("causal,x64", [(True, False), (False, True)], ids=["causal-x64off", "full-x64on"])
def test_flash_attention_gqa_uneven(causal, x64):
    _check_attention((1, 4, 2, 200, 330, 32), causal=causal, dtype=jnp.float32, x64=x64)


def test_flash_attention_more_queries_than_keys_causal():
    """Rows past seq_k see every key (SDPA's top-left causal mask); query and key blocks of unequal size."""
    _check_attention((1, 2, 1, 300, 200, 64), causal=True, dtype=jnp.float32, blocks=(128, 256))


@pytest.mark.parametrize("x64", [False, True], ids=["x64off", "x64on"])
def test_flash_attention_bf16(x64):
    _check_attention((1, 2, 1, 256, 256, 64), causal=True, dtype=jnp.bfloat16, x64=x64)


def test_flash_attention_tiny_and_scale():
    """Sequences shorter than one block (padded to 128), a head dim padded to 64, SDPA's scale."""
    _check_attention((1, 2, 2, 7, 9, 8), causal=True, dtype=jnp.float32, blocks=(512, 512), scale=0.3)


def test_flash_attention_gradients_survive_the_chips_log(monkeypatch):
    """The chip's float32 log, mocked: 1.5e-4 off on a v5e (relative, 2026-12-06), where the backward's
    ``p = exp(s - logsumexp)`` carried the logsumexp's error into every gradient (5e-5 to 2e-4)."""
    log = jnp.log
    monkeypatch.setattr(jnp, "log", lambda x: log(x) * np.float32(1 + 1.5e-4))
    _check_attention((1, 4, 2, 200, 330, 32), causal=False, dtype=jnp.float32)


def test_kernel_head_dims():
    """The head dims checked on a chip (64, multiples of 128); others are zero-padded up to one."""
    assert [fa.kernel_head_dim(d) for d in (8, 32, 64, 96, 128, 192, 256)] == [64, 64, 64, 128, 128, 256, 256]


def test_flash_attention_rejects_what_it_cannot_run():
    q = jnp.zeros((1, 4, 8, 16), jnp.float32)
    with pytest.raises(fa.AttentionShapeError, match=r"q_heads=4 must be a multiple of kv_heads=3"):
        fa.flash_attention(q, jnp.zeros((1, 3, 8, 16)), jnp.zeros((1, 3, 8, 16)))
    with pytest.raises(fa.AttentionShapeError, match=r"one dtype in \('bfloat16', 'float32'\); got "
                                                     r"q=float16\[1, 4, 8, 16\].*attention_reference"):
        fa.flash_attention(q.astype(jnp.float16), q.astype(jnp.float16), q.astype(jnp.float16))
    with pytest.raises(fa.AttentionShapeError, match=r"block_q=100 and block_k=128 must be multiples of 128"):
        fa.flash_attention(q, q, q, block_q=100, block_k=128)


# -- which tiles run, and what they copy in ---------------------------------------------------------------
def _pallas_calls(fn, *avals):
    """The pallas_call equations of fn's jaxpr, by kernel name."""
    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found[eqn.params["name"]] = eqn
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*avals).jaxpr)
    return found


def _block_indices(eqn, operand: int):
    """operand's block index at every grid step, in the order the grid runs."""
    mapping = eqn.params["grid_mapping"]
    closed = mapping.block_mappings[operand].index_map_jaxpr
    steps = np.ndindex(*mapping.grid)
    return [(step, tuple(int(i) for i in jax.core.eval_jaxpr(closed.jaxpr, closed.consts,
                                                                *map(jnp.int32, step))))
            for step in steps]


@pytest.mark.parametrize("seq_q,seq_k,blocks", [(512, 512, (128, 128)), (512, 300, (256, 128)),
                                                 (200, 640, (128, 256))])
def test_causal_tiles_above_the_diagonal_copy_nothing(seq_q, seq_k, blocks):
    """Every visible tile reads its own blocks; a skipped tile repeats a block index (Pallas then issues
    no copy), so the copies are those of the visible tiles only."""
    bq, bk = blocks
    q = jax.ShapeDtypeStruct((1, 2, seq_q, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 1, seq_k, 64), jnp.float32)

    def forward_and_backward(q, k, v):
        out, lse = fa.flash_attention_forward(q, k, v, causal=True, block_q=bq, block_k=bk)
        return fa.flash_attention_backward(q, k, v, out, lse, out, causal=True, block_q=bq, block_k=bk)

    calls = _pallas_calls(forward_and_backward, q, kv, kv)

    def visible(i, j):  # some key of block j at or before some query of block i
        rows, cols = np.arange(i * bq, (i + 1) * bq), np.arange(j * bk, (j + 1) * bk)
        return bool((cols[None, :] <= rows[:, None]).any())

    # (kernel, operand whose copies are skipped, block coordinate of that operand, tile of a step)
    cases = [("tpudist_flash_attention", 1, 2, lambda s: (s[2], s[3])),
             ("tpudist_flash_attention_dq", 1, 2, lambda s: (s[2], s[3])),
             ("tpudist_flash_attention_dkv", 0, 2, lambda s: (s[4], s[2]))]
    for name, operand, coordinate, tile in cases:
        steps = _block_indices(calls[name], operand)
        shown = [(step, index) for step, index in steps if visible(*tile(step))]
        assert len(shown) < len(steps), f"{name}: no tile skipped"
        for step, index in shown:
            want = tile(step)[1] if name != "tpudist_flash_attention_dkv" else tile(step)[0]
            assert index[coordinate] == want, f"{name} step {step}: block {index}, visible tile needs {want}"

        def copies(seq):
            return sum(1 for n, (_, index) in enumerate(seq) if n == 0 or index != seq[n - 1][1])

        assert copies(steps) == copies(shown), f"{name}: skipped tiles copy blocks in"


# -- the TPU lowering, on CPU ------------------------------------------------------------------------------
def _mosaic_modules(exported) -> dict[str, str]:
    """The Mosaic (MLIR) module of each Pallas kernel in an exported TPU program, as text."""
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    modules = {}
    text = exported.mlir_module()
    for match in re.finditer(r'\\22body\\22: \\22([A-Za-z0-9+/=]*)\\22.*?kernel_name = "([^"]*)"', text):
        context = ir.Context()
        context.allow_unregistered_dialects = True
        tpu.register_dialect(context)
        with context:
            modules[match.group(2)] = str(ir.Module.parse(base64.b64decode(match.group(1))))
    return modules


def _wide_values(module: str) -> list[str]:
    """Lines where a value (not an attribute) is 64-bit, and index maps (transform_*) returning one."""
    typed = re.compile(r":\s*\(([^)]*)\)\s*->\s*(.*)$")
    bad = []
    for line in module.splitlines():
        match = typed.search(line)
        if match and re.search(r"\b[if]64\b", match.group(1) + " " + match.group(2)):
            bad.append(line.strip())
    for args, results in re.findall(r'function_type = \(([^)]*)\) -> \(([^)]*)\), sym_name = "transform', module):
        if "i64" in results:
            bad.append(f"index map ({args}) -> ({results})")
    return bad


def _export_tpu(fn, *avals):
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals)


def test_wide_value_check_can_fail():
    """The check finds what the chip rejected: an index map returning a Python int under x64."""
    from jax.experimental import pallas as pl

    def double(x):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                              in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)

    with jax.enable_x64(True):
        modules = _mosaic_modules(_export_tpu(double, jax.ShapeDtypeStruct((16, 128), jnp.float32)))
    assert any("i64" in line for line in _wide_values(modules["<lambda>"] if "<lambda>" in modules
                                                           else next(iter(modules.values()))))


@pytest.mark.parametrize("x64", [False, True], ids=["x64off", "x64on"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tpu_lowering_has_int32_index_maps_and_no_64_bit_values(dtype, x64):
    """The target model's attention (GQA, causal) and an uneven one, forward and backward, and RMSNorm."""
    struct = jax.ShapeDtypeStruct

    def attention_grads(q, k, v):
        return jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v, causal=True), q, k, v)[1](jnp.ones(q.shape, q.dtype))

    def rms_norm_both(x, w):
        return rn.rms_norm_forward(x, w, eps=1e-5), rn.rms_norm_backward(x, w, x, eps=1e-5)

    programs = [(attention_grads, (struct((8, 16, 1024, 64), dtype), *[struct((8, 8, 1024, 64), dtype)] * 2)),
                (attention_grads, (struct((1, 2, 300, 128), dtype), *[struct((1, 2, 200, 128), dtype)] * 2)),
                (rms_norm_both, (struct((8192, 1024), dtype), struct((1024,), dtype))),
                (rms_norm_both, (struct((3, 5, 96), dtype), struct((96,), dtype)))]
    seen = set()
    with jax.enable_x64(x64):
        for fn, avals in programs:
            for name, module in _mosaic_modules(_export_tpu(fn, *avals)).items():
                seen.add(name)
                assert "transform_0" in module, f"{name}: no index maps found"
                assert not _wide_values(module), f"{name}: 64-bit values {_wide_values(module)[:3]}"
    assert seen == {"tpudist_flash_attention", "tpudist_flash_attention_dq", "tpudist_flash_attention_dkv",
                    "tpudist_rms_norm", "tpudist_rms_norm_backward"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tpu_lowering_float32_dots_ask_for_full_precision(dtype):
    """Every matmul of the three kernels: float32 operands at Mosaic's fp32 contract precision (torch's
    "highest", which tpudist traces under; interpret mode ignores it), bf16 ones at the MXU's default."""
    struct = jax.ShapeDtypeStruct

    def attention_grads(q, k, v):
        return jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v, causal=True), q, k, v)[1](jnp.ones(q.shape, q.dtype))

    with jax.default_matmul_precision("highest"):
        exported = _export_tpu(attention_grads, struct((1, 2, 16, 8), dtype), *[struct((1, 1, 9, 8), dtype)] * 2)
    matmuls = {name: [line for line in module.splitlines() if "tpu.matmul" in line]
               for name, module in _mosaic_modules(exported).items()}
    assert sorted(matmuls) == ["tpudist_flash_attention", "tpudist_flash_attention_dkv", "tpudist_flash_attention_dq"]
    for name, lines in matmuls.items():
        assert lines, f"{name}: no matmul found"
        assert all(("contract_precision<fp32>" in line) == (dtype == "float32") for line in lines), f"{name}: {lines}"


# -- RMSNorm ---------------------------------------------------------------------------------------------
def test_row_blocks():
    assert rn.row_block(5, 64, jnp.float32) == (5, 5)                # one block: any row count
    assert rn.row_block(8192, 1024, jnp.bfloat16) == (256, 8192)     # 1 MiB of float32 rows
    assert rn.row_block(8192 + 16, 1024, jnp.bfloat16) == (144, 8208)  # a divisor, 16-row multiple
    assert rn.row_block(4099, 1024, jnp.float32) == (256, 4352)      # no divisor: padded


@pytest.mark.parametrize("x64", [False, True], ids=["x64off", "x64on"])
@pytest.mark.parametrize("shape,dtype,w_dtype", [((3, 5, 96), "bfloat16", "bfloat16"),
                                                  ((600, 256), "float32", "float32"),  # 2 blocks + padding
                                                  ((4, 64), "bfloat16", "float32")])
def test_rms_norm_forward_backward(shape, dtype, w_dtype, x64, monkeypatch):
    monkeypatch.setattr(rn, "BLOCK_BYTES", 256 * 256 * 4)  # 256-row blocks: several, and a padded one
    keys = jax.random.split(jax.random.key(3), 2)
    x, g = _normal(keys[0], shape, dtype), _normal(keys[1], shape, jnp.result_type(dtype, w_dtype))
    w = jnp.linspace(0.5, 1.5, shape[-1], dtype=jnp.float32).astype(w_dtype)
    with jax.enable_x64(x64), pallas_interpret_unless_tpu():
        y = rn.rms_norm_forward(x, w, eps=1e-5)
        dx, dw = rn.rms_norm_backward(x, w, g, eps=1e-5)
        want, pull = jax.vjp(lambda x, w: rms_norm_reference(x, w, 1e-5), x, w)
        want_dx, _ = pull(g)
    # the weight gradient against float64: the reference sums bf16 products in bf16, the kernel in float32
    xf, gf = np.asarray(x, np.float64), np.asarray(g, np.float64)
    normed = (xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5)).astype(np.float32)
    normed = np.asarray(jnp.asarray(normed).astype(dtype), np.float64)
    exact_dw = (gf * normed).reshape(-1, shape[-1]).sum(0)
    assert y.dtype == want.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert _rel(y, want) <= tol and _rel(dx, want_dx) <= tol and _rel(dw, exact_dw) <= tol


def test_rms_norm_padded_rows_stay_finite_with_eps_zero(monkeypatch):
    monkeypatch.setattr(rn, "BLOCK_BYTES", 64 * 128 * 4)
    x = _normal(jax.random.key(4), (70, 128), jnp.float32)  # 64-row blocks: 58 pad rows
    with pallas_interpret_unless_tpu():
        _, dw = rn.rms_norm_backward(x, jnp.ones(128), jnp.ones((70, 128)), eps=0.0)
    assert np.isfinite(np.asarray(dw)).all()


# -- on a TPU --------------------------------------------------------------------------------------------
@chip_only
@pytest.mark.parametrize("x64", [False, True], ids=["x64off", "x64on"])
def test_chip_flash_attention_target_shape(x64):
    """The target model's attention (batch 8, 16 heads on 8 kv heads, seq 1024, head_dim 64, bf16)."""
    _check_attention((8, 16, 8, 1024, 1024, 64), causal=True, dtype=jnp.bfloat16, blocks=(None, None), x64=x64)


@chip_only
def test_chip_flash_attention_float32_uneven():
    _check_attention((1, 4, 2, 900, 640, 128), causal=True, dtype=jnp.float32, blocks=(256, 512))


@chip_only
def test_chip_rms_norm(monkeypatch):
    test_rms_norm_forward_backward((8192, 1024), "bfloat16", "bfloat16", True, monkeypatch)


@chip_only
def test_chip_sdpa_rule_sees_the_tpu(monkeypatch):
    """The device's SDPA lowering takes the kernels on the chip: for concrete arrays and while tracing."""
    from tpudist.kernels import tpu_sdpa

    monkeypatch.delenv(tpu_sdpa.ENV, raising=False)
    q, k = jnp.zeros((1, 2, 512, 64), jnp.bfloat16), jnp.zeros((1, 1, 512, 64), jnp.bfloat16)
    seen = []
    jax.jit(lambda q, k: seen.append(tpu_sdpa.why_not(q, k, k)) or q)(q, k)
    assert [tpu_sdpa.why_not(q, k, k), *seen] == [None, None]
