"""Which tensor dims a shard-by-shard kernel may have sharded, and the placements that follow.

A kernel that works shard by shard declares ``shard_dims`` as a small einsum-like string: one entry
per tensor input, ``->``, one entry per output. Each dim is a label (a dim that may be sharded,
e.g. ``b``, ``h``), ``_`` (a dim the kernel needs whole), or ``...`` (any number of shardable
leading dims, aligned from the right like numpy broadcasting)::

    "... _, _ -> ... _"                       # rms_norm(x, w): any dim of x but the last
    "b h _ _, b h _ _, b h _ _ -> b h _ _"    # attention(q, k, v): batch and heads

The rule, per mesh axis: it shards one label (every tensor holding that label is sharded on it by
that axis, the others are replicated on it), or nothing (every tensor replicated). Outputs are then
sharded on the same label; gradients of replicated inputs are ``Partial`` sums on that axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tpudist.kernels.errors import KernelShardingError

_WHOLE = "_"
_ELLIPSIS = "..."


@dataclass(frozen=True, slots=True)
class TensorDims:
    """One tensor's entry: labels before and after an optional ``...`` (None: a whole dim)."""

    head: tuple[str | None, ...]
    ellipsis: bool
    tail: tuple[str | None, ...]

    def labels(self, ndim: int) -> tuple[str | None, ...] | None:
        """The label of each dim of a rank-``ndim`` tensor, or None if the rank does not fit."""
        fixed = len(self.head) + len(self.tail)
        if ndim < fixed or (not self.ellipsis and ndim != fixed):
            return None
        middle = ndim - fixed
        return (*self.head, *(f"...{middle - j}" for j in range(middle)), *self.tail)

    def __str__(self) -> str:
        words = [w or _WHOLE for w in self.head] + ([_ELLIPSIS] if self.ellipsis else []) + [
            w or _WHOLE for w in self.tail]
        return " ".join(words)


@dataclass(frozen=True, slots=True)
class ShardDims:
    """A parsed ``shard_dims`` string."""

    inputs: tuple[TensorDims, ...]
    outputs: tuple[TensorDims, ...]

    @classmethod
    def parse(cls, text: str, num_inputs: int, num_outputs: int, kernel: str) -> "ShardDims":
        if "->" not in text:
            raise ValueError(f"kernel {kernel}: shard_dims={text!r} needs '->' between the inputs and the "
                             "outputs, e.g. '... _, _ -> ... _'")
        left, right = text.split("->")
        inputs = tuple(_parse_tensor(t, text, kernel) for t in left.split(","))
        outputs = tuple(_parse_tensor(t, text, kernel) for t in right.split(","))
        if len(inputs) != num_inputs or len(outputs) != num_outputs:
            raise ValueError(f"kernel {kernel}: shard_dims={text!r} has {len(inputs)} inputs and {len(outputs)} "
                             f"outputs; the kernel takes {num_inputs} tensors and returns {num_outputs}")
        for o in outputs:
            for label in _named(inputs):
                if not label.startswith("...") and label not in (*o.head, *o.tail):
                    raise ValueError(f"kernel {kernel}: shard_dims={text!r}: label {label!r} of the inputs is "
                                     f"missing from output {str(o)!r}; a dim sharded on the way in must be "
                                     "sharded on the way out (else the kernel needs the mesh: drop shard_dims)")
        return cls(inputs, outputs)

    def __str__(self) -> str:
        return f"{', '.join(map(str, self.inputs))} -> {', '.join(map(str, self.outputs))}"


def _parse_tensor(entry: str, text: str, kernel: str) -> TensorDims:
    words = entry.split()
    if words.count(_ELLIPSIS) > 1:
        raise ValueError(f"kernel {kernel}: shard_dims={text!r}: {entry.strip()!r} has more than one '...'")
    for w in words:
        if w not in (_WHOLE, _ELLIPSIS) and not w.isidentifier():
            raise ValueError(f"kernel {kernel}: shard_dims={text!r}: {w!r} is not a label, '_' or '...'")
    as_label = [None if w == _WHOLE else w for w in words]
    if _ELLIPSIS in words:
        at = words.index(_ELLIPSIS)
        return TensorDims(tuple(as_label[:at]), True, tuple(as_label[at + 1:]))
    return TensorDims(tuple(as_label), False, ())


def _named(entries: Sequence[TensorDims]) -> set[str]:
    return {w for e in entries for w in (*e.head, *e.tail) if w}


# -- placements ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LocalPlan:
    """Per mesh axis, the label it shards (or None); the placements of outputs and of input grads."""

    axis_labels: tuple[str | None, ...]
    output_placements: tuple[tuple, ...]  # per output, one placement per mesh axis
    grad_placements: tuple[tuple, ...]  # per input


