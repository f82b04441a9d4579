"""Functional collectives inside compiled graphs (filled in below)."""

from __future__ import annotations


def for_graph(gm):
    """None when ``gm`` calls no functional collective."""
    for node in gm.graph.nodes:
        target = node.target
        if getattr(target, "namespace", None) == "_c10d_functional" or "_c10d_functional" in str(target):
            raise NotImplementedError("functional collectives in compiled graphs: not yet")
    return None
