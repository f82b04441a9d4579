"""Where random lowerings get their keys: a key source the caller (device, compile backend) sets.

Random aten ops (``bernoulli``, ``native_dropout``, ``uniform``, ``normal``, ``randperm`` ...) take no
key in their schema. Their lowerings call ``next_key()``, which splits the key of the source that
the caller installed with ``keys(...)``: inside a traced program that key is a program input, so a
cached program draws fresh numbers on every run and one seed gives one stream.
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


_SOURCE: contextvars.ContextVar[KeySource | None] = contextvars.ContextVar("tpudist_ops_keys", default=None)


@contextlib.contextmanager
def keys(source: KeySource):
    """Random lowerings called inside this block draw their keys from ``source``."""
    token = _SOURCE.set(source)
    try:
        yield source
    finally:
        _SOURCE.reset(token)


def next_key():
    """A fresh key from the installed source; RuntimeError if the caller installed none."""
    source = _SOURCE.get()
    if source is None:
        raise RuntimeError("a random aten op was lowered with no key source installed: wrap the call in "
                           "`with tpudist.ops.rng.keys(KeySource(key)):` (the device and the compile "
                           "backend do this for their programs)")
    return source.next()
