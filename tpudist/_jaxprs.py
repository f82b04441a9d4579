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


def map_equations(jaxpr: Any, update: Callable[[Any], dict | None], skip: frozenset = frozenset()) -> Any:
    """``jaxpr`` (closed or open) with each equation's parameters replaced by ``update(eqn)`` where
    that is not None, in nested jaxprs too except inside equations whose primitive name is in
    ``skip`` (a Pallas kernel body is Mosaic's, not XLA's). Returns the same object when nothing
    changed, so callers can tell."""
    if hasattr(jaxpr, "consts"):  # ClosedJaxpr
        inner = map_equations(jaxpr.jaxpr, update, skip)
        return jaxpr if inner is jaxpr.jaxpr else jaxpr.replace(jaxpr=inner)
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = update(eqn)
        if eqn.primitive.name not in skip:
            nested_params = {name: _map_value(value, update, skip) for name, value in eqn.params.items()}
            if any(nested_params[name] is not value for name, value in eqn.params.items()):
                params = {**(params or eqn.params), **{k: v for k, v in nested_params.items()
                                                      if v is not eqn.params[k]}}
        if params is not None:
            eqn, changed = eqn.replace(params=params), True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _map_value(value: Any, update, skip) -> Any:
    if isinstance(value, (tuple, list)):
        mapped = [_map_value(v, update, skip) for v in value]
        return value if all(m is v for m, v in zip(mapped, value)) else type(value)(mapped)
    if hasattr(getattr(value, "jaxpr", value), "eqns"):
        return map_equations(value, update, skip)
    return value
