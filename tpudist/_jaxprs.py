"""Questions about traced programs (jaxprs) that the layers above ask before running them."""

from __future__ import annotations

from typing import Any, Callable, Iterator


def any_equation(jaxpr: Any, test: Callable[[Any], bool]) -> bool:
    """Whether ``test(eqn)`` holds for an equation of a (closed) jaxpr or of a jaxpr nested in one
    (jit, custom_jvp/vjp, scan, cond branches, pallas_call bodies)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(test(eqn) or any(any_equation(inner, test) for inner in nested(eqn)) for eqn in jaxpr.eqns)


def nested(eqn: Any) -> Iterator[Any]:
    """The jaxprs an equation's parameters hold (one, or a list of branches)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield inner
