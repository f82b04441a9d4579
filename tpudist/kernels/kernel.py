"""``custom_jax_kernel``: a JAX (or Pallas) function as a PyTorch operator with autograd.

Each kernel defines two ``torch.library`` custom ops, ``ns::op`` and ``ns::op_backward``:

- CPU tensors run the function through ``jax.jit`` (one jitted program per input shapes, dtypes,
  static arguments and torch's float32 matmul precision, which its dots and convolutions without a
  precision of their own take: ``tpudist.matmul_precision``), crossing into JAX and back without copies (``tpudist.bridge``).
- The fake (meta) kernel comes from ``jax.eval_shape``, so ``torch.compile`` (inductor,
  ``fullgraph=True``) keeps the op opaque and ``opcheck`` passes.
- Autograd calls ``ns::op_backward``: ``jax.vjp`` of the function, of a pure-JAX ``reference=``, or a
  user ``backward=``. Being an op itself, the backward is opaque to inductor and lowered by the table.
- Both ops are registered in ``tpudist.ops`` (``lowers``), so the "tpu" device and the "tpu" compile
  backend run or inline the JAX function with no knowledge of kernels.
- DTensor arguments run shard by shard or as one program over their mesh (``dtensor``).
"""

from __future__ import annotations

import inspect
import re
import threading
from typing import Any, Callable

import numpy as np
import torch

from tpudist import bridge
from tpudist.kernels.errors import KernelGradientError, KernelInputError, describe
from tpudist.kernels.shard_spec import ShardDims
from tpudist.kernels.tpu_blocks import pallas_interpret_unless_tpu

_SCHEMA_TYPES = {float: "float", int: "int", bool: "bool", str: "str"}
_SCHEMA_NAMES = {"float": "float", "int": "int", "bool": "bool", "str": "str"}


def custom_jax_kernel(name: str, *, backward: Callable | None = None, reference: Callable | None = None,
                      shard_dims: str | None = None, num_outputs: int = 1,
                      check: Callable[..., str | None] | None = None) -> Callable[[Callable], "JaxKernel"]:
    """Decorator: a JAX function of arrays becomes the torch operator ``name`` (``"lib::op"``).

    The function's positional parameters are tensors (a default of ``None`` makes one optional);
    its keyword-only parameters are static attributes (``float``, ``int``, ``bool`` or ``str``, typed
    by annotation or default) that select a compiled program, like ``jax.jit``'s static arguments.

    Args:
        name: the operator's qualified name, ``"namespace::op"``; ``torch.ops.namespace.op`` after.
        backward: ``backward(*inputs, grad, **statics)`` in JAX returning one gradient per tensor
            input (None for none); ``grad`` is a tuple when the kernel has several outputs.
        reference: a pure-JAX function with the kernel's semantics whose ``jax.vjp`` gives the
            gradients (for Pallas kernels, whose ``pallas_call`` has no reverse-mode gradient).
            Without either, the gradient is ``jax.vjp`` of the function itself.
        shard_dims: for kernels that work shard by shard, which dims a DTensor may have sharded
            (see ``tpudist.kernels.shard_spec``, e.g. ``"... _, _ -> ... _"``). None: DTensor
            arguments run as one XLA program over their mesh (``tpudist.sharding.spmd``).
        num_outputs: how many arrays the function returns (a tuple when more than one).
        check: ``check(*shape_dtype_structs, **statics)`` returning None when the inputs are fine,
            else what the kernel expects (the error message names the kernel and what it got).

    Pallas kernels run with ``interpret=True`` on CPU and compiled on TPU, with no change to the
    ``pallas_call``.

    Example:
        >>> @custom_jax_kernel("mylib::rms_norm", shard_dims="... _, _ -> ... _")
        ... def rms_norm(x, w, *, eps: float = 1e-6):
        ...     return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w
        >>> y = rms_norm(torch.randn(8, 64, requires_grad=True), torch.ones(64))
        >>> y.sum().backward()
    """

    def wrap(fn: Callable) -> JaxKernel:
        return JaxKernel(fn, name, backward=backward, reference=reference, shard_dims=shard_dims,
                         num_outputs=num_outputs, check=check)

    return wrap


