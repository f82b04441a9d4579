"""Lowerings: how each c10d op runs inside its program, one small function per op in a table.

A lowering gets the program's key and this rank's index in the group and returns a
:class:`Lowering`: how the rank's block becomes the program's inputs, what the program computes
from them inside ``shard_map`` over the group's one mesh axis :data:`AXIS`, and how the outputs
become the op's result. :mod:`~tpudist.process_group.programs` builds, caches and runs them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tpudist.process_group.keys import ProgramKey
from tpudist.process_group.tensors import padded

AXIS = "ranks"

# ReduceOp names (lower case) as they appear in keys and errors.
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = (
    "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
REDUCES = (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM)
_FOLDED = {PRODUCT: "multiply", BAND: "bitwise_and", BOR: "bitwise_or", BXOR: "bitwise_xor"}


@dataclass(frozen=True, slots=True)
class Lowering:
    """How one op runs as a program over this rank's block.

    ``split`` cuts the block into the program's inputs (host views, no copies where rows are
    contiguous), ``body`` maps those local inputs to local outputs inside ``shard_map``, and
    ``join`` makes the op's result from the outputs (and the block, for the part of the result a
    rank keeps for itself), in ``dest`` when given one of the result's shape and it can. Most ops
    are one input and one output; the direct lowerings send each peer its piece as a separate
    ``ppermute`` and so need neither XLA's slicing of the input nor its concatenation of the output
    (see :func:`_to_peers`).
    """

    split: Callable[[np.ndarray], list[np.ndarray]]
    body: Callable[..., tuple]
    join: Callable[[np.ndarray, list[np.ndarray], np.ndarray | None], np.ndarray]


def _single(body: Callable[[Any], Any]) -> Lowering:
    """A lowering with one input (the block) and one output (the result)."""
    return Lowering(lambda block: [block], lambda x: (body(x),), lambda block, outs, dest: outs[0])


# -- lowerings: (key, this rank's group index) -> Lowering ----------------------------------------
LOWERINGS: dict[str, Callable[[ProgramKey, int], Lowering]] = {}


def _lowering(op: str):
    def register(fn):
        LOWERINGS[op] = fn
        return fn
    return register


def _is_low_precision(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


def _fold(parts: list, key: ProgramKey):
    """Reduces ``parts`` (one per rank) with ``key.reduce``, as envelope.fold does on the host."""
    import jax.numpy as jnp

    reduce, dtype = key.reduce, parts[0].dtype
    if reduce in (SUM, AVG, PREMUL_SUM):
        # XLA:CPU reduces 16-bit floats ~10x slower than float32 (FACTS.md); float32 is also exact-er.
        wide = [p.astype(jnp.float32) for p in parts] if _is_low_precision(key.dtype) else parts
        if reduce == PREMUL_SUM:
            wide = [w * jnp.asarray(key.static[0], dtype=w.dtype) for w in wide]
        total = functools.reduce(jnp.add, wide)
        if reduce == AVG:
            total = total / len(parts)
        return total.astype(dtype)
    fn = {MIN: jnp.minimum, MAX: jnp.maximum}.get(reduce) or getattr(jnp, _FOLDED[reduce])
    return functools.reduce(fn, parts)


def _to_peers(pieces, n: int) -> tuple:
    """Direct sends: ``pieces[k - 1]`` goes to the rank ``k`` places after ours (one ``ppermute``
    each); output ``k - 1`` came from the rank ``k`` places before ours.

    The direct lowerings (all_to_all, all_gather, reduce_scatter, all_reduce) are built on this.
    XLA:CPU's own all_to_all slices its input into per-peer buffers and concatenates its output, two
    extra copies: at 64 MiB it took 98 ms on 2 ranks and 155 ms on 4, the ppermutes 37 and 63 (gloo
    32 and 45). Its all-reduce took 57 and 135 ms, a reduce-scatter and all-gather built from these
    sends 46 and 102 (gloo 45 and 120; benchmarks/collectives.py has the table).
    """
    import jax

    return tuple(jax.lax.ppermute(p, AXIS, perm=[(i, (i + k) % n) for i in range(n)])
                 for k, p in enumerate(pieces, start=1))


def _place(own: np.ndarray, outs: list[np.ndarray], me: int, rows: int,
           dest: np.ndarray | None) -> np.ndarray:
    """The result whose row ``me`` is ``own`` and row ``me - k`` output ``k - 1`` (see _to_peers),
    in ``dest`` if given. ``own`` may live in ``dest``'s memory: it is placed first."""
    result = np.empty((rows, *own.shape), own.dtype) if dest is None else dest
    result[me] = own
    for k, out in enumerate(outs, start=1):
        result[(me - k) % rows] = out
    return result


