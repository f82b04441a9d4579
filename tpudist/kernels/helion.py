"""Helion kernels as tpudist kernels: on "tpu" tensors, in compiled graphs and on DTensors, no host copy.

Helion (``pip install 'tpudist[helion]'``) compiles a ``@helion.kernel`` to Pallas when its backend is
``"pallas"`` and exposes the result as a JAX function (``Kernel.jax_fn``). Its own torch launcher
moves every input to the host and back (``helion/runtime/pallas/launcher.py``: ``_torch_to_jax``
is ``jnp.from_dlpack(t.detach().cpu())``), which on the "tpu" device means two copies and a sync per
call, and in Fused mode a break of the fused program. Here the JAX function becomes a
``custom_jax_kernel`` (``HelionKernel``), so it is one more op of the lowering table: the device runs
it on the arrays behind its tensors (Debug, Strict; recorded into the program in Fused), the "tpu"
compile backend inlines it into the XLA program, CPU tensors reach it without copies, DTensors run
it shard by shard (``shard_dims=``) or over their mesh.

    @helion_op("mylib::softmax", reference=lambda x: jax.nn.softmax(x, axis=-1))
    @helion.kernel(backend="pallas", config=helion.Config(block_sizes=[1]))
    def softmax(x: torch.Tensor) -> torch.Tensor: ...

Importing this module also routes plain ``@helion.kernel`` calls (``route_helion_calls``): a call
with a "tpu" tensor or a DTensor, and every call of a Pallas kernel under ``torch.compile``, goes
through the kernel's op instead of Helion's launcher. CPU tensors outside compiled code keep
Helion's own path. Installing ``tpudist.device`` imports this module as soon as Helion is imported
(``helion_route``), so ``import tpudist.device; import helion`` is all a user writes.

Known limit (Helion 1.5.1): its JAX export fails under ``jax.jit`` for some shapes its own launcher
runs (a row kernel over 13 rows with ``block_sizes=[1]``: "Shapes must be 1D sequences of concrete
values", also with a bare ``jax.jit(kernel.jax_fn)``); such a call raises that error here.

Helion settings: the kernel's ``config=``/``configs=`` are used as given; off TPU the kernel runs in
Pallas interpret mode (``pallas_interpret`` is switched on for it). Autotuning needs concrete inputs
and timings, which a traced JAX program has neither of, and on CPU interpret-mode timings say nothing
about TPU speed while each candidate costs seconds: a kernel that would autotune uses its first
``configs=`` entry or Helion's default config instead, with a warning naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
import sys
import threading
import typing
import warnings
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tpudist.kernels.errors import KernelGradientError
from tpudist.kernels.kernel import JaxKernel

_SCALARS = {float: "float", int: "int", bool: "bool", "float": "float", "int": "int", "bool": "bool"}
_names = itertools.count()
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True, slots=True)
class _Param:
    """One parameter of a Helion kernel: a tensor (maybe optional) or a float/int/bool scalar."""
    name: str
    tensor: bool
    optional: bool
    kind: type | None  # the scalar type
    default: Any


def helion_op(name: str | None = None, *, backward: Callable | None = None, reference: Callable | None = None,
              torch_reference: Callable | None = None, shard_dims: str | None = None,
              num_outputs: int | None = None, check: Callable | None = None) -> Callable[[Any], "HelionKernel"]:
    """Decorator over ``@helion.kernel``: the Helion kernel becomes the torch operator ``name``.

    Args:
        name: ``"namespace::op"``; default ``"tpudist_helion::<function name>_<n>"``.
        backward: the gradient, as a JAX function ``backward(*tensors, grad, **scalars)`` (like
            ``custom_jax_kernel``'s) or as a Helion kernel taking the tensor inputs, then one gradient per
            output, then the scalars, and returning one gradient per tensor input.
        reference: a pure-JAX function with the kernel's semantics; its ``jax.vjp`` is the gradient.
        torch_reference: the same as a torch function (run on JAX arrays through tpudist's op table).
        shard_dims: dims a DTensor may have sharded, for a kernel that works shard by shard
            (``tpudist.kernels.shard_spec``); None runs DTensors as one program over their mesh.
        num_outputs: how many tensors the kernel returns; default from its return annotation, else 1.
        check: ``check(*shape_dtype_structs, **scalars)`` returning what the kernel expects, or None.

    Without ``backward``/``reference``/``torch_reference`` the op has no gradient (Pallas kernels have
    no reverse-mode derivative): backward through it raises ``KernelGradientError``.

    Example:
        >>> @helion_op("mylib::add", shard_dims="..., ... -> ...", backward=lambda x, y, g: (g, g))
        ... @helion.kernel(backend="pallas", config=helion.Config(block_sizes=[64]))
        ... def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ...     out = torch.empty_like(x)
        ...     for tile in hl.tile(out.size()):
        ...         out[tile] = x[tile] + y[tile]
        ...     return out
        >>> add(torch.ones(8, device="tpu"), torch.ones(8, device="tpu"))   # no host copy
    """
    if torch_reference is not None:
        if reference is not None:
            raise ValueError("pass reference= (JAX) or torch_reference= (torch), not both")
        reference = _jax_of_torch(torch_reference)

    def wrap(kernel) -> HelionKernel:
        return HelionKernel(kernel, name, backward=backward, reference=reference, shard_dims=shard_dims,
                            num_outputs=num_outputs, check=check)

    return wrap


class HelionKernel(JaxKernel):
    """A Helion kernel as a ``JaxKernel``: its JAX function is Helion's ``jax_fn``.

    Called like the Helion kernel (its parameters in its order); the op takes the tensors
    positionally and the scalars as keyword arguments.
    """

    required_statics = True

    def __init__(self, kernel, name: str | None, *, backward: Callable | None, reference: Callable | None,
                 shard_dims: str | None, num_outputs: int | None, check: Callable | None):
        self.helion = kernel
        self.params = _params(kernel)
        name = name or _default_name(kernel)
        if _is_helion_kernel(backward):
            backward = _jax_backward(backward, self.params)
        self._helion = _HelionRunner(kernel)
        fn = self._jax_function()
        super().__init__(fn, name, backward=backward, reference=reference, shard_dims=shard_dims,
                         num_outputs=num_outputs or _outputs_from_annotation(kernel), check=check)
        kernel._tpudist_op = self  # the route for plain calls (route_helion_calls) finds it here

    def __repr__(self) -> str:
        return f"HelionKernel({self.name!r}, helion={self.helion.name!r}, schema={self.schema!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors, statics = self.split(args, kwargs)
        return self.op(*tensors, **statics)

    def split(self, args: tuple, kwargs: dict) -> tuple[list, dict]:
        """Helion-order arguments -> (the op's tensors, its keyword scalars)."""
        if len(args) > len(self.params):
            raise TypeError(f"kernel {self.name}: {len(args)} arguments for {len(self.params)} parameters "
                            f"({', '.join(p.name for p in self.params)})")
        unknown = set(kwargs) - {p.name for p in self.params}
        if unknown:
            raise TypeError(f"kernel {self.name}: unexpected keyword arguments {sorted(unknown)}; its parameters "
                            f"are {', '.join(p.name for p in self.params)}")
        tensors, statics = [], {}
        for i, p in enumerate(self.params):
            value = args[i] if i < len(args) else kwargs.get(p.name, p.default)
            if value is inspect.Parameter.empty:
                raise TypeError(f"kernel {self.name}: missing argument {p.name}")
            if p.tensor:
                tensors.append(value)
            else:
                statics[p.name] = value
        return tensors, statics

    def _jax_function(self) -> Callable:
        params, runner = self.params, self._helion

        def helion_jax(*arrays, **statics):
            it = iter(arrays)
            return runner.run([next(it) if p.tensor else p.kind(statics[p.name]) for p in params],
                              [p.tensor for p in params])

        signature = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                       default=None if p.optional else inspect.Parameter.empty)
                     for p in params if p.tensor]
        signature += [inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=p.default,
                                        annotation=p.kind) for p in params if not p.tensor]
        helion_jax.__signature__ = inspect.Signature(signature)
        helion_jax.__name__ = helion_jax.__qualname__ = self.helion.name
        helion_jax.__doc__ = self.helion.fn.__doc__
        return helion_jax

    def _vjp(self, xs, cotangent, statics):
        if self.reference is None:
            raise KernelGradientError(
                f"kernel {self.name}: Helion kernel {self.helion.name!r} compiles to Pallas, which has no "
                "reverse-mode gradient; pass backward= (a JAX function or a Helion kernel), reference= (pure "
                "JAX) or torch_reference= (a torch function with the same result) to helion_op")
        return super()._vjp(xs, cotangent, statics)


