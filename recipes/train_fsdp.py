"""Train a Llama-style decoder with FSDP2 (and optionally HSDP / tensor parallelism) on TPU chips.

    torchrun --nproc-per-node 4 recipes/train_fsdp.py                       # FSDP over 4 emulated chips
    torchrun --nproc-per-node 4 recipes/train_fsdp.py --mesh 1,2,2          # FSDP x TP
    torchrun --nproc-per-node 4 recipes/train_fsdp.py --checkpoint-dir /tmp/ckpt --resume
    python recipes/train_fsdp.py --device tpu --eager-mode fused             # the "tpu" device, one process
    python recipes/train_fsdp.py --device tpu --variable-length --kernels jax
    python recipes/train_fsdp.py --help                                      # every option, documented

``--device auto`` (the default) computes on the "tpu" device on real TPU chips and with torch's CPU
kernels where CPU processes emulate them; ``--device tpu`` on several ranks needs a process group
that takes device tensors (the recipe checks at start-up and says so).
"""

from __future__ import annotations

import sys
from typing import Sequence

from tpudist.training import StepMetrics, TrainConfig, run


def main(argv: Sequence[str] | None = None) -> list[StepMetrics]:
    return run(TrainConfig, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
