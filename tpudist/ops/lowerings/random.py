"""Random ops. Each draws a fresh key from ``tpudist.ops.rng.next_key()`` (the caller's key source).

``generator=`` arguments are ignored: the key source is the only source of randomness (see ``rng``).
Distributions match torch's in law, not bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.bridge import to_jax_dtype
from tpudist.ops.lowerings._util import is_array, is_zero, upcast
from tpudist.ops.registry import lowers
from tpudist.ops.rng import next_key

aten = torch.ops.aten


def _float_dtype(dtype, like=None):
    if dtype is not None:
        return to_jax_dtype(dtype)
    return like.dtype if like is not None else to_jax_dtype(torch.get_default_dtype())


def _uniform(shape, dtype, low=0.0, high=1.0):
    floating = jnp.issubdtype(dtype, jnp.floating)
    draw_dtype = dtype if floating and jnp.dtype(dtype).itemsize >= 4 else jnp.float32
    return jax.random.uniform(next_key(), tuple(shape), draw_dtype, low, high)


@lowers(aten.bernoulli.default)
def bernoulli(p, *, generator=None):
    return jax.random.uniform(next_key(), p.shape, jnp.float32) < upcast(p)


@lowers(aten.bernoulli.p)
def bernoulli_p(x, p=0.5, *, generator=None):
    return jax.random.bernoulli(next_key(), p, x.shape)


@lowers(aten.bernoulli.Tensor)
def bernoulli_tensor(x, p, *, generator=None):
    return jax.random.uniform(next_key(), x.shape, jnp.float32) < jnp.broadcast_to(upcast(p), x.shape)


@lowers(aten.native_dropout.default)
def native_dropout(x, p, train):
    # p may be a traced scalar (the device passes Python floats as program inputs): no branching on it
    if train is False or is_zero(p):
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(next_key(), 1.0 - p, x.shape)
    return jnp.where(keep, upcast(x) * (1.0 / (1.0 - p)), 0), keep


@lowers(aten.rand.default, aten.rand.generator)
def rand(size, *, generator=None, dtype=None, **_placement):
    return _uniform(size, _float_dtype(dtype))


@lowers(aten.randn.default, aten.randn.generator)
def randn(size, *, generator=None, dtype=None, **_placement):
    return jax.random.normal(next_key(), tuple(size), jnp.promote_types(_float_dtype(dtype), jnp.float32))


@lowers(aten.rand_like.default)
def rand_like(x, *, dtype=None, **_placement):
    return _uniform(x.shape, _float_dtype(dtype, x))


@lowers(aten.randn_like.default)
def randn_like(x, *, dtype=None, **_placement):
    return jax.random.normal(next_key(), x.shape, jnp.promote_types(_float_dtype(dtype, x), jnp.float32))


@lowers(aten.randint.default, aten.randint.generator)
def randint(high, size, *, generator=None, dtype=None, **_placement):
    return jax.random.randint(next_key(), tuple(size), 0, high, jnp.int64)


@lowers(aten.randint.low, aten.randint.low_generator)
def randint_low(low, high, size, *, generator=None, dtype=None, **_placement):
    return jax.random.randint(next_key(), tuple(size), low, high, jnp.int64)


@lowers(aten.randint_like.default)
def randint_like(x, high, *, dtype=None, **_placement):
    return jax.random.randint(next_key(), x.shape, 0, high, jnp.int64)


@lowers(aten.randint_like.low_dtype)
def randint_like_low(x, low, high, *, dtype=None, **_placement):
    return jax.random.randint(next_key(), x.shape, low, high, jnp.int64)


@lowers(aten.random.default, aten.random.to, getattr(aten.random, "from"))
def random_(x, *bounds, generator=None):
    low, high = (0, bounds[0]) if len(bounds) == 1 else bounds if bounds else (0, None)
    if high is None:
        high = 2 ** (jnp.finfo(x.dtype).nmant + 1) if jnp.issubdtype(x.dtype, jnp.floating) else (
            2 if x.dtype == jnp.bool_ else int(jnp.iinfo(x.dtype).max) + 1)
    return jax.random.randint(next_key(), x.shape, low, high, jnp.int64)


@lowers(aten.uniform.default)
def uniform(x, from_=0.0, to=1.0, *, generator=None):
    return _uniform(x.shape, x.dtype, from_, to)


@lowers(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
def normal(mean, std=1.0, *, generator=None):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dtype = jnp.promote_types(jnp.result_type(mean if is_array(mean) else std), jnp.float32)
    return mean + std * jax.random.normal(next_key(), shape, dtype)


@lowers(aten.normal.float_float)
def normal_float_float(mean, std, size, *, generator=None, dtype=None, **_placement):
    return mean + std * jax.random.normal(next_key(), tuple(size), jnp.promote_types(_float_dtype(dtype), jnp.float32))


@lowers(aten.normal_functional.default)
def normal_functional(x, mean=0.0, std=1.0, *, generator=None):
    return mean + std * jax.random.normal(next_key(), x.shape, jnp.promote_types(x.dtype, jnp.float32))


@lowers(aten.exponential.default)
def exponential(x, lambd=1.0, *, generator=None):
    return jax.random.exponential(next_key(), x.shape, jnp.promote_types(x.dtype, jnp.float32)) / lambd


@lowers(aten.poisson.default)
def poisson(rates, generator=None):
    """One Poisson count per rate, in the rates' dtype (JAX draws the counts as integers; 16-bit rates draw in
    float32). A rate of 0 gives 0. torch's CPU kernel raises on a negative rate: a data-dependent check the
    device makes in Debug mode only (as its index checks); JAX returns -1 there."""
    counts = jax.random.poisson(next_key(), upcast(rates), rates.shape, dtype=jnp.int64)
    return counts.astype(rates.dtype)


@lowers(aten.randperm.default, aten.randperm.generator)
def randperm(n, *, generator=None, dtype=None, **_placement):
    return jax.random.permutation(next_key(), n).astype(jnp.int64)


@lowers(aten.multinomial.default)
def multinomial(probs, num_samples, replacement=False, *, generator=None):
    logits = jnp.log(upcast(probs))
    key = next_key()
    if replacement:
        return jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + logits.shape[:-1]).T.reshape(
            *logits.shape[:-1], num_samples) if logits.ndim > 1 else jax.random.categorical(
            key, logits, shape=(num_samples,))
    gumbel = jax.random.gumbel(key, logits.shape, logits.dtype)
    return jnp.argsort(-(logits + gumbel), axis=-1)[..., :num_samples]
