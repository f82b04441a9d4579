"""The lowerings, one module per family of ops; importing this package registers them all."""

from tpudist.ops.lowerings import (  # noqa: F401
    asserts, complex, elementwise, factories, foreach, indexing, linalg, nn, nn_extra, pooling, random, reductions, rnn, shape)
from tpudist.ops.lowerings import counting, grouped, linalg_factor, linalg_solve, resample, special, syncbn  # noqa: F401
