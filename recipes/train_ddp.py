"""Train a small Llama-style decoder with DistributedDataParallel on TPU chips.

    torchrun --nproc-per-node 2 recipes/train_ddp.py --steps 50
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

from tpudist.training import StepMetrics, TrainConfig, option, run


@dataclasses.dataclass(frozen=True)
class DDPConfig(TrainConfig):
    """Train a Llama-style decoder with DDP (every rank holds the whole model) on a Markov-chain task."""

    parallelism: str = option("ddp", "ddp (a full replica per rank, gradients all-reduced) or fsdp", ("ddp", "fsdp"))
    steps: int = option(60, "total optimizer steps (a resumed run stops at the same step)")


def main(argv: Sequence[str] | None = None) -> list[StepMetrics]:
    return run(DDPConfig, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
