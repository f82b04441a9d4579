"""Input checks shared by the collectives, and how XLA's failures are recognised."""

from __future__ import annotations

from typing import Any

import torch

STUCK_GRACE_S = 5.0  # how long timed-out ranks wait for each other's report before naming absentees


def looks_like_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


def looks_like_peer_loss(e: Exception) -> bool:
    text = str(e).lower()
    return "closed by peer" in text or "connection reset" in text or "socket closed" in text



def check_device(op: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: tensor is on device={t.device}, but tpudist ranks hold their data on "
                         "the host (cpu) in this release; move it with .cpu()")
    if t.is_sparse:
        raise TypeError(f"{op}: sparse tensors are not supported; pass t.to_dense()")
    return t


def check_same_dtype(op: str, tensors: list[torch.Tensor]) -> None:
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) > 1:
        raise TypeError(f"{op}: all tensors must have one dtype, got dtypes={dtypes}")


def check_numel(op: str, what: str, t: torch.Tensor, numel: int) -> None:
    if t.numel() != numel:
        raise ValueError(f"{op}: {what} has {t.numel()} elements (shape {tuple(t.shape)}) but "
                         f"{numel} are needed")