@_lowering("all_reduce")
def _lower_all_reduce(key: ProgramKey, me: int) -> Lowering:
    """A reduce-scatter and an all-gather of direct sends: rank j folds chunk j of every rank's
    tensor and sends the total to every other rank. Each rank sends 2(n-1)/n of its data, as a ring
    does, in two rounds instead of 2(n-1); every rank ends with the same bits."""
    n = len(key.group)
    numel = int(np.prod(key.shape, dtype=np.int64))
    width = max(1, -(-numel // n))  # chunk j is flat[j * width:(j + 1) * width], the last padded

    def split(block):
        flat = block.reshape(-1)
        pieces = [flat[j * width:(j + 1) * width] for j in ((me + k) % n for k in range(n))]
        return [padded(p, width) for p in pieces]

    def body(own, *pieces):
        total = _fold([own, *_to_peers(pieces, n)], key)
        return (total, *_to_peers([total] * (n - 1), n))

    def join(block, outs, dest):
        if dest is not None and numel == n * width:  # no padding: the chunks tile dest
            return _place(outs[0], outs[1:], me, n, dest.reshape(n, width)).reshape(key.shape)
        return _place(outs[0], outs[1:], me, n, None).reshape(-1)[:numel].reshape(key.shape)

    return Lowering(split, body, join)


@_lowering("reduce_scatter")
def _lower_reduce_scatter(key: ProgramKey, me: int) -> Lowering:
    """Block ``(n, *chunk)`` -> chunk ``i`` of the reduction on rank ``i``: row j goes straight to
    rank j, which folds what it receives. XLA:CPU's own reduce-scatter copies the input and runs
    gloo's halving-doubling: 1.5-3x slower (measured)."""
    n = len(key.group)
    return Lowering(lambda block: [block[(me + k) % n] for k in range(n)],
                    lambda own, *pieces: (_fold([own, *_to_peers(pieces, n)], key),),
                    lambda block, outs, dest: outs[0])


@_lowering("all_gather")
def _lower_all_gather(key: ProgramKey, me: int) -> Lowering:
    """Our block to every peer, one direct send each; the result's row ``i`` is rank ``i``'s block."""
    n = len(key.group)
    return Lowering(lambda block: [block] if n > 1 else [],
                    lambda *x: _to_peers(x * (n - 1), n),
                    lambda block, outs, dest: _place(block, outs, me, n, dest))


@_lowering("all_to_all")
def _lower_all_to_all(key: ProgramKey, me: int) -> Lowering:
    """Block ``(n, *chunk)``: row ``j`` goes to rank ``j``; result row ``i`` came from rank ``i``.
    Our own row never enters the program."""
    n = len(key.group)
    return Lowering(lambda block: [block[(me + k) % n] for k in range(1, n)],
                    lambda *pieces: _to_peers(pieces, n),
                    lambda block, outs, dest: _place(block[me], outs, me, n, dest))


@_lowering("broadcast")
def _lower_broadcast(key: ProgramKey, me: int) -> Lowering:
    """A binomial tree of ``ppermute`` s from the root: ceil(log2 n) rounds, each moving the raw bits
    once per edge. (A masked psum also works, but XLA:CPU reduces it: 4-10x slower than gloo.)"""
    import jax

    n, root = len(key.group), key.static[0]
    if n == 2:
        # One transfer; the root's result is never written back, so it needs no select (on XLA:CPU a
        # select over 64 MiB cost 70 ms, 2.5x the transfer itself: measured).
        return _single(lambda x: jax.lax.ppermute(x, AXIS, perm=[(root, 1 - root)]))

    def body(x):
        pos = (jax.lax.axis_index(AXIS) - root) % n  # position relative to the root
        have = x
        span = 1
        while span < n:  # round: positions [0, span) send to [span, 2 * span)
            perm = [((src + root) % n, (src + span + root) % n) for src in range(min(span, n - span))]
            got = jax.lax.ppermute(have, AXIS, perm=perm)
            # Each rank keeps one of the two buffers: a per-device cond moves one, where a select
            # reads both (64 MiB on 4 ranks, bare: 99-113 ms with jnp.where, 66-90 ms with cond).
            have = jax.lax.cond((pos >= span) & (pos < 2 * span), lambda a, b: a, lambda a, b: b,
                                got, have)
            span *= 2
        return have
    return _single(body)


@_lowering("scatter")
def _lower_scatter(key: ProgramKey, me: int) -> Lowering:
    """Block ``(n, *chunk)`` on the root: one all_to_all, each rank keeps the row from the root."""
    import jax

    root = key.static[0]
    return _single(lambda x: jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)[root])


@_lowering("permute")
def _lower_permute(key: ProgramKey, me: int) -> Lowering:
    """``static`` is the permutation as (source, destination) group-index pairs."""
    import jax

    return _single(lambda x: jax.lax.ppermute(x, AXIS, perm=list(key.static)))


@_lowering("barrier")
def _lower_barrier(key: ProgramKey, me: int) -> Lowering:
    import jax

    return _single(lambda x: jax.lax.psum(x, AXIS))