class _HelionRunner:
    """Runs a Helion kernel's JAX function on arrays (or tracers) in Helion's parameter order."""

    def __init__(self, kernel):
        _check_backend(kernel)
        self.kernel = kernel
        self.on_tpu = _on_tpu_backend()
        if not self.on_tpu:
            kernel.settings.pallas_interpret = True  # Pallas compiles for TPU only; CPU interprets it
        self._fallback: Any = None

    def run(self, args: list, is_tensor: list[bool]):
        """``args`` in Helion's order: arrays (or None) where ``is_tensor``, Python scalars elsewhere."""
        from helion.runtime.pallas.jax_export import _device_for_jax_export, _JaxExportTensor

        # Helion's jax_fn wraps bare arrays with its guess of the device ("tpu" once tpudist.device is
        # installed, whose scalar constants it would then build on the device and copy to the host);
        # off TPU the kernel compiles for the CPU in interpret mode, so say so.
        device = _device_for_jax_export() if self.on_tpu else torch.device("cpu")
        # Helion drives its torch-flavoured host wrapper on meta tensors; a caller's dispatch mode (the
        # compile backend lowers under FakeTensorMode) must not turn them into fakes.
        with _disable_current_modes():
            adapters = [_JaxExportTensor.from_jax(a, device=device) if tensor and a is not None else a
                        for a, tensor in zip(args, is_tensor)]
            self._ensure_config(adapters)
            return self.kernel.jax_fn(*adapters)

    def _ensure_config(self, adapters) -> None:
        kernel = self.kernel
        if len(kernel.configs) == 1 or kernel.settings.autotune_effort == "none":
            return  # Helion resolves the config itself, without running anything
        bound = kernel.bind(tuple(adapters))
        if getattr(bound, "_config", None) is not None:
            return
        config = kernel.configs[0] if kernel.configs else bound.config_spec.default_config()
        if self._fallback is None:
            self._fallback = config
            where = "in Pallas interpret mode on CPU, whose timings say nothing about TPU speed (and each " \
                    "candidate takes seconds)" if not self.on_tpu else "inside a traced JAX program"
            warnings.warn(f"Helion kernel {kernel.name!r}: not autotuning {where}; using {config} "
                          f"({'its first configs= entry' if kernel.configs else 'Helion default'}). Pass "
                          "config= to @helion.kernel to choose one (Helion prints the winner of an "
                          "autotune run on TPU).", stacklevel=2)
        bound.set_config(config)


