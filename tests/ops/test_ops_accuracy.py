"""float32 transcendental functions carry ``accuracy=HIGHEST`` in every program tpudist traces
(``tpudist.ops.accuracy``): XLA's TPU default approximates them (float32 ``log`` was 4027 ulp off on a
TPU v5e). XLA:CPU computes the same values either way, so on CPU the programs are read: every
``exponential``/``log``/``tanh``/... on float32 values that the program uses has the attribute. The
chip's numbers: tests/device/test_device_float32_accuracy.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tpudist.ops as tops
from tpudist.ops import accuracy, call

aten = torch.ops.aten

_TRANSCENDENTAL = re.compile(r"(%[\w#]+) = stablehlo\.(exponential_minus_one|exponential|log_plus_one|log|tanh|"
                             r"logistic|sine|cosine|tan|sqrt|rsqrt|cbrt)\b(.*)")


def transcendentals(text: str) -> list[tuple[str, str, bool]]:
    """(name, element type, accurate) of each transcendental of a StableHLO text whose result is used.

    JAX's lowering of an op with ``accuracy`` also writes the plain op, unused (XLA removes it)."""
    found = []
    for function in text.split("func.func")[1:]:  # value names are per function
        for match in _TRANSCENDENTAL.finditer(function):
            value, name, rest = match.groups()
            if len(re.findall(re.escape(value) + r"(?![\w#])", function)) < 2:
                continue  # defined, never read
            element = re.search(r"tensor<(?:[\dx]*x)?(\w+)>\s*$", rest).group(1)
            found.append((name, element, "result_accuracy_mode<HIGHEST>" in rest))
    return found


def lowered(fn, *args) -> str:
    with jax.enable_x64(True):
        return jax.jit(fn).lower(*args).as_text()


def test_transcendentals_reads_jax_text():
    """The parser against JAX's own text with and without the attribute: it must tell them apart."""
    x = jnp.ones(4, jnp.float32)
    text = jax.jit(lambda v: (jax.lax.exp(v), jax.lax.log(v, accuracy=jax.lax.AccuracyMode.HIGHEST))).lower(x).as_text()
    assert transcendentals(text) == [("exponential", "f32", False), ("log", "f32", True)]