class JaxKernel:
    """A JAX function registered as the torch ops ``op`` and ``backward_op``; call it like the function."""

    required_statics = False  # static arguments without a default (Helion kernels' scalars may have none)

    def __init__(self, fn: Callable, name: str, *, backward: Callable | None, reference: Callable | None,
                 shard_dims: str | None, num_outputs: int, check: Callable | None):
        if not re.fullmatch(r"[A-Za-z_]\w*::[A-Za-z_]\w*", name or ""):
            raise ValueError(f"name={name!r} must be a qualified operator name 'namespace::op', e.g. 'mylib::rms_norm'")
        if backward is not None and reference is not None:
            raise ValueError(f"kernel {name}: pass backward= or reference=, not both")
        if num_outputs < 1:
            raise ValueError(f"kernel {name}: num_outputs={num_outputs} must be >= 1")
        self.fn, self.name, self.num_outputs = fn, name, num_outputs
        self.user_backward, self.reference, self.check = backward, reference, check
        self.tensor_names, self.optional, self.static_defaults, static_types = _parameters(
            fn, name, self.required_statics)
        self.shard_dims = None if shard_dims is None else ShardDims.parse(
            shard_dims, len(self.tensor_names), num_outputs, name)
        self._runners: dict[tuple, Callable] = {}
        self._abstracts: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

        namespace, opname = name.split("::")
        tensors = ", ".join(f"Tensor? {n}=None" if o else f"Tensor {n}" for n, o in zip(self.tensor_names, self.optional))
        backward_tensors = ", ".join(f"Tensor{'?' if o else ''} {n}" for n, o in zip(self.tensor_names, self.optional))
        statics = ", ".join(f"{static_types[n]} {n}" + ("" if d is inspect.Parameter.empty else f"={_schema_default(d)}")
                            for n, d in self.static_defaults.items())
        kw = f", *, {statics}" if statics else ""
        outs = "Tensor" if num_outputs == 1 else "(" + ", ".join(["Tensor"] * num_outputs) + ")"
        grads = "Tensor" if len(self.tensor_names) == 1 else "(" + ", ".join(["Tensor"] * len(self.tensor_names)) + ")"
        self.schema = f"({tensors}{kw}) -> {outs}"
        self.backward_schema = f"({backward_tensors}, Tensor[] grads{kw}) -> {grads}"

        forward_def = torch.library.custom_op(name, mutates_args=(), device_types="cpu",
                                              schema=self.schema)(self._impl)
        forward_def.register_fake(self._fake)
        forward_def.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        backward_def = torch.library.custom_op(f"{name}_backward", mutates_args=(), device_types="cpu",
                                               schema=self.backward_schema)(self._impl_backward)
        backward_def.register_fake(self._fake_backward)
        self._defs = (forward_def, backward_def)
        self.op = getattr(getattr(torch.ops, namespace), opname).default
        self.backward_op = getattr(getattr(torch.ops, namespace), f"{opname}_backward").default

        from tpudist.kernels import dtensor

        self.register_lowerings()
        dtensor.register(self, forward_def, backward_def)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", opname)
        self.__qualname__ = getattr(fn, "__qualname__", opname)
        self.__module__ = getattr(fn, "__module__", __name__)
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"JaxKernel({self.name!r}, schema={self.schema!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    # -- signatures ---------------------------------------------------------------------------------
    def statics(self, kwargs: dict) -> dict:
        """Every static argument, defaults filled in, in declaration order."""
        if not kwargs:
            return self.static_defaults
        return {n: kwargs.get(n, d) for n, d in self.static_defaults.items()}

    def abstract_inputs(self, tensors, statics: dict | None = None) -> list:
        """``jax.ShapeDtypeStruct`` per tensor (None stays None); a dtype JAX lacks is a KernelInputError."""
        import jax

        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            try:
                dtype = np.dtype(bridge.to_jax_dtype(t.dtype))
            except TypeError as e:
                raise self.input_error(tensors, statics or {}, str(e)) from None
            out.append(jax.ShapeDtypeStruct(tuple(int(n) for n in t.shape), dtype))
        return out

    def input_error(self, tensors, statics: dict, expects: str) -> KernelInputError:
        got = [f"{n}={describe(t) if t is not None else None}" for n, t in zip(self.tensor_names, tensors)]
        got += [f"{n}={v!r}" for n, v in statics.items()]
        return KernelInputError(f"kernel {self.name}: got {', '.join(got)}; expects {expects}")

    def abstract_outputs(self, tensors, statics: dict) -> tuple:
        """``(shape, torch dtype)`` of each output, checking the inputs first (cached per signature)."""
        key = (tuple(None if t is None else (tuple(int(n) for n in t.shape), t.dtype) for t in tensors),
               tuple(statics.values()))
        hit = self._abstracts.get(key)
        if hit is None:
            hit = self._evaluate_shapes(tensors, statics)
            with self._lock:
                self._abstracts[key] = hit
        return hit

    def _evaluate_shapes(self, tensors, statics: dict) -> tuple:
        import jax

        from tpudist.ops import to_torch_dtype

        if len(tensors) != len(self.tensor_names):
            raise self.input_error(tensors, statics, f"{len(self.tensor_names)} tensors "
                                   f"({', '.join(self.tensor_names)})")
        avals = self.abstract_inputs(tensors, statics)
        for name, t, optional in zip(self.tensor_names, tensors, self.optional):
            if t is None and not optional:
                raise self.input_error(tensors, statics, f"a tensor for {name}")
        if self.check is not None:
            expects = self.check(*avals, **statics)
            if expects:
                raise self.input_error(tensors, statics, expects)
        try:
            with bridge.x64_scope(bridge.needs_x64([t.dtype for t in tensors if t is not None])):
                result = jax.eval_shape(self.traced(statics), *avals)
        except (TypeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise self.input_error(tensors, statics, f"inputs the JAX function accepts; JAX said: {first}") from e
        leaves = (result,) if self.num_outputs == 1 else result
        if not isinstance(leaves, (tuple, list)) or len(leaves) != self.num_outputs or not all(
                hasattr(o, "shape") for o in leaves):
            raise TypeError(f"kernel {self.name}: the function returned {jax.tree_util.tree_structure(result)}, "
                            f"declared num_outputs={self.num_outputs} arrays; pass the right num_outputs")
        return tuple((tuple(o.shape), to_torch_dtype(o.dtype)) for o in leaves)

    def traced(self, statics: dict) -> Callable:
        """The function on arrays with the statics bound, Pallas in interpret mode off TPU."""
        fn = self.fn

        def kernel(*arrays):
            with pallas_interpret_unless_tpu():
                return fn(*arrays, **statics)

        kernel.__name__ = kernel.__qualname__ = self.name.replace("::", "_")
        return kernel

    def traced_backward(self, statics: dict) -> Callable:
        """``(*inputs, *grads) -> one gradient per input`` in JAX (zeros where there is none)."""
        import jax
        import jax.numpy as jnp

        n = len(self.tensor_names)

        def kernel_backward(*arrays):
            xs, gs = arrays[:n], arrays[n:]
            cotangent = gs[0] if self.num_outputs == 1 else tuple(gs)
            with pallas_interpret_unless_tpu():
                if self.user_backward is not None:
                    grads = self.user_backward(*xs, cotangent, **statics)
                    grads = (grads,) if n == 1 and not isinstance(grads, (tuple, list)) else tuple(grads)
                    if len(grads) != n:
                        raise TypeError(f"kernel {self.name}: backward= returned {len(grads)} gradients for "
                                        f"{n} tensor inputs ({', '.join(self.tensor_names)}); return one each "
                                        "(None for none)")
                else:
                    grads = self._vjp(xs, cotangent, statics)
            out = []
            for x, g in zip(xs, grads):
                if x is None:
                    out.append(jnp.zeros((0,), jnp.float32))
                elif g is None or g.dtype == jax.dtypes.float0:
                    out.append(jnp.zeros(x.shape, x.dtype))
                else:
                    out.append(jnp.broadcast_to(g, x.shape).astype(x.dtype))
            return out[0] if n == 1 else tuple(out)

        kernel_backward.__name__ = kernel_backward.__qualname__ = self.name.replace("::", "_") + "_backward"
        return kernel_backward

    def _vjp(self, xs, cotangent, statics):
        import jax

        fn = self.reference or self.fn
        present = [i for i, x in enumerate(xs) if x is not None]

        def of_present(*values):
            full = list(xs)
            for i, v in zip(present, values):
                full[i] = v
            return fn(*full, **statics)

        if self.reference is None and _uses_pallas(of_present, [xs[i] for i in present]):
            raise KernelGradientError(
                f"kernel {self.name}: its function calls pallas_call, which has no reverse-mode gradient "
                "(JAX differentiates it forward only); pass backward=(a JAX function of the inputs and "
                "the output gradient) or reference=(a pure-JAX function with the same result) to "
                "custom_jax_kernel")
        _, vjp = jax.vjp(of_present, *[xs[i] for i in present])
        grads = [None] * len(xs)
        for i, g in zip(present, vjp(cotangent)):
            grads[i] = g
        return grads

    # -- the ops' kernels --------------------------------------------------------------------------
    def pad(self, tensors: tuple) -> tuple:
        """The tensor arguments with absent trailing optional ones as None (torch leaves them out)."""
        missing = len(self.tensor_names) - len(tensors)
        return tuple(tensors) + (None,) * missing if missing > 0 else tuple(tensors)

    def _impl(self, *tensors: torch.Tensor, **kwargs: Any):
        tensors = self.pad(tensors)
        statics = self.statics(kwargs)
        key = (tuple(None if t is None else (t.shape, t.dtype) for t in tensors), tuple(statics.values()))
        run = self._runners.get(key)
        if run is None:
            self.abstract_outputs(tensors, statics)  # checks the inputs, with the kernel's own errors
            run = self._runner(key, self.traced(statics), [t.dtype for t in tensors if t is not None],
                               self.num_outputs == 1)
        return run(tensors)

    def _impl_backward(self, *args, **kwargs: Any):
        *tensors, grads = args
        statics = self.statics(kwargs)
        arrays = (*tensors, *grads)
        key = ("backward", tuple(None if t is None else (t.shape, t.dtype) for t in arrays), tuple(statics.values()))
        run = self._runners.get(key)
        if run is None:
            run = self._runner(key, self.traced_backward(statics), [t.dtype for t in arrays if t is not None],
                               len(self.tensor_names) == 1)
        return run(arrays)

    def _runner(self, key, traced: Callable, dtypes, single: bool) -> Callable:
        import jax

        from tpudist import matmul_precision as precision
        from tpudist.runtime.jax_cache import enable_persistent_cache

        enable_persistent_cache()  # once per process; `python -m tpudist warmup` fills it ahead of time
        jitted = jax.jit(traced)
        x64 = bridge.needs_x64(dtypes)
        numpy_view, to_torch, scope = bridge.numpy_view, bridge.torch_view, bridge.x64_scope

        def run(tensors):
            with scope(x64), precision.scope(precision.current()):  # jax.jit keys its programs by both
                # CPU tensors in without a copy (XLA:CPU reads the host buffer in place)
                out = jitted(*[None if t is None else numpy_view(t)[0] for t in tensors])
            return to_torch(out) if single else tuple(to_torch(o) for o in out)

        run.jitted = jitted
        with self._lock:
            self._runners[key] = run
        return run

    def _fake(self, *tensors: torch.Tensor, **kwargs: Any):
        tensors = self.pad(tensors)
        statics = self.statics(kwargs)
        outs = self.abstract_outputs(tensors, statics)
        device = next(t.device for t in tensors if t is not None)
        results = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in outs)
        return results[0] if self.num_outputs == 1 else results

    def _fake_backward(self, *args, **kwargs: Any):
        *tensors, grads = args
        self.abstract_outputs(tensors, self.statics(kwargs))
        results = tuple(torch.empty(0, device=grads[0].device) if t is None else torch.empty_like(t)
                        for t in tensors)
        return results[0] if len(results) == 1 else results

    # -- autograd --------------------------------------------------------------------------------
    def _setup_context(self, ctx, inputs, output, keyword_only_inputs=None):
        ctx.num_given = len(inputs)
        ctx.save_for_backward(*self.pad(inputs))
        ctx.statics = dict(keyword_only_inputs or {})

    def _autograd_backward(self, ctx, *grads):
        inputs = ctx.saved_tensors
        result = self.backward_op(*inputs, list(grads), **ctx.statics)
        result = (result,) if len(inputs) == 1 else result
        return tuple(g if (x is not None and needs and (x.dtype.is_floating_point or x.dtype.is_complex)) else None
                     for x, g, needs in zip(inputs, result, ctx.needs_input_grad))[:ctx.num_given]

    # -- the lowering table ------------------------------------------------------------------------
    def register_lowerings(self) -> None:
        """Registers ``lowering`` and ``backward_lowering`` in ``tpudist.ops`` (done at definition)."""
        from tpudist.ops import lowers

        lowers(self.op)(self.lowering)
        lowers(self.backward_op)(self.backward_lowering)

    def lowering(self, *arrays, **kwargs):
        """The JAX lowering of ``op`` (registered in ``tpudist.ops``)."""
        return self.traced(self.statics(kwargs))(*self.pad(arrays))

    def backward_lowering(self, *args, **kwargs):
        """The JAX lowering of ``backward_op``."""
        *arrays, grads = args
        return self.traced_backward(self.statics(kwargs))(*arrays, *grads)

    # -- ahead of time -----------------------------------------------------------------------------
    def compile(self, *tensors: torch.Tensor, backward: bool = True, **kwargs: Any) -> int:
        """Compiles the programs a call on tensors shaped like these runs (into JAX's caches).

        ``tensors`` may be meta tensors. Returns the number of programs compiled (forward, and
        backward if asked). With the persistent compile cache on (``tpudist.runtime.jax_cache``), a later
        process reads them from disk.
        """
        from tpudist import matmul_precision as precision

        statics = self.statics(kwargs)
        outs = self.abstract_outputs(tensors, statics)
        avals = self.abstract_inputs(tensors, statics)
        dtypes = [t.dtype for t in tensors if t is not None]
        key = (tuple(None if t is None else (t.shape, t.dtype) for t in tensors), tuple(statics.values()))
        run = self._runners.get(key) or self._runner(key, self.traced(statics), dtypes, self.num_outputs == 1)
        with bridge.x64_scope(bridge.needs_x64(dtypes)), precision.scope(precision.current()):
            run.jitted.lower(*avals).compile()
        if not backward:
            return 1
        import jax

        from tpudist.ops import to_jax_dtype

        grads = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in outs]
        arrays = (*tensors, *grads)
        key = ("backward", tuple(None if t is None else (t.shape, t.dtype) for t in arrays), tuple(statics.values()))
        run = self._runners.get(key) or self._runner(key, self.traced_backward(statics),
                                                     [t.dtype for t in arrays if t is not None],
                                                     len(self.tensor_names) == 1)
        grad_avals = [jax.ShapeDtypeStruct(shape, to_jax_dtype(dtype)) for shape, dtype in outs]
        with (bridge.x64_scope(bridge.needs_x64([t.dtype for t in arrays if t is not None])),
              precision.scope(precision.current())):
            run.jitted.lower(*avals, *grad_avals).compile()
        return 2


