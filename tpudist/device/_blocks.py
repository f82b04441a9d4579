"""Fused mode cut at a model's repeated blocks (the default; ``TPUDIST_FUSED_BLOCKS=0`` turns it off).

A transformer's layers are one module class repeated in an ``nn.ModuleList``: their ops are the same,
their programs would be too, if each layer were a program of its own. Cut at counts of ops (the
chunks of ``_fused``), or not at all, a step's programs start and end mid-layer and every one differs,
so a first step compiles the whole model's worth of XLA. Cut at the blocks, the first step compiles one
block's forward and one block's backward and runs them once per layer: the rest of the model (embedding,
head, loss, optimizer) adds a few programs of its own.

The cuts, each running the pending graph (as a chunk does, values crossing in their own shape):
- forward, under autograd: where a block's ``forward`` starts and where it returns (module hooks);
- backward: where the gradient of a block's output is ready (its backward starts) and where that of
  its input is (tensor hooks, registered as the forward passes): the gradient is whole only once every
  use has added its part, so a block's backward is its own graph.

Blocks are the children of an ``nn.ModuleList`` (or ``nn.Sequential``) that holds two or more modules
of one class with submodules and parameters of the same names, shapes and dtypes, in a module whose
``forward`` runs (they are found as it starts, once per module): a transformer's layers, not the
``Linear`` layers of an MLP. The hooks are global (``torch.nn.modules.module``, installed at import unless
the variable is 0): they add about 2 us to every module call, and a cut only happens in Fused mode
with a graph pending. A forward under ``no_grad`` is not cut, nor one Dynamo compiles.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.parameter import is_lazy

from tpudist.device._parts import enabled  # noqa: F401  (the switch: TPUDIST_FUSED_BLOCKS)

_seen: weakref.WeakSet = weakref.WeakSet()     # modules whose children were looked at
_blocks: weakref.WeakSet = weakref.WeakSet()   # modules that are blocks
_handles: list = []
_compiling = torch.compiler.is_compiling


def install() -> None:
    """Registers the global module hooks (once); they cut only while ``TPUDIST_FUSED_BLOCKS`` is not 0."""
    if _handles:
        return
    from torch.nn.modules import module

    _handles.append(module.register_module_forward_pre_hook(_pre))
    _handles.append(module.register_module_forward_hook(_post))


def uninstall() -> None:
    """Removes the hooks (a test's, which installed them, restoring the process it shares)."""
    while _handles:
        _handles.pop().remove()


def _signature(module: torch.nn.Module):
    """What makes two modules one block: their class and their parameters' names, shapes and dtypes;
    None for a module without children (a lone Linear is no block: its program would be one op) or with
    lazy parameters (no shapes yet)."""
    if next(module.children(), None) is None:
        return None
    params = list(module.named_parameters())
    if any(is_lazy(p) for _, p in params):  # a lazy module's shapes are not known before its first call
        return None
    return type(module), tuple((name, tuple(p.shape), p.dtype) for name, p in params)


def _mark(module: torch.nn.Module) -> None:
    _seen.add(module)
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            alike: dict = {}
            for m in child:
                signature = _signature(m)
                if signature is not None:
                    alike.setdefault(signature, []).append(m)
            for members in alike.values():
                if len(members) > 1:
                    _blocks.update(members)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _cut(grad=None) -> None:
    """Runs the pending Fused graph, its values left in their own shape (a chunk's cut); a gradient
    (the tensor hook's) is put in its own shape."""
    from tpudist.device import _fused
    from tpudist.device import _runtime as rt

    if not rt.get_mode().records:
        return
    if _fused._graph is not None:  # noqa: SLF001
        _fused.flush(shaped=True)
    if grad is not None:
        _in_own_shape(grad)


def _hook_grad(value) -> None:
    t = _first_tensor(value)
    if t is not None and t.requires_grad and t.device.type == "tpu":
        t.register_hook(_cut)


def _active() -> bool:
    from tpudist.device import _runtime as rt

    return torch.is_grad_enabled() and rt.get_mode().records and enabled()


def _is_block(module) -> bool:
    try:
        if module not in _seen:
            _mark(module)
        return module in _blocks
    except TypeError:  # a module class that is not hashable (an __eq__ without __hash__): no block
        return False


def _in_own_shape(value) -> None:
    """A block's input (or its output's gradient) held flat or in another shape is put in its own shape,
    as a cut leaves the inputs of the later layers: the first layer then runs their programs where it
    would have compiled its own, forward and backward (it saves its input). Flat: a sync point, not a
    cut, ran the graph that made it (a model that reads a value to the host before its first layer);
    another shape: a ``Linear`` on the last layer's output gives its gradient as (batch * seq, dim).
    One reshape of that tensor a step."""
    from tpudist.device._storage import Shaped, buffer_of, has_buffer, is_whole

    t = _first_tensor(value)
    if t is None or t.device.type != "tpu" or t.dim() < 2 or not has_buffer(t):
        return
    buf = buffer_of(t)
    v = buf.value
    array = v.array if v.__class__ is Shaped else v
    if (getattr(array, "shape", None) not in (None, t.shape) and (v is not array or array.ndim == 1)
            and is_whole(t, buf)):
        buf.value = Shaped(array.reshape(t.shape))


def _pre(module, args):
    if not _compiling() and _is_block(module) and _active():  # a compiled graph has no Fused graph to cut
        _cut()
        _in_own_shape(args)
        _hook_grad(args)  # its gradient is whole: this block's backward is done


def _post(module, args, output):
    if not _compiling() and _is_block(module) and _active():
        _cut()
        _hook_grad(output)  # its gradient is ready: this block's backward starts