# -- plain @helion.kernel calls ------------------------------------------------------------------------
_installed = False


def route_helion_calls() -> None:
    """Sends plain ``@helion.kernel`` calls with "tpu" tensors or DTensors, and Pallas kernels under
    ``torch.compile``, through their op (``as_op``). Idempotent; done when this module is imported."""
    global _installed
    with _lock:
        if _installed:
            return
        from helion.runtime.kernel import Kernel

        helion_call = Kernel.__call__

        def __call__(self, *args, **kwargs):
            op = getattr(self, "_tpudist_op", None)
            if (op is not None and torch.compiler.is_compiling()) or _needs_route(args, kwargs):
                return (op or as_op(self))(*args, **kwargs)
            return helion_call(self, *args, **kwargs)

        __call__.__wrapped__ = helion_call
        Kernel.__call__ = __call__
        _route_under_dynamo(Kernel)
        _installed = True


def as_op(kernel) -> HelionKernel:
    """The op of a Helion kernel: the one ``helion_op`` made, else a new one (no gradient)."""
    op = getattr(kernel, "_tpudist_op", None)
    if op is None:
        with _lock:
            op = getattr(kernel, "_tpudist_op", None) or HelionKernel(
                kernel, None, backward=None, reference=None, shard_dims=None, num_outputs=None, check=None)
    return op


def _needs_route(args, kwargs) -> bool:
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor) and (a.device.type == "tpu" and "tpudist.device" in sys.modules
                                            or _is_dtensor(a)):
            return True
    return False


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _route_under_dynamo(kernel_type) -> None:
    """Dynamo wraps Helion kernels itself (inline trace of the launch, or Helion's HOP for inductor).
    For Pallas kernels make the op first (not traceable) and let Dynamo trace the routed ``__call__``,
    which emits the op: one opaque node for inductor, inlined by the "tpu" backend."""
    from torch._dynamo.variables.builder import VariableBuilder

    table = VariableBuilder._type_dispatch()  # noqa: SLF001
    helion_wrap = table[kernel_type]

    def wrap_helion_kernel(builder, value):
        if value.settings.backend != "pallas":
            return helion_wrap(builder, value)
        as_op(value)
        return builder.wrap_user_defined(value)

    table[kernel_type] = wrap_helion_kernel


