"""The lowerings, one module per family of ops; importing this package registers them all."""

from tpudist.ops.lowerings import (  # noqa: F401
    elementwise, factories, foreach, indexing, linalg, nn, pooling, random, reductions, shape)
from tpudist.ops.lowerings import device_extras  # noqa: F401,E402  (ops the tpu device needed first)
