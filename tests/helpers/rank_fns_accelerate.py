"""Rank-side function of tests/training/test_accelerate.py: the accelerate recipe as a library call.

accelerate keeps its state in process-wide singletons and environment variables; a pool's rank
process runs several trainings in a row, so each call starts from a fresh accelerate state.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "accelerate_ddp.py"
_ACCELERATE_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_TORCH_DEVICE", "ACCELERATE_USE_CPU")


def install_device() -> None:
    """Installs the "tpu" device before any backward runs in this process: torch's autograd engine sizes
    its per-device queues at the first backward, so a device installed after one fails its first
    backward (an INTERNAL ASSERT in torch/csrc/autograd/engine.cpp, torch 2.13)."""
    import tpudist.device  # noqa: F401


def run_recipe(argv: list[str]) -> dict:
    """``recipes/accelerate_ddp.py``'s ``main(argv)`` on this rank's process group; its Result as a dict."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # noqa: SLF001 - accelerate's own test reset
    GradientState._reset_state()  # noqa: SLF001
    for name in _ACCELERATE_ENV:
        os.environ.pop(name, None)
    namespace = runpy.run_path(str(RECIPE), run_name="recipe")
    return dataclasses.asdict(namespace["main"](argv))