# -- signatures ----------------------------------------------------------------------------------------
def _params(kernel) -> list[_Param]:
    hints = _hints(kernel.fn)
    params = []
    for p in kernel.signature.parameters.values():
        annotation = hints.get(p.name, p.annotation)
        default = p.default
        if _is_tensor_type(annotation) or (annotation is p.empty and default in (p.empty, None)):
            params.append(_Param(p.name, True, default is None or _is_optional(annotation), None,
                                 None if default is None else p.empty))
            continue
        kind = _scalar_type(annotation, default)
        if kind is None:
            raise TypeError(f"Helion kernel {kernel.name!r}: parameter {p.name} (annotation={annotation!r}, "
                            f"default={default!r}) is neither a tensor nor a float/int/bool scalar; tpudist "
                            "ops take those (make other values constants of the kernel)")
        params.append(_Param(p.name, False, False, kind, default))
    if not any(p.tensor for p in params):
        raise TypeError(f"Helion kernel {kernel.name!r} takes no tensor parameter")
    return params


def _hints(fn) -> dict:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001  (unresolvable string annotations: fall back to the raw ones)
        return {}


def _is_tensor_type(annotation) -> bool:
    if annotation is torch.Tensor:
        return True
    if isinstance(annotation, str):
        return bool(re.fullmatch(r"(Optional\[)?(torch\.)?Tensor(\]| \| None)?", annotation.strip()))
    return any(a is torch.Tensor for a in typing.get_args(annotation))


def _is_optional(annotation) -> bool:
    return type(None) in typing.get_args(annotation) or (isinstance(annotation, str) and "None" in annotation)


def _scalar_type(annotation, default):
    if annotation in _SCALARS:
        return {"float": float, "int": int, "bool": bool}.get(annotation, annotation)
    if annotation is inspect.Parameter.empty and type(default) in _SCALARS:
        return type(default)
    return None


def _outputs_from_annotation(kernel) -> int:
    annotation = _hints(kernel.fn).get("return", kernel.signature.return_annotation)
    if isinstance(annotation, str):
        match = re.fullmatch(r"tuple\[(.*)\]", annotation.strip())
        return match.group(1).count(",") + 1 if match else 1
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if args and args[-1] is not Ellipsis:
            return len(args)
    return 1


def _default_name(kernel) -> str:
    return f"tpudist_helion::{re.sub(r'[^A-Za-z0-9_]', '_', kernel.name)}_{next(_names)}"


def _is_helion_kernel(value) -> bool:
    helion = sys.modules.get("helion.runtime.kernel")
    return helion is not None and isinstance(value, helion.Kernel)


def _check_backend(kernel) -> None:
    if kernel.settings.backend != "pallas":
        raise ValueError(f"Helion kernel {kernel.name!r} has backend={kernel.settings.backend!r}; tpudist runs "
                         "Helion's Pallas kernels: pass backend='pallas' to @helion.kernel (or set "
                         "HELION_BACKEND=pallas before defining it)")


def _on_tpu_backend() -> bool:
    import jax

    return jax.default_backend() == "tpu"


def _jax_backward(kernel, params: list[_Param]) -> Callable:
    """A Helion backward kernel (tensor inputs, output gradients, scalars) as a JAX ``backward=``."""
    runner = _HelionRunner(kernel)
    statics = [p for p in params if not p.tensor]

    def backward(*args, **kw):
        *xs, grad = args
        grads = grad if isinstance(grad, tuple) else (grad,)
        return runner.run([*xs, *grads, *(p.kind(kw[p.name]) for p in statics)],
                          [True] * (len(xs) + len(grads)) + [False] * len(statics))

    return backward


def _jax_of_torch(fn: Callable) -> Callable:
    """A torch function on JAX arrays: each aten op through tpudist's lowering table."""
    from tpudist.ops.interpret import run_decomposition

    def reference(*arrays, **statics):
        return run_decomposition(fn, arrays, statics)

    return reference


route_helion_calls()

__all__ = ["HelionKernel", "as_op", "helion_op", "route_helion_calls"]
