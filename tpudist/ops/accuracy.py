"""float32 transcendental functions as accurate as torch's CPU kernels, on every backend.

XLA's TPU compiler approximates float32 ``exp``, ``log``, ``tanh``, ... by default: on a TPU v5e
(jax 0.10.2, float32 inputs against float64) ``log`` and ``log1p`` were up to 4029 ulp off, ``expm1``
1754, ``tanh`` 1365, ``exp`` 60, where torch's CPU kernels are within a few ulp; a float32 model's
losses and gradients moved with them. ``accuracy=HIGHEST`` gave 3, 2, 8, 1 ulp at the same speed
(scripts/probes/transcendental_accuracy.py). CPU results are the same either way.

:func:`run` calls a lowering so that every such function on float32 values in the program it traces
carries ``accuracy=HIGHEST``: the lowering is traced to a jaxpr once, its float32 transcendental
equations get the accuracy (nested jaxprs too, Pallas kernel bodies excepted: Mosaic makes its own
choice), and the jaxpr is evaluated into the caller's trace. Lowerings stay plain ``jnp`` code, and
``jax.nn``/``jax.scipy`` functions they call are covered as well. Lowerings called on concrete
arrays (ops with data-dependent shapes, run outside a program) run as they are.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.tree_util import tree_flatten, tree_unflatten

from tpudist._jaxprs import map_equations
from tpudist.ops import rng

# lax's primitives that take an ``accuracy`` (jax 0.10); erf has none
PRIMITIVES = frozenset(p.name for p in (lax.exp_p, lax.exp2_p, lax.log_p, lax.log1p_p, lax.expm1_p, lax.tanh_p,
                                        lax.logistic_p, lax.sin_p, lax.cos_p, lax.tan_p, lax.sqrt_p,
                                        lax.rsqrt_p, lax.cbrt_p))
ACCURACY = lax.AccuracyMode.HIGHEST
_SKIP = frozenset({"pallas_call"})

# set while a lowering is traced for rewriting: lowerings it calls (decompositions, helpers calling
# ``tpudist.ops.call``) are inside that trace already and run plainly
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("tpudist_accuracy_tracing", default=False)


def _update(eqn) -> dict | None:
    if (eqn.primitive.name in PRIMITIVES and eqn.params.get("accuracy") is None
            and eqn.outvars[0].aval.dtype == jnp.float32):
        return {**eqn.params, "accuracy": ACCURACY}
    return None


def accurate(closed_jaxpr: Any) -> Any:
    """``closed_jaxpr`` with ``accuracy=HIGHEST`` on its float32 transcendental equations."""
    return map_equations(closed_jaxpr, _update, _SKIP)


def run(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``lowering(*args, **kwargs)``, its float32 transcendentals accurate (see the module doc)."""
    if _TRACING.get():
        return lowering(*args, **kwargs)
    leaves, treedef = tree_flatten((args, kwargs))
    traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
    if not traced:
        return lowering(*args, **kwargs)

    # a random lowering splits the installed source's key: the key goes through the nested trace as
    # an input and comes out as an output, so no tracer of the nested trace is left in the source
    source = rng.current_source()
    inner = None

    def traced_lowering(key, *values):
        nonlocal inner
        full = list(leaves)
        for i, v in zip(traced, values):
            full[i] = v
        a, k = tree_unflatten(treedef, full)
        if key is None:
            return lowering(*a, **k), None
        inner = rng.KeySource(key)
        with rng.keys(inner):
            return lowering(*a, **k), inner.key

    inputs = [None if source is None else source.key, *[leaves[i] for i in traced]]
    token = _TRACING.set(True)
    try:
        closed, out_shape = jax.make_jaxpr(traced_lowering, return_shape=True)(*inputs)
    finally:
        _TRACING.reset(token)
    closed = accurate(closed)
    flat_inputs = tree_flatten(inputs)[0]
    result, key = tree_unflatten(tree_flatten(out_shape)[1], jax.core.eval_jaxpr(closed.jaxpr, closed.consts,
                                                                                  *flat_inputs))
    if source is not None:
        source.advance(key, inner.num_drawn)
    return result
