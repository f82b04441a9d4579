"""A custom op with no JAX lowering, for the compile tests of missing ops (``tpudist_test::mystery``).

Defined once here: a custom op can be defined only once per process, and the compile tests of
static and dynamic graphs share it under xdist.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("tpudist_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@mystery.register_fake
def _(x):
    return torch.empty_like(x)
