"""Checks a program runs on the host (``jax.debug.callback``): torch's runtime asserts and linalg errors.

A check that fails raises in its callback. Where that error goes depends on the platform: XLA:CPU runs
the callback inside the program's call, which then raises it; a TPU's runtime gives it to the program's
runtime token alone (the call returns, its results are fine, and the error comes out at
``jax.effects_barrier``, or at exit). So whoever runs a program that traced a check calls
:func:`raise_failed` after it: the error then comes out of that call on every platform.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

TRACED = [0]  # host checks traced in this process: a program whose trace moved it holds one


def host_check(fn: Callable[..., None], *args: Any) -> None:
    """``jax.debug.callback(fn, *args)``, counted in :data:`TRACED`."""
    TRACED[0] += 1
    jax.debug.callback(fn, *args)


def raise_failed() -> None:
    """Wait for the programs with host checks dispatched from this thread; raise a failed check's error
    (``JaxRuntimeError``, the check's message in it)."""
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        from jax._src import dispatch

        dispatch.runtime_tokens.clear()  # the failed token stays otherwise: every later barrier would raise
        raise
