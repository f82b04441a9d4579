"""Fused mode: a step's new constant storages (an optimizer's state) are made by programs of their own.

An optimizer creates its state on its first step: AdamW's ``exp_avg``/``exp_avg_sq`` are
``zeros_like(p)`` inside step 1, and step 2 reads them. Recorded as they are, step 1's program has
those ops and step 2's reads the same storages as inputs: two different programs of the whole step.
On a TPU v5e that compiled a 158M-parameter step twice (70 s, then 63 s; issue #37).

So when a graph's program is first built (a cache miss, never on a hit), the ops that create a
storage that outlives the graph with a value that reads no array (a constant: zeros, ones,
``full``, ``arange``; random draws too, which read only the seed and counter) are split off: each
runs first as a program of that one op, and the rest of the graph reads their results as inputs,
numbered as a graph recorded after them would number them. That rest is exactly step 2's program,
so step 2 finds it compiled. A one-op program is keyed by its kernel alone: the ``zeros_like`` of
every parameter of one shape is one program, and a constant made again at a later sync (a model
that makes a buffer in every forward and keeps it) finds its program compiled too. Constants that do
not outlive the graph (a causal mask) stay in the program, where XLA folds them. A graph that
creates such a storage at every sync runs one more small program per such op at every sync; any
other graph is untouched.

Whether an op's results read an array is decided on its traced jaxpr (once per kernel), not by a
list of op names: any factory lowering qualifies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend.core import Var

from tpudist import ops as tops

_ARRAY_FREE: dict = {}  # (kernel, number of scalars it reads) -> whether its results read no array


@dataclass(frozen=True, slots=True)
class Split:
    """A graph as its split-off ops (``init_nodes``, each a one-op graph reading nothing, with its
    scalars ``init_scalars[i]``) and the rest (``main_nodes``, scalars ``main_scalars``).

    The init ops' results are numbered in order (op by op, written then fresh values): ``made``.
    ``main_inputs[i]`` is where the main program's input i comes from: ``k >= 0`` the graph's input k,
    ``-1 - j`` made value j. ``live[p]`` is where the graph's live value p comes from: ``k >= 0`` the
    main program's output k, ``-1 - j`` made value j. Scalars index the graph's scalar vector.
    """

    init_nodes: tuple
    init_scalars: tuple
    main_nodes: tuple
    main_live: tuple
    main_scalars: np.ndarray
    main_inputs: tuple
    live: tuple

    def main_args(self, inputs: list, made: list) -> list:
        return [inputs[k] if k >= 0 else made[-1 - k] for k in self.main_inputs]

    def outputs(self, main_outs: list, made: list) -> list:
        return [main_outs[k] if k >= 0 else made[-1 - k] for k in self.live]


def split(nodes: list, live: list, num_scalars: int) -> Split | None:
    """The split of a graph (``nodes`` as ``_fused.Graph`` records them, ``live`` its output values in
    ascending order), or None when no op creates an outliving constant storage or nothing else is live."""
    bases = [base for _, _, base in nodes] + [num_scalars]
    producer, overwrote = _values(nodes)
    hoisted = sorted({producer[v] for v in _origins(live, overwrote)
                      if array_free(nodes[producer[v]][0], bases[producer[v] + 1] - bases[producer[v]])})
    if not hoisted:
        return None
    init_nodes = tuple((nodes[i][0], (None,) * len(nodes[i][1]), 0) for i in hoisted)  # each reads no array
    init_scalars = tuple(np.arange(bases[i], bases[i + 1], dtype=np.int64) for i in hoisted)
    made = {v: j for j, v in enumerate(v for i in hoisted for v in _produced(i, producer))}
    split_off = set(hoisted)
    kept = [i for i in range(len(nodes)) if i not in split_off]
    main_nodes, main_scalars, main_inputs, renumbered = subgraph(nodes, bases, kept, producer, made)
    main_live, sources = [], []
    for v in live:
        if v in renumbered:
            sources.append(len(main_live))
            main_live.append(renumbered[v])
        else:
            sources.append(-1 - made[v])
    if not main_live:  # the graph only makes constants (torch.zeros(n, device="tpu") alone): one program
        return None
    return Split(init_nodes, init_scalars, tuple(main_nodes), tuple(main_live),
                 np.asarray(main_scalars, np.int64), tuple(main_inputs), tuple(sources))


def subgraph(nodes: list, bases: list, kept: list, producer: list, made: dict) -> tuple:
    """The graph of the nodes ``kept`` (ascending), as ``_fused.record`` would have numbered it had the
    others' results been concrete arrays: values renumbered in order, inputs (the graph's, or the
    others' results that ``made`` numbers) numbered at their first read, scalars packed. Returns its
    nodes, the graph's scalar indices it reads, where each of its inputs comes from (``k >= 0`` the
    graph's input k, ``-1 - j`` made value j) and each kept value's new number. Also ``_parts``'s."""
    main_nodes, main_scalars, main_inputs, input_of, renumbered = [], [], [], {}, {}
    for i in kept:
        kernel, refs, base = nodes[i]
        new_refs = []
        for r in refs:
            if r is not None and r >= 0 and r in renumbered:
                r = renumbered[r]
            elif r is not None:
                source = -1 - made[r] if r >= 0 else -1 - r  # as Split.main_inputs says
                if source not in input_of:
                    input_of[source] = len(main_inputs)
                    main_inputs.append(source)
                r = -1 - input_of[source]
            new_refs.append(r)
        main_nodes.append((kernel, tuple(new_refs), len(main_scalars)))
        main_scalars.extend(range(base, bases[i + 1]))
        for v in _produced(i, producer):
            renumbered[v] = len(renumbered)
    return main_nodes, main_scalars, main_inputs, renumbered