def plan_local(spec: ShardDims, kernel: str, names: Sequence[str], tensors: Sequence, mesh_axes: Sequence[str],
               output_ndims: Sequence[int]) -> LocalPlan:
    """The placements of a shard-by-shard call, or ``KernelShardingError`` saying which redistribute fixes it.

    ``tensors`` are DTensors (None for an absent optional tensor), ``names`` their argument names.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    labels = []
    for name, dims, t in zip(names, spec.inputs, tensors):
        if t is None:
            labels.append(None)
            continue
        got = dims.labels(t.ndim)
        if got is None:
            raise KernelShardingError(f"kernel {kernel}: {name} has {t.ndim} dims, its shard_dims entry "
                                      f"{str(dims)!r} wants {len(dims.head) + len(dims.tail)}"
                                      f"{' or more' if dims.ellipsis else ''}")
        labels.append(got)

    axis_labels = []
    for axis, axis_name in enumerate(mesh_axes):
        sharded: dict[str, list[str]] = {}
        for name, t, dims in zip(names, tensors, labels):
            if t is None:
                continue
            p = t.placements[axis]
            if p.is_partial():
                raise KernelShardingError(
                    f"kernel {kernel}: {name} is {p!r} on mesh axis {axis_name!r}, a pending reduction this "
                    f"kernel cannot take; redistribute it first: {name} = {name}.redistribute({name}.device_mesh, "
                    f"{_suggest(t.placements, axis)})")
            if not p.is_shard():
                continue
            if type(p) is not Shard:
                raise KernelShardingError(f"kernel {kernel}: {name} is {p!r} on mesh axis {axis_name!r}; only "
                                          f"plain Shard placements run shard by shard. Redistribute to "
                                          f"{_suggest(t.placements, axis)}")
            label = dims[p.dim % t.ndim]
            if label is None:
                raise KernelShardingError(
                    f"kernel {kernel}: {name} is sharded on dim {p.dim % t.ndim} (mesh axis {axis_name!r}, "
                    f"placements={_text(t.placements)}), but the kernel needs that dim whole "
                    f"(shard_dims={str(spec)!r}); redistribute it first: {name} = {name}.redistribute("
                    f"{name}.device_mesh, {_suggest(t.placements, axis)})")
            sharded.setdefault(label, []).append(name)
        if len(sharded) > 1:
            raise KernelShardingError(
                f"kernel {kernel}: mesh axis {axis_name!r} shards different dims of the inputs "
                f"({', '.join(f'{n} on {_label_text(lbl)}' for lbl, ns in sharded.items() for n in ns)}); "
                f"shard_dims={str(spec)!r} lets one mesh axis shard one label. Redistribute so they agree")
        label = next(iter(sharded), None)
        if label is not None:
            for name, t, dims in zip(names, tensors, labels):
                if t is not None and label in dims and not t.placements[axis].is_shard():
                    raise KernelShardingError(
                        f"kernel {kernel}: mesh axis {axis_name!r} shards {', '.join(sharded[label])} on "
                        f"{_label_text(label)} but {name}, which has that dim too, is {t.placements[axis]!r} "
                        f"there; shard them alike: {name} = {name}.redistribute({name}.device_mesh, "
                        f"{_with(t.placements, axis, f'Shard({dims.index(label)})')})")
        axis_labels.append(label)

    outputs = []
    for dims, ndim in zip(spec.outputs, output_ndims):
        out_labels = dims.labels(ndim)
        if out_labels is None:
            raise KernelShardingError(f"kernel {kernel}: an output has {ndim} dims, its shard_dims entry "
                                      f"{str(dims)!r} does not fit")
        outputs.append(tuple(Replicate() if lbl is None else Shard(out_labels.index(lbl)) for lbl in axis_labels))
    grads = []
    for t, dims in zip(tensors, labels):
        if t is None:
            grads.append(None)
            continue
        grads.append(tuple(
            Replicate() if lbl is None else (t.placements[a] if t.placements[a].is_shard() else Partial())
            for a, lbl in enumerate(axis_labels)))
    return LocalPlan(tuple(axis_labels), tuple(outputs), tuple(grads))


def _label_text(label: str) -> str:
    return f"the leading dim {label}" if label.startswith("...") else f"dim {label!r}"


def _text(placements) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


def _with(placements, axis: int, replacement: str) -> str:
    words = [replacement if i == axis else repr(p) for i, p in enumerate(placements)]
    return "[" + ", ".join(words) + "]"


def _suggest(placements, axis: int) -> str:
    return _with(placements, axis, "Replicate()")


__all__ = ["LocalPlan", "ShardDims", "TensorDims", "plan_local"]
