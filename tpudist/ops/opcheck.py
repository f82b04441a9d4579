"""Check lowerings against CPU eager torch: run torch code with every aten op going through ``call``.

    from tpudist.ops.opcheck import run_on_jax, compare
    expected = fn(*args)                       # CPU eager
    actual = run_on_jax(fn, *args)             # same code, each tensor a JaxValue, ops through call()
    assert compare(expected, actual) is None

``run_on_jax`` wraps every tensor argument as a ``JaxValue``, runs ``fn`` under ``JaxMode`` with 64-bit
types on and a key source installed, and returns CPU tensors. ``Recorder`` notes which lowerings ran
(the op-table tests use it to prove each registered lowering is exercised).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist import matmul_precision
from tpudist.bridge import host_copy
from tpudist.ops import registry
from tpudist.bridge import to_torch_dtype
from tpudist.ops.interpret import JaxMode, JaxValue
from tpudist.ops.rng import KeySource, keys


def to_jax(t: torch.Tensor):
    """A CPU tensor as a jax.Array (copy); bf16 goes through its bits, which numpy cannot hold."""
    t = t.detach().resolve_conj().resolve_neg().cpu()
    if t.dtype == torch.bfloat16:  # a numpy view through ml_dtypes' bfloat16: no JAX program
        return jnp.asarray(t.contiguous().view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.asarray(t.numpy())


to_torch = host_copy  # a jax.Array as a row-major CPU tensor (copy)


def _wrap(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, JaxValue):
        return JaxValue(to_jax(x), requires_grad=x.requires_grad)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_wrap(i) for i in x)
    if isinstance(x, dict):
        return {k: _wrap(v) for k, v in x.items()}
    return x


def _unwrap(x):
    if isinstance(x, JaxValue):
        return to_torch(x.value)
    if isinstance(x, (list, tuple)):
        return [_unwrap(i) for i in x]
    return x


def run_on_jax(fn, *args, seed: int = 0, jit: bool = True, **kwargs):
    """``fn(*args, **kwargs)`` with tensors as JaxValues under JaxMode; CPU tensors back.

    With ``jit`` (the default) the whole call is traced by ``jax.jit`` into one program, as the device
    and the compile backend run it (one compile instead of one per primitive); ops that need concrete
    values (``nonzero``, boolean-mask indexing, ``item``) fall back to running eagerly. Dots and
    convolutions run at torch's float32 matmul precision, as on the device (``tpudist.matmul_precision``).
    """
    with jax.enable_x64(True), matmul_precision.scope(matmul_precision.current()):
        if jit:
            try:
                return _run_jitted(fn, args, kwargs, seed)
            except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                    jax.errors.TracerBoolConversionError, jax.errors.TracerArrayConversionError,
                    NotImplementedError, _NotArrays) as err:
                if isinstance(err, NotImplementedError) and "jit" not in str(err):
                    raise
        with keys(KeySource(jax.random.key(seed))):
            wrapped_args, wrapped_kwargs = _wrap(args), _wrap(kwargs)
            with JaxMode():
                out = fn(*wrapped_args, **wrapped_kwargs)
            return _unwrap(out)


class _NotArrays(Exception):
    """The function returned something other than tensors (a Python number): run it eagerly."""


class _Slot:
    """Where a tensor argument goes back in (args, kwargs) inside the traced program."""

    def __init__(self, index: int, requires_grad: bool):
        self.index, self.requires_grad = index, requires_grad


def _run_jitted(fn, args, kwargs, seed):
    tensors = []

    def to_slot(x):
        if isinstance(x, torch.Tensor):
            tensors.append(to_jax(x))
            return _Slot(len(tensors) - 1, x.requires_grad)
        return x

    pytree = torch.utils._pytree  # noqa: SLF001
    structure = pytree.tree_map(to_slot, (args, kwargs))
    out_spec = []

    def program(arrays, key):
        def fill(x):
            return JaxValue(arrays[x.index], requires_grad=x.requires_grad) if isinstance(x, _Slot) else x

        call_args, call_kwargs = pytree.tree_map(fill, structure)
        with keys(KeySource(key)), JaxMode():
            out = fn(*call_args, **call_kwargs)
        flat, spec = pytree.tree_flatten(out)
        if not all(isinstance(v, JaxValue) for v in flat):
            raise _NotArrays
        out_spec.append(spec)
        return [v.value for v in flat]

    flat = jax.jit(program)(tensors, jax.random.key(seed))
    return _unwrap(pytree.tree_unflatten([JaxValue(v) for v in flat], out_spec[0]))


def _leaves(x):
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in _leaves(item)]
    return [x]


def compare(expected, actual, *, values=True, rtol=None, atol=None) -> str | None:
    """None if ``actual`` matches ``expected`` (dtypes, shapes and, if ``values``, values), else why not.

    Tolerances default to 1e-5 relative / 1e-6 absolute for float32 and wider, 1e-2 for bf16/f16;
    integers and bools must be equal; NaNs must match NaNs.
    """
    exp, act = _leaves(expected), _leaves(actual)
    if len(exp) != len(act):
        return f"{len(act)} outputs, torch gives {len(exp)}"
    for i, (e, a) in enumerate(zip(exp, act)):
        if not isinstance(e, torch.Tensor):
            if isinstance(a, torch.Tensor) and a.ndim == 0:
                a = a.item()
            if e != a and not (isinstance(e, float) and np.isnan(e) and np.isnan(a)) and values:
                if not (isinstance(e, float) and abs(e - a) <= 1e-5 * abs(e) + 1e-6):
                    return f"output {i}: {a!r}, torch gives {e!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {i}: {type(a).__name__}, torch gives a tensor"
        if a.dtype != e.dtype:
            return f"output {i}: dtype {a.dtype}, torch gives {e.dtype}"
        if tuple(a.shape) != tuple(e.shape):
            return f"output {i}: shape {tuple(a.shape)}, torch gives {tuple(e.shape)}"
        if not values:
            continue
        low = e.dtype in (torch.bfloat16, torch.float16)
        r = rtol if rtol is not None else (1e-2 if low else 1e-5)
        t = atol if atol is not None else (1e-2 if low else 1e-6)
        try:
            torch.testing.assert_close(a, e.detach(), rtol=r, atol=t, equal_nan=True, check_dtype=True)
        except AssertionError as err:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            return f"output {i}: " + "; ".join(lines[:4])
    return None


class Recorder:
    """Records which registered lowerings run while it is active (``with Recorder() as rec: ...``)."""

    def __init__(self):
        self.seen: set = set()
        self._wrapped: dict = {}  # recording wrapper -> the lowering it wraps

    def __enter__(self):
        self._wrapped = {}
        for op, fn in list(registry._TABLE.items()):  # noqa: SLF001
            wrapper = self._recording(op, fn)
            self._wrapped[wrapper] = fn
            registry._TABLE[op] = wrapper  # noqa: SLF001
        return self

    def _recording(self, op, fn):
        def lowering(*args, **kwargs):
            self.seen.add(op)
            return fn(*args, **kwargs)
        return lowering

    def __exit__(self, *exc):
        """Every wrapper back to its lowering, wherever it is now; a lowering registered while recording (the
        compile backend's Dynamo prims join the table when it first runs, once a process) stays."""
        for op, fn in list(registry._TABLE.items()):  # noqa: SLF001
            registry._TABLE[op] = self._wrapped.get(fn, fn)  # noqa: SLF001
        self._wrapped = {}


@contextlib.contextmanager
def recording(recorder: Recorder | None):
    """``recorder`` active, or nothing if it is None."""
    if recorder is None:
        yield None
    else:
        with recorder:
            yield recorder


__all__ = ["Recorder", "compare", "recording", "run_on_jax", "to_jax", "to_torch", "to_torch_dtype"]
