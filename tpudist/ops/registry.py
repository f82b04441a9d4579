"""The aten -> JAX lowering table: one small function per aten op overload.

A lowering is a pure function of JAX arrays and Python values that mirrors its aten schema: tensor
arguments arrive as ``jax.Array`` (lists of tensors as lists, optional tensors as ``None``), every
other argument as the Python value aten gets, and it returns what the schema returns (an array, or a
tuple of arrays). Lowerings do not worry about torch's type promotion: ``tpudist.ops.call`` casts each
result to the dtype torch's meta kernel gives, in one place.

    @lowers(aten.add.Tensor, aten.add.Scalar)
    def add(x, y, *, alpha=1):
        return x + y * alpha if alpha != 1 else x + y

Register functional overloads only: in-place (``add_``) and ``out=`` variants are the caller's
business (``functional_of`` finds the functional twin).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch._prims  # noqa: F401  (registers torch.ops.prims)

Lowering = Callable[..., object]

_TABLE: dict[torch._ops.OpOverload, Lowering] = {}  # noqa: SLF001


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):  # noqa: SLF001
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, torch._ops.OpOverload):  # noqa: SLF001
        return [op]
    raise TypeError(f"op={op!r} is not an aten OpOverload or OpOverloadPacket; pass e.g. torch.ops.aten.add.Tensor")


def lowers(*ops) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of ``ops`` (overloads, or packets: all overloads).

    A second registration of the same overload replaces the first (user kernels may override ours).
    """

    overloads = [overload for op in ops for overload in _overloads(op)]

    def register(fn: Lowering) -> Lowering:
        for overload in overloads:
            _TABLE[overload] = fn
            for listener in _LISTENERS:
                listener(overload)
        return fn

    return register


_LISTENERS: list[Callable[[torch._ops.OpOverload], None]] = []  # noqa: SLF001


def on_register(listener: Callable[[torch._ops.OpOverload], None]) -> None:
    """Call ``listener(overload)`` for every lowering registered from now on (the "tpu" device
    installs its kernel for ops that custom kernels lower after the device was installed)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


_NAMED: dict[tuple[str, str], Lowering] = {}


def lowers_named(qualified_name: str, overload: str = "default") -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of a third-party op that may not exist yet
    (``"transformers::grouped_mm_fallback"``: defined when that library's module is imported); it is
    found by name when a graph holding the op is compiled."""

    def register(fn: Lowering) -> Lowering:
        _NAMED[(qualified_name, overload)] = fn
        return fn

    return register


def lowering_for(op) -> Lowering | None:
    """The lowering registered for this overload (or for its name, see :func:`lowers_named`), or None."""
    fn = _TABLE.get(op)
    if fn is None and _NAMED and isinstance(op, torch._ops.OpOverload):  # noqa: SLF001
        fn = _NAMED.get((op._schema.name, op._overloadname))  # noqa: SLF001
    return fn


_LOWERING_SHAPES: set = set()


def shapes_from_lowering(*ops) -> None:
    """Mark ``ops`` whose torch meta kernel is stricter than torch's CPU kernel (``_grouped_mm``'s
    meta demands CUDA's bf16; the CPU kernel takes any float): the device reads their result shapes
    and dtypes off the lowering instead of running that meta kernel."""
    _LOWERING_SHAPES.update(overload for op in ops for overload in _overloads(op))


def uses_lowering_shapes(op) -> bool:
    return op in _LOWERING_SHAPES


_CONTIGUOUS_INPUT: set = set()


def contiguous_input(*ops) -> None:
    """Mark ``ops`` whose CPU kernel returns other (equally valid) results when its first tensor argument
    is contiguous than when it is not (``_linalg_det`` factors A^T for a contiguous real A, A otherwise,
    and returns that LU; its backward reads A's strides to know which). Their lowerings take a keyword
    ``input_contiguous`` (default True), which callers that know the argument's strides pass to ``call``
    (the device and the compile backend; JaxMode's values are always laid out contiguously)."""
    _CONTIGUOUS_INPUT.update(overload for op in ops for overload in _overloads(op))


def reads_contiguity(op) -> bool:
    return op in _CONTIGUOUS_INPUT


def lowered_ops() -> list:
    """Every overload with a lowering, sorted by name (for tests and coverage reports)."""
    return sorted(_TABLE, key=str)


_TWINS = {
    torch.ops.aten.normal_.default: torch.ops.aten.normal_functional.default,
    torch.ops.aten.bernoulli_.float: torch.ops.aten.bernoulli.p,
}


def functional_of(op):
    """The functional overload behind an in-place (``add_.Tensor``) or ``out=`` overload, or None.

    ``aten.add_.Tensor`` -> ``aten.add.Tensor``; ``aten.add.out`` -> ``aten.add.Tensor`` (the overload
    whose schema equals the out overload's minus its out arguments). A few in-place ops whose
    functional twin has another name are listed in ``_TWINS`` (``normal_`` -> ``normal_functional``).
    """
    twin = _TWINS.get(op)
    if twin is not None:
        return twin
    packet_name = op._schema.name.split("::")[1]  # noqa: SLF001
    if torch.Tag.inplace in op.tags or (packet_name.endswith("_") and not packet_name.startswith("_")):
        base = getattr(torch.ops.aten, packet_name.rstrip("_"), None)
        if base is None:
            return None
        return getattr(base, op._overloadname, None)  # noqa: SLF001
    if op._schema.is_mutable and any(a.is_out for a in op._schema.arguments):  # noqa: SLF001
        packet = getattr(torch.ops.aten, packet_name)
        want = [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out]  # noqa: SLF001
        wanted = {name for name, _ in want}
        for name in packet.overloads():
            candidate = getattr(packet, name)
            schema = candidate._schema  # noqa: SLF001
            # a factory's out= form has no tensor options: the out tensor says where and of what dtype
            # (``logspace.out`` -> ``logspace.default``)
            args = [(a.name, str(a.type)) for a in schema.arguments if a.name not in _TENSOR_OPTIONS or a.name in wanted]
            if not schema.is_mutable and args == want:
                return candidate
    return None


_TENSOR_OPTIONS = frozenset(("dtype", "layout", "device", "pin_memory"))
