"""``torch.compile(model, backend="tpu")``: Dynamo graphs as XLA programs through ``tpudist.ops``.

    model = torch.compile(model, backend="tpu")   # found through an entry point: no import needed

Dynamo captures the step, AOTAutograd turns it into Core ATen forward and backward graphs (min-cut
rematerialization), and each graph is interpreted through the shared aten -> JAX table, traced once
by ``jax.jit`` and compiled ahead of time. Inputs are CPU tensors (zero-copy) or "tpu" device
tensors (no crossing); functional collectives on "tpu" groups run inside the program. Modules:
``backend`` (Dynamo/AOTAutograd wiring, options, device and missing-op checks), ``decompositions``
(torch's Core ATen decompositions and their corrections), ``dynamic`` (dynamic sizes: buckets, the
padding analysis, ``dynamic.STATS``), ``program`` (interpreter, compile, caches, run),
``collectives`` (shard_map lowering, rank agreement),
``boundary`` / ``device_io`` (tensors in and out), ``entry`` (the entry points).
"""

from tpudist.compile.backend import Options, backend, missing_ops
from tpudist.compile.errors import MissingOpError, UnsupportedGraph
from tpudist.compile.program import STATS, clear_cache

__all__ = ["MissingOpError", "Options", "STATS", "UnsupportedGraph", "backend", "clear_cache", "missing_ops"]
