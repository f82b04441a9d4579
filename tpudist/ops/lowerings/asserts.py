"""Runtime assertions: ``_assert_async`` (``torch._assert_async``), ``_assert_scalar`` and their
functional forms (the ones ``torch.export``/Dynamo graphs and torchtitan-style checks emit).

A concrete value is checked at once, raising torch's RuntimeError. A traced value (inside a jitted
kernel or a fused program) is checked by a host callback when the program runs: the program then
fails with that RuntimeError in its message, as a CUDA device-side assert surfaces at the next
synchronisation. Never ignored: a check that cannot run would be a silent pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.ops.host_checks import host_check
from tpudist.ops.lowerings._util import is_array
from tpudist.ops.registry import lowers

aten = torch.ops.aten
prims = torch.ops.prims
_NONZERO = "Expected Tensor with single nonzero value, but got zero"


def _raise_if_zero(value, message: str) -> None:
    if not np.asarray(value).item():
        raise RuntimeError(message)


def check(value, message: str) -> None:
    """Raise RuntimeError(message) if ``value`` (one element) is zero/False, now or when the program runs."""
    if is_array(value) and value.size != 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    if isinstance(value, jax.core.Tracer):
        host_check(_raise_if_zero, value.reshape(()) != 0, message)
    else:
        _raise_if_zero(jnp.asarray(value).reshape(()) != 0, message)


@lowers(aten._assert_async.default)
def assert_async(x):
    check(x, _NONZERO)


@lowers(aten._assert_async.msg)
def assert_async_msg(x, assert_msg):
    check(x, assert_msg)


@lowers(aten._assert_scalar.default)
def assert_scalar(x, assert_msg):
    check(x, assert_msg)


@lowers(aten._functional_assert_async.msg)
def functional_assert_async(x, assert_msg, dep_token):
    check(x, assert_msg)
    return dep_token


@lowers(aten._functional_assert_scalar.default)
def functional_assert_scalar(x, assert_msg, dep_token):
    check(x, assert_msg)
    return dep_token


# Effect tokens: AOTAutograd orders ops with side effects (the checks above, torch.linalg's
# _linalg_check_errors) through with_effects(token, op, ...); with unlift_effect_tokens the graph makes
# and sinks its tokens itself. The token carries no data: the host callbacks are effects in the program.
@lowers(prims._make_token.default)
def make_token():
    return jnp.zeros((0,), jnp.float32)


@lowers(prims._sink_tokens.default)
def sink_tokens(tokens):
    return None
