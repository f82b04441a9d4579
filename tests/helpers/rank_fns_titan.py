"""Rank-side functions of tests/training/test_torchtitan_dist.py: recipes/torchtitan/train_llama3.py as a
library call inside a RankPool."""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import torch.distributed as dist

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "torchtitan" / "train_llama3.py"


def install_device() -> None:
    """The "tpu" device, before torchtitan is imported (it reads the device type at import) and before
    any backward (torch's autograd engine sizes its per-device queues at the first one)."""
    import tpudist.device  # noqa: F401


def run_recipe(argv: list[str]) -> dict:
    """The recipe's ``main(argv)`` on this rank's process group; its Result as a dict."""
    namespace = runpy.run_path(str(RECIPE), run_name="recipe")
    return dataclasses.asdict(namespace["main"](argv))


def run_reference(argv: list[str]) -> dict | None:
    """The one-process reference (``--dp-shard 1 --tp 1``), on rank 0 only."""
    return run_recipe([*argv, "--dp-shard", "1", "--tp", "1"]) if dist.get_rank() == 0 else None
