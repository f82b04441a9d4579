"""The lowerings, one module per family of ops; importing this package registers them all."""

from tpudist.ops.lowerings import elementwise, linalg  # noqa: F401