CASES = {
    "exp": (aten.exp.default, ()), "log": (aten.log.default, ()), "log1p": (aten.log1p.default, ()),
    "expm1": (aten.expm1.default, ()), "tanh": (aten.tanh.default, ()), "sigmoid": (aten.sigmoid.default, ()),
    "sin": (aten.sin.default, ()), "rsqrt": (aten.rsqrt.default, ()),
    "softmax": (aten._softmax.default, (-1, False)), "log_softmax": (aten._log_softmax.default, (-1, False)),
    "gelu_tanh": (aten.gelu.default, ()), "silu": (aten.silu.default, ()), "softplus": (aten.softplus.default, (1, 20)),
    "logsumexp": (aten.logsumexp.default, ([-1],)), "cos": (aten.cos.default, ()), "sqrt": (aten.sqrt.default, ()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_transcendentals_are_accurate(name):
    op, rest = CASES[name]
    kwargs = {"approximate": "tanh"} if name == "gelu_tanh" else {}
    x = jnp.linspace(0.1, 3.0, 12, dtype=jnp.float32).reshape(3, 4)
    found = transcendentals(lowered(lambda v: call(op, v, *rest, **kwargs), x))
    assert found, name  # the op computes at least one
    assert all(element == "f32" and accurate for _, element, accurate in found), found


def test_other_dtypes():
    """float64 functions keep XLA's choice (the attribute is for float32 only); bf16 ones compute in
    float32, as torch's CPU kernels do, and take it there."""
    with jax.enable_x64(True):
        x64, x16 = jnp.ones(4, jnp.float64), jnp.ones(4, jnp.bfloat16)
    assert transcendentals(lowered(lambda v: call(aten.tanh.default, v), x64)) == [("tanh", "f64", False)]
    assert transcendentals(lowered(lambda v: call(aten.tanh.default, v), x16)) == [("tanh", "f32", True)]


def test_backward_ops_and_decompositions_are_accurate():
    """A backward lowering, and an op torch decomposes (run through ``call`` op by op)."""
    x = jnp.linspace(0.1, 3.0, 8, dtype=jnp.float32)
    for fn in (lambda v: call(aten.tanh_backward.default, v, call(aten.tanh.default, v)),
               lambda v: call(aten.logit.default, v / 4),
               lambda v: call(aten.mish.default, v)):
        found = transcendentals(lowered(fn, x))
        assert found and all(accurate for _, _, accurate in found), found


def test_concrete_calls_run_the_lowering_as_is():
    x = jnp.linspace(0.1, 3.0, 8, dtype=jnp.float32)
    with jax.enable_x64(True):
        np.testing.assert_allclose(np.asarray(call(aten.exp.default, x)), np.exp(np.asarray(x)), rtol=1e-6)


def _draws(seed, p):
    with tops.keys(tops.KeySource(jax.random.key(seed))) as source:
        out = (call(aten.bernoulli.default, p), call(aten.normal.Tensor_Tensor, p, p),
               call(aten.exponential.default, p), call(aten.native_dropout.default, p, 0.3, True))
        return out, source.num_drawn


def test_random_ops_draw_what_they_drew_without_the_rewrite():
    """A random lowering splits the installed key source's key inside the nested trace: the numbers,
    the count of draws and the key the next op gets are those of the plain lowering."""
    p = jnp.full((64,), 0.5, jnp.float32)
    with jax.enable_x64(True):
        got = jax.jit(_draws)(jnp.uint32(3), p)
        token = accuracy._TRACING.set(True)  # noqa: SLF001 - the plain path, for the reference
        try:
            want = jax.jit(_draws)(jnp.uint32(3), p)
        finally:
            accuracy._TRACING.reset(token)  # noqa: SLF001
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    assert int(got[1]) == 4


def test_pallas_kernel_bodies_are_left_to_mosaic():
    """A Pallas kernel's body is Mosaic's: the rewrite does not enter it (Mosaic rejects unknown
    attributes); the program around it is rewritten."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.exp(x_ref[...])

    def f(x):
        return jnp.tanh(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x))

    closed = accuracy.accurate(jax.make_jaxpr(f)(jnp.ones((8, 128), jnp.float32)))
    outer = {eqn.primitive.name: eqn for eqn in closed.jaxpr.eqns}
    assert outer["tanh"].params["accuracy"] is jax.lax.AccuracyMode.HIGHEST
    body = outer["pallas_call"].params["jaxpr"]
    assert [e.params.get("accuracy") for e in body.eqns if e.primitive.name == "exp"] == [None]


# -- a number to a float32 power near 1 (tpudist/ops/lowerings/_number_pow.py) ----------------------
@pytest.mark.parametrize("base", [0.999, 0.95, 0.9, 2.0])
def test_number_to_a_power_near_one_is_correctly_rounded(base):
    """``aten.pow.Scalar`` of a number, as AdamW's ``1 - 0.999 ** step`` has it, where the result is near 1:
    correctly rounded but within 0.005 ulp of a tie (XLA's CPU pow misrounds more of them), from float32
    adds and multiplies that XLA's simplifier must leave alone (folding its exact sums gave 1.0 ulp);
    beyond, XLA's pow as before."""
    from tpudist.ops.lowerings._number_pow import NEAR

    b32 = np.float32(base)
    log = np.log(np.float64(b32))
    steps = np.arange(1, min(int(NEAR / abs(log)), 2000) + 1)
    near = np.concatenate([steps, np.random.default_rng(0).uniform(-NEAR, NEAR, 1 << 16) / log]).astype(np.float32)
    far = (np.linspace(-10, 10, 401) / log).astype(np.float32)
    far = far[np.abs(far * log) > NEAR]
    with jax.enable_x64(True):
        power = jax.jit(lambda y: call(aten.pow.Scalar, base, y))
        plain = jax.jit(lambda y: jnp.power(b32, y))
        got, got_plain = np.asarray(power(jnp.asarray(near))), np.asarray(plain(jnp.asarray(near)))
        np.testing.assert_array_equal(np.asarray(power(jnp.asarray(far))), np.asarray(plain(jnp.asarray(far))))
    want = np.float64(b32) ** near.astype(np.float64)
    spacing = np.spacing(want.astype(np.float32)).astype(np.float64)
    error, error_plain = (np.abs(g.astype(np.float64) - want) / spacing for g in (got, got_plain))
    assert error.max() <= 0.505, (float(error.max()), near[error.argmax()])
    assert (error > 0.5).sum() < (error_plain > 0.5).sum() / 2, ((error > 0.5).sum(), (error_plain > 0.5).sum())
