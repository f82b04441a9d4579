"""The aten -> JAX lowering table, shared by the "tpu" device, the compile backend and the kernels.

    from tpudist.ops import call
    with jax.enable_x64(True):
        y = call(torch.ops.aten.addmm.default, bias, x, w)   # jax.Arrays in, jax.Arrays out

One small function per aten op overload, registered with ``@lowers(...)`` (see ``registry``); ops
without a lowering run torch's decomposition through the table (see ``interpret``). No torch device
state lives here: the layers above decide where arrays live and when programs are compiled.
Random lowerings draw keys from the caller's ``keys(KeySource(key))`` (see ``rng``);
``tpudist.ops.opcheck`` runs torch code through the table and compares it with CPU eager.
"""

from tpudist.ops import lowerings as _lowerings  # noqa: F401  (registers the table)
from tpudist.bridge import to_jax_dtype, to_torch_dtype
from tpudist.ops.interpret import JaxMode, JaxValue, UnsupportedOp, call, decomposition_for, expected_outputs
from tpudist.ops.registry import (contiguous_input, functional_of, lowered_ops, lowering_for, lowers, lowers_named,
                                  reads_contiguity, shapes_from_lowering, uses_lowering_shapes)
from tpudist.ops.rng import KeySource, keys, next_key

__all__ = [
    "JaxMode", "JaxValue", "KeySource", "UnsupportedOp", "call", "contiguous_input", "decomposition_for",
    "expected_outputs", "functional_of", "keys", "lowered_ops", "lowering_for", "lowers", "lowers_named", "next_key",
    "reads_contiguity", "shapes_from_lowering", "to_jax_dtype", "to_torch_dtype", "uses_lowering_shapes",
]
