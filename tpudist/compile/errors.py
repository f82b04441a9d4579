"""What the compile backend raises, and how it points at the user's code."""

from __future__ import annotations

from typing import Any

import torch.fx


class UnsupportedGraph(ValueError):
    """The captured graph cannot become one XLA program (and no fallback was asked for)."""


class MissingOpError(UnsupportedGraph, NotImplementedError):
    """A graph holds an aten op with no JAX lowering (nor a decomposition that reaches lowered ops).

    ``op`` is the overload, ``line`` the user's source line the op came from (or "?").
    """

    def __init__(self, op: Any, line: str, ops_and_lines: list[tuple[Any, str]] | None = None):
        self.op = op
        self.line = line
        self.ops_and_lines = ops_and_lines or [(op, line)]
        listed = "; ".join(f"{o} (from {ln})" for o, ln in self.ops_and_lines)
        super().__init__(
            f"torch.compile(backend='tpu'): aten op {op} has no JAX lowering in tpudist.ops; it comes from "
            f"{line}. Missing: {listed}. Fixes: add a lowering with @tpudist.ops.lowers({_qualname(op)}) "
            "(a function of jax.Arrays), or pass options={'on_missing_op': 'graph_break'} to torch.compile "
            "to run the code around that op eagerly in torch (a graph split; the op then runs on the "
            "tensors' own device, outside XLA)")


def _qualname(op: Any) -> str:
    try:
        namespace, name = op._schema.name.split("::")  # noqa: SLF001
        return f"torch.ops.{namespace}.{name}.{op._overloadname}"  # noqa: SLF001
    except AttributeError:
        return repr(op)


def user_line(node: torch.fx.Node) -> str:
    """``file:line (code)`` of the innermost frame of the user code that produced ``node``."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if text.startswith("File "):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith(("File ", "^")) else ""
            parts = text.split(",")
            where = f"{parts[0][5:].strip(chr(34))}:{parts[1].replace('line', '').strip()}" if len(parts) > 1 else text
            return f"{where} ({code})" if code else where
    return f"graph node {node.name} (no source line recorded)"


def missing_op_error(op: Any, node: torch.fx.Node) -> MissingOpError:
    return MissingOpError(op, user_line(node))


def dynamo_sources(node: torch.fx.Node) -> set[str]:
    """Names of the Dynamo graph nodes an ATen node came from (AOTAutograd records them)."""
    names = set()
    stack = list(node.meta.get("from_node") or [])
    while stack:
        src = stack.pop()
        name = getattr(src, "name", None)
        if name is not None:
            names.add(name)
        stack.extend(getattr(src, "from_node", None) or [])
    return names
