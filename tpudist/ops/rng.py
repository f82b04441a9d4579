"""Where random lowerings get their keys: a key source the caller (device, compile backend) sets.

Random aten ops (``bernoulli``, ``native_dropout``, ``rand``/``randn``/``randint``, ``uniform``,
``normal``, ``exponential``, ``randperm``, ``multinomial``, dropout inside
``_scaled_dot_product_flash_attention_for_cpu``) take no key in their schema (their ``generator=``
argument is ignored). Their lowerings call ``next_key()``, which splits the key of the source the
caller installed with ``keys(...)``. The same key gives the same numbers; the k-th random op under one
source gets the k-th split, so one program draws independent numbers per op.

How the callers supply keys:

- The "tpu" device (``tpudist.device``): each random op gets ``fold_in(key(seed), counter)``, where
  ``seed`` is ``torch.tpu.manual_seed``'s and ``counter`` counts the random ops drawn since; the key
  is an input of the op's (or the fused graph's) program, never a baked-in constant, so a cached
  program draws fresh numbers on every run.
- The compile backend (``tpudist.compile``): each compiled graph takes raw ``uint32[2]`` key data as
  its first input, drawn from torch's default generator per call (``torch.manual_seed(s)`` gives the
  same dropout masks every run); the interpreter runs the graph under ``keys(KeySource(key_data))``.
- Tests and tools: ``with keys(KeySource(jax.random.key(seed))):`` (``tpudist.ops.opcheck.run_on_jax``
  does this).

Both new-style typed keys (``jax.random.key``) and raw ``uint32[2]`` key data work.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax


class KeySource:
    """Hands out fresh subkeys of ``key`` (a ``jax.random`` key, possibly a tracer)."""

    def __init__(self, key):
        self._key = key
        self.num_drawn = 0

    def next(self):
        self._key, sub = jax.random.split(self._key)
        self.num_drawn += 1
        return sub

    @property
    def key(self):
        """The key the next draw splits."""
        return self._key

    def advance(self, key, num_drawn: int) -> None:
        """Continue from ``key`` after ``num_drawn`` more draws (made by a copy of this source in a
        nested trace, whose final key came back out of it)."""
        self._key = key
        self.num_drawn += num_drawn


_SOURCE: contextvars.ContextVar[KeySource | None] = contextvars.ContextVar("tpudist_ops_keys", default=None)


@contextlib.contextmanager
def keys(source: KeySource):
    """Random lowerings called inside this block draw their keys from ``source``."""
    token = _SOURCE.set(source)
    try:
        yield source
    finally:
        _SOURCE.reset(token)


def current_source() -> KeySource | None:
    """The source installed with :func:`keys`, or None."""
    return _SOURCE.get()


def next_key():
    """A fresh key from the installed source; RuntimeError if the caller installed none."""
    source = _SOURCE.get()
    if source is None:
        raise RuntimeError("a random aten op was lowered with no key source installed: wrap the call in "
                           "`with tpudist.ops.rng.keys(KeySource(key)):` (the device and the compile "
                           "backend do this for their programs)")
    return source.next()
