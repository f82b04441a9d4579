"""The device's own Python code is opaque to Dynamo: ``torch.compile`` never traces it.

When Dynamo skips a call or breaks the graph (``nn.RNN``/``nn.LSTM`` are skipped modules; a
``print``; a missing op with ``on_missing_op="graph_break"``), that code runs eagerly with Dynamo's
frame hook still installed, so every Python frame the C++ dispatcher enters (our PrivateUse1 kernels)
looked to Dynamo like a new function to compile: it traced the kernels, the runtime, the fused
recorder and JAX (288 frames for one LSTM) and failed on their real tensors or shape lists. A
graph break must run its eager part as device ops.

torch 2.13's per-code execution strategy (``set_code_exec_strategy``, what ``torch._dynamo.skip_code``
sets, here with a recursive SKIP) tells the frame hook to run a code object, and everything it calls,
without Dynamo. It is set once per code object: no wrapper, so eager dispatch costs nothing more,
and it holds for every caller (the dispatcher, torch's hooks, patched torch functions).
"""

from __future__ import annotations

import sys
import types


def _codes(obj, seen: set) -> list[types.CodeType]:
    """The code objects of a function or class defined in tpudist, with their nested functions."""
    found = []
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for part in (obj.fget, obj.fset, obj.fdel):
            if part is not None:
                found += _codes(part, seen)
        return found
    if isinstance(obj, type):
        if id(obj) in seen or not obj.__module__.startswith("tpudist."):
            return found
        seen.add(id(obj))
        for member in vars(obj).values():
            found += _codes(member, seen)
        return found
    code = getattr(getattr(obj, "__wrapped__", obj), "__code__", None)
    if not isinstance(code, types.CodeType) or not getattr(obj, "__module__", "").startswith("tpudist."):
        return found
    stack = [code]
    while stack:
        c = stack.pop()
        if id(c) not in seen:
            seen.add(id(c))
            found.append(c)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return found


def hide_from_dynamo(package: str = "tpudist.device") -> int:
    """Marks every function and method of ``package``'s loaded modules as run-without-Dynamo,
    recursively (callees included). Returns the number of code objects marked."""
    from torch._C._dynamo import eval_frame

    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP,  # noqa: SLF001
                                         eval_frame._FrameAction.SKIP)  # noqa: SLF001
    seen: set = set()
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for obj in list(vars(module).values()):
            for code in _codes(obj, seen):
                eval_frame.set_code_exec_strategy(code, skip)
                count += 1
    return count
