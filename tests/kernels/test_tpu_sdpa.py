"""The device's SDPA lowering picks the Pallas flash attention on a TPU only, where it measured faster.

Off TPU the lowering must compute exactly what it did before. The TPU side is tested on CPU by
pretending the arrays live on a TPU (``tpu_sdpa._platform``) and running the kernels in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpudist.kernels import flash_attention as fa
from tpudist.kernels import tpu_sdpa
from tpudist.kernels.tpu_blocks import pallas_interpret_unless_tpu
from tpudist.ops.lowerings import nn


def _qkv(seq=512, head_dim=64, dtype=jnp.bfloat16, q_heads=2, kv_heads=1):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, q_heads, seq, head_dim)).astype(dtype)
    k = jax.random.normal(keys[1], (1, kv_heads, seq, head_dim)).astype(dtype)
    v = jax.random.normal(keys[2], (1, kv_heads, seq, head_dim)).astype(dtype)
    g = jax.random.normal(keys[3], (1, q_heads, seq, head_dim)).astype(dtype)
    return q, k, v, g


@pytest.fixture
def on_tpu(monkeypatch):
    """The arrays count as a TPU's; the kernels run in interpret mode."""
    monkeypatch.setattr(tpu_sdpa, "_platform", lambda *arrays: "tpu")
    monkeypatch.delenv(tpu_sdpa.ENV, raising=False)
    with pallas_interpret_unless_tpu():
        yield


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="checks the CPU path")
def test_cpu_keeps_the_xla_attention_bit_for_bit():
    q, k, v, g = _qkv()
    assert tpu_sdpa.why_not(q, k, v) == "the arrays are not on a TPU (platform 'cpu')"
    out, lse = nn.sdpa_flash_cpu(q, k, v, 0.0, True)
    want_out, want_lse = nn._flash_low_precision(q, k, v, None, True, None)  # noqa: SLF001
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    grads = nn.sdpa_flash_cpu_backward(g, q, k, v, out, lse, 0.0, True)
    want = nn._flash_backward(g, q, k, v, out, lse, None, True, None)  # noqa: SLF001
    for got, ref in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_the_rules(on_tpu, monkeypatch):
    q, k, v, _ = _qkv()
    assert tpu_sdpa.why_not(q, k, v) is None
    assert "attn_mask" in tpu_sdpa.why_not(q, k, v, attn_mask=jnp.ones((512, 512), bool))
    assert "dropout" in tpu_sdpa.why_not(q, k, v, dropout_p=0.1)
    assert tpu_sdpa.why_not(*_qkv(dtype=jnp.float32)[:3]) == (
        "dtype float32: the kernels measured faster for ('bfloat16',) only")
    assert tpu_sdpa.why_not(*_qkv(head_dim=32)[:3]) == "head_dim 32 (v: 32): measured for (64, 128)"
    assert tpu_sdpa.why_not(*_qkv(seq=256)[:3]) == "seq_q=256, seq_k=256: XLA is faster below 512"
    assert "kv heads dividing q heads" in tpu_sdpa.why_not(*_qkv(q_heads=4, kv_heads=3)[:3])
    monkeypatch.setenv(tpu_sdpa.ENV, "0")
    assert tpu_sdpa.why_not(q, k, v) == "TPUDIST_PALLAS_SDPA=0"


def test_lowering_runs_the_kernels_on_tpu(on_tpu):
    q, k, v, g = _qkv()
    out, lse = nn.sdpa_flash_cpu(q, k, v, 0.0, True, scale=0.2)
    want_out, want_lse = fa.flash_attention_forward(q, k, v, causal=True, scale=0.2)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    grads = nn.sdpa_flash_cpu_backward(g, q, k, v, out, lse, 0.0, True, scale=0.2)
    want = fa.flash_attention_backward(q, k, v, out, lse, g, causal=True, scale=0.2)
    for got, ref in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    # and they agree with the XLA path the lowering takes otherwise (bf16 rounding apart)
    xla_out, xla_lse = nn._flash_low_precision(q, k, v, None, True, 0.2)  # noqa: SLF001
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla_out, np.float32), atol=3e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(xla_lse), rtol=1e-5, atol=1e-5)


def test_lowering_keeps_xla_where_the_kernels_do_not_apply(on_tpu, monkeypatch):
    q, k, v, _ = _qkv()
    mask = jnp.tril(jnp.ones((512, 512), bool))
    out, _ = nn.sdpa_flash_cpu(q, k, v, 0.0, False, attn_mask=mask)
    want, _ = nn._flash_low_precision(q, k, v, mask, False, None)  # noqa: SLF001
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    monkeypatch.setenv(tpu_sdpa.ENV, "0")
    out, _ = nn.sdpa_flash_cpu(q, k, v, 0.0, True)
    want, _ = nn._flash_low_precision(q, k, v, None, True, None)  # noqa: SLF001
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
