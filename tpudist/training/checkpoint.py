"""Distributed checkpoints of a sharded model and its optimizer, with resume from the last complete one.

Layout: ``<dir>/step_000050/`` holds one ``torch.distributed.checkpoint`` save (each rank writes its
own shards). A save counts only once rank 0 has written ``<dir>/step_000050/COMPLETE`` after every
rank finished writing, so a run killed mid-save resumes from the previous checkpoint. The state
dicts come from ``get_state_dict`` (fully qualified names, DTensor shards), so a checkpoint loads
into another world size or mesh.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and restores ``(model, optimizer, step)`` under ``directory``.

    Example:
        >>> ckpt = Checkpointer("/tmp/run1")                    # doctest: +SKIP
        >>> ckpt.save(model, optimizer, step=50)                 # doctest: +SKIP
        >>> start = ckpt.load_latest(model, optimizer)           # doctest: +SKIP  (50, or 0 if none)
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / COMPLETE_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
        """Collective: every rank writes its shards of the state after ``step`` optimizer steps."""
        path = self.step_dir(step)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        _barrier()
        if _is_rank0():
            (path / COMPLETE_MARKER).write_text(f"{step}\n")
        _barrier()
        return path

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Collective: restores the checkpoint of ``step`` into ``model`` and ``optimizer`` in place."""
        path = self.step_dir(step)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"no complete checkpoint for step={step}: {path}/{COMPLETE_MARKER} "
                                    f"is missing; complete steps: {self.complete_steps()}")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Loads the newest complete checkpoint and returns its step; 0 (nothing loaded) if none.

        Rank 0 picks the step and broadcasts it, so ranks with a different view of a shared file
        system cannot load different checkpoints.
        """
        steps = self.complete_steps()
        latest = torch.tensor([steps[-1] if steps else 0], dtype=torch.int64)
        if dist.is_initialized():
            dist.broadcast(latest, src=0)
        step = int(latest.item())
        if step:
            self.load(model, optimizer, step)
        return step
