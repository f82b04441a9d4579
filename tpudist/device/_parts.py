"""Fused mode: a graph of independent, repeated parts runs as one program per part.

A graph whose ops fall into parts that read nothing of each other (no value of one reaches another)
and repeat (the same ops wired the same way over the same shapes) is run part by part: the parts
that repeat each as their own program, which every repeat shares, and the others together as one
more. The first such graph compiles one repeat and the rest, not every repeat: an optimizer step
recorded a layer's worth at a time (``_groups``) compiles one layer's update. The programs read and
write what the whole graph's would; they only run one after another.

A graph with no repeated part, or with more than ``MAX_PARTS`` parts (a loop over every parameter,
one small program each would cost more to launch than it saves), runs whole, as before. A repeat of
fewer than ``MIN_REPEAT_OPS`` ops is not a part of its own: a decoding step whose layers each bump a
counter in place (Hugging Face's static cache) repeats one op per layer, and cut there it compiled two
programs more (the counter's, the rest) and launched three a step instead of one, to spare compiling
one op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpudist._switches import switch
from tpudist.device import _hoist

MAX_PARTS = 24
MIN_REPEAT_OPS = 2


def enabled() -> bool:
    """``TPUDIST_FUSED_BLOCKS`` (unset: 1): whether Fused mode cuts where a model repeats itself: at its
    blocks (``_blocks``), its optimizer's foreach ops (``_groups``), a graph's repeated parts (here)."""
    return switch("TPUDIST_FUSED_BLOCKS", "1", "Fused programs cut at a model's repeats, the default", "not")


@dataclass(frozen=True, slots=True)
class Part:
    """Some of a graph's ops as a graph of their own: ``nodes`` (numbered as ``_fused.record`` numbers
    a graph), reading the graph's inputs ``inputs`` (by index) and scalars ``scalars`` (indices into
    its scalar vector); its results are the graph's live values at positions ``positions``, its own
    values ``live``."""

    nodes: tuple
    inputs: tuple
    scalars: np.ndarray
    live: tuple
    positions: tuple


def split(nodes: list, live: list, num_scalars: int) -> list[Part] | None:
    """The parts of a graph (``live`` its results, ascending), repeated ones first, in order, then the rest
    as one; None where none repeats or there are more than ``MAX_PARTS``."""
    producer, _ = _hoist._values(nodes)  # noqa: SLF001
    parent = list(range(len(nodes)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (_, refs, _) in enumerate(nodes):
        for r in refs:
            if r is not None and r >= 0:
                a, b = root(i), root(producer[r])
                if a != b:
                    parent[max(a, b)] = min(a, b)
    members: dict = {}
    for i in range(len(nodes)):
        members.setdefault(root(i), []).append(i)
    if len(members) < 2 or len(members) > MAX_PARTS:
        return None
    bases = [base for _, _, base in nodes] + [num_scalars]
    live_of: dict = {}
    for position, v in enumerate(live):
        live_of.setdefault(root(producer[v]), []).append((position, v))
    parts = {r: _part(nodes, bases, producer, m, live_of.get(r, [])) for r, m in members.items()}
    shapes: dict = {}
    for r, p in parts.items():
        shapes.setdefault(_shape(p), []).append(r)
    repeated = sorted(r for rs in shapes.values() if len(rs) > 1 and len(parts[rs[0]].nodes) >= MIN_REPEAT_OPS
                      for r in rs)
    if not repeated:
        return None
    rest = sorted(i for r, m in members.items() if r not in repeated for i in m)
    out = [parts[r] for r in repeated if parts[r].live]  # a part with no live value is never needed
    if rest:
        rest_live = sorted(pv for r in members if r not in repeated for pv in live_of.get(r, []))
        if rest_live:
            out.append(_part(nodes, bases, producer, rest, rest_live))
    return out


def _shape(p: Part):
    """What two parts share a program by: their ops and wiring (the kernels hold the shapes), which of
    their values are results, how many inputs and scalars they read."""
    return p.nodes, p.live, len(p.inputs), len(p.scalars)


def _part(nodes, bases, producer, indices, live) -> Part:
    """The graph of ``nodes[indices]`` (a set closed under the values they read), numbered as ``record``
    would have (``_hoist.subgraph``), its results the live values ``live`` ((position, value) pairs)."""
    part_nodes, scalars, inputs, renumbered = _hoist.subgraph(nodes, bases, indices, producer, {})
    return Part(tuple(part_nodes), tuple(inputs), np.asarray(scalars, np.int64),
                tuple(renumbered[v] for _, v in live), tuple(position for position, _ in live))
