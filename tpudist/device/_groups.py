"""A foreach op over a model's parameters is recorded (Fused) or run (Strict, Debug) a layer's worth at a time.

An optimizer step is a few foreach ops over every parameter (AdamW's ``_foreach_lerp_``,
``_foreach_addcmul_``, ``_foreach_addcdiv_`` ...). Recorded whole, each op is one node over every
tensor, and the step is one program of every parameter's update: on a TPU v5e the 158M-parameter
benchmark model's took 18 s to compile, the largest part of its first step. Run whole in Strict
mode, each op is one kernel over every tensor, compiled for that list alone.

So where a foreach op's tensor lists repeat a run of shapes (a transformer's parameters: the
embedding, the same nine tensors once per layer, the head), the op is recorded as one op per
repeat, plus one for what comes before the repeats and one for what follows. Every op of the
step is cut at the same places (the ranges depend on the shapes and dtypes alone), so a layer's
update reads nothing of another's and ``_parts`` runs it as a program of its own: the first step
compiles one layer's update and the rest, whatever the depth (in Strict mode, one kernel per op and
range shape: the layers share theirs). More than ``MAX_GROUPS`` repeats are taken several at a time.

A list is cut only when the repeats cover at least half of it and it has ``MIN_TENSORS`` tensors or
more; ``TPUDIST_FUSED_BLOCKS=0`` (which also keeps a model's blocks in one program) turns this off.
"""

from __future__ import annotations

import math

import torch

from tpudist.device import _fused

MIN_TENSORS = 16
MAX_GROUPS = 16
MAX_PERIOD = 512  # tensors in one repeat at most (a layer's parameters): bounds the search on huge lists
_ELIGIBLE: dict = {}   # op -> whether it is a foreach op this module cuts
_RANGES: dict = {}     # the lists' (shape, dtype)s -> their ranges, or None: not cut


def eligible(op) -> bool:
    """Whether ``op`` is a foreach op whose results are nothing or one list (cut, they are joined)."""
    e = _ELIGIBLE.get(op)
    if e is None:
        schema = op._schema  # noqa: SLF001
        returns = [str(r.type) for r in schema.returns]
        e = _ELIGIBLE[op] = (schema.name.startswith("aten::_foreach_") and returns in ([], ["List[Tensor]"])
                             and any(str(a.type) == "List[Tensor]" for a in schema.arguments))
    return e


def run(op, args, kwargs, execute):
    """``op`` run by ``execute`` once per range of its lists where they are cut, its results joined;
    ``NotImplemented`` where they are not."""
    first = next((a for a in args if type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor)), None)
    if first is None or len(first) < MIN_TENSORS:
        return NotImplemented
    signature = tuple((t.shape, t.dtype) for t in first)
    ranges = _RANGES.get(signature, False)
    if ranges is False:
        ranges = _RANGES[signature] = cut(signature)
    if ranges is None:
        return NotImplemented
    n = len(first)
    if any(type(a) in (list, tuple) and len(a) != n for a in (*args, *kwargs.values())):
        return NotImplemented  # lists of other lengths: torch's own error names them, uncut

    def part(x, lo, hi):
        return x[lo:hi] if type(x) in (list, tuple) and len(x) == n else x

    with _fused.counted_as_one():
        results = [execute(op, tuple(part(a, lo, hi) for a in args), {k: part(v, lo, hi) for k, v in kwargs.items()})
                   for lo, hi in ranges]
    return None if results[0] is None else [t for r in results for t in r]


def cut(signature) -> tuple | None:
    """The ranges a list of these (shape, dtype)s is recorded in: before the repeats, each repeat (or
    several), after them; None where no run repeats over half of the list."""
    n = len(signature)
    best = _longest_repeat(signature)
    if best is None:
        return None
    start, period, repeats = best
    if period * repeats * 2 < n:
        return None
    per_group = math.ceil(repeats / MAX_GROUPS)
    bounds = [0, start] + [start + k * period for k in range(per_group, repeats, per_group)]
    bounds += [start + repeats * period, n]
    bounds = sorted(set(bounds))
    return tuple(zip(bounds[:-1], bounds[1:]))


def _longest_repeat(s):
    """(start, period, repeats) of the run ``s[start:start + period]`` repeated ``repeats`` (>= 2) times in
    a row that covers most of ``s`` (the shortest period of those), or None. O(n * MAX_PERIOD), once per list."""
    n, best = len(s), None
    for period in range(1, min(n // 2, MAX_PERIOD) + 1):
        run = 0  # s[i - run + 1 .. i] each equal to the element a period later
        for i in range(n - period + 1):
            if i < n - period and s[i] == s[i + period]:
                run += 1
                continue
            repeats = (run + period) // period
            if repeats >= 2 and (best is None or repeats * period > best[1] * best[2]):
                best = (i - run, period, repeats)
            run = 0
    return best