def _values(nodes: list) -> tuple[list, dict]:
    """``producer[v]``: the node that made value v; ``overwrote[v]``: for a value an op wrote into an
    existing storage, the ref (value, input, or None) it replaced."""
    producer, overwrote = [], {}
    for i, (kernel, refs, _) in enumerate(nodes):
        for slot in kernel.written_slots:
            overwrote[len(producer)] = refs[slot]
            producer.append(i)
        producer.extend([i] * len(kernel.outputs))
    return producer, overwrote


def _produced(i: int, producer: list) -> range:
    # values are numbered in node order, so node i's are one run
    return range(bisect.bisect_left(producer, i), bisect.bisect_right(producer, i))


def _start(v: int, overwrote: dict):
    """The ref a live value's storage started the graph from, following the in-place writes onto it
    back: a value the graph made (a new storage's first value, ``>= 0``), a graph input (``< 0``), or
    None (an unwritten storage)."""
    while v is not None and v >= 0 and v in overwrote:
        v = overwrote[v]
    return v


def _origins(live: list, overwrote: dict) -> set:
    """The first values of the storages the graph made that are still live."""
    return {r for r in (_start(v, overwrote) for v in live) if r is not None and r >= 0}


def held_before(nodes: list, live: list) -> list:
    """For each live value, its storage's value before the graph, as a ref: ``-1 - k`` the graph's
    input k, None where the storage was unwritten or made by the graph. A sync whose program failed
    puts these back (``_fused.flush``)."""
    _, overwrote = _values(nodes)
    return [r if r is not None and r < 0 else None for r in (_start(v, overwrote) for v in live)]


def array_free(kernel, num_scalars: int) -> bool:
    """Whether none of ``kernel``'s results reads an array (they may read its scalars)."""
    key = (kernel, num_scalars)
    free = _ARRAY_FREE.get(key)
    if free is None:
        arrays = [jax.ShapeDtypeStruct((numel,), tops.to_jax_dtype(dtype)) for numel, dtype in kernel.slots]
        scalars = jax.ShapeDtypeStruct((num_scalars,), np.float64)
        with jax.enable_x64(True):
            closed = jax.make_jaxpr(lambda a, s: kernel.trace(a, s))(arrays, scalars)
        free = _ARRAY_FREE[key] = not _reads(closed.jaxpr, closed.jaxpr.invars[:len(arrays)])
    return free


def _reads(jaxpr, sources) -> bool:
    """Whether any output of ``jaxpr`` depends on ``sources`` (a call's outputs depend on all its inputs)."""
    tainted = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return any(isinstance(v, Var) and v in tainted for v in jaxpr.outvars)