def _parameters(fn: Callable, name: str, required_statics: bool = False):
    names, optional, defaults, types = [], [], {}, {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"kernel {name}: *{p.name}/**{p.name} cannot be typed; list each tensor "
                            "positionally and each static argument keyword-only")
        if p.kind is p.KEYWORD_ONLY:
            kind = _static_type(p, name)
            if p.default is p.empty and not required_statics:
                raise TypeError(f"kernel {name}: static argument {p.name} needs a default (e.g. eps: float = 1e-6)")
            types[p.name], defaults[p.name] = kind, p.default
            continue
        if p.default is not p.empty and p.default is not None:
            raise TypeError(f"kernel {name}: parameter {p.name}={p.default!r} looks static; make it keyword-only "
                            f"(def f(x, *, {p.name}={p.default!r})): positional parameters are tensors")
        names.append(p.name)
        optional.append(p.default is None)
    if not names:
        raise TypeError(f"kernel {name}: the function takes no tensor (positional) parameter")
    return names, optional, defaults, types


def _static_type(p: inspect.Parameter, name: str) -> str:
    annotation = p.annotation
    if isinstance(annotation, str) and annotation in _SCHEMA_NAMES:
        return _SCHEMA_NAMES[annotation]
    if annotation in _SCHEMA_TYPES:
        return _SCHEMA_TYPES[annotation]
    if annotation is p.empty and type(p.default) in _SCHEMA_TYPES:
        return _SCHEMA_TYPES[type(p.default)]
    raise TypeError(f"kernel {name}: static argument {p.name} must be a float, int, bool or str "
                    f"(annotation={annotation!r}, default={p.default!r})")


def _schema_default(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    return repr(value)


def _uses_pallas(fn: Callable, avals) -> bool:
    import jax

    from tpudist._jaxprs import any_equation

    return any_equation(jax.make_jaxpr(fn)(*avals), lambda eqn: eqn.primitive.name == "pallas_call")


__all__ = ["JaxKernel", "custom_jax_kernel"]
