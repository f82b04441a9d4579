"""Comparing a distributed run with the same training on one process.

A distributed run is right when its parameters after N steps equal those of plain single-process
torch on the same seed and global batch. Comparing the *updates* ``p_N - p_0`` rather than ``p_N``
keeps the check sensitive: with a small learning rate a gradient that is off by 2x (a missing
average over ranks) changes ``p_N`` by less than 1e-3 relative, but its update by 100%.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

# Wrappers that add a component to parameter names without changing the parameters.
_WRAPPER_COMPONENTS = frozenset({"module", "_checkpoint_wrapped_module", "_orig_mod"})


def canonical_name(name: str) -> str:
    """``name`` without the components DDP, checkpoint_wrapper and torch.compile insert."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full, detached float32 CPU tensor (DTensors gathered), by canonical name.

    Collective when the model holds DTensors: every rank of their meshes must call it.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[canonical_name(name)] = value.float().clone()
    return out


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, "np.ndarray"]:
    """``state`` as numpy arrays (compact, and independent of torch on the receiving side)."""
    return {name: value.detach().cpu().numpy() for name, value in state.items()}


def update_error(initial: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 candidate: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: ``max|candidate - reference| / max|reference - initial|``.

    Raises ValueError if the names differ or a reference parameter did not move (the comparison would
    then be meaningless: pick a larger learning rate or more steps).
    """
    if set(reference) != set(candidate) or set(reference) != set(initial):
        raise ValueError(f"parameter names differ: reference-only={sorted(set(reference) - set(candidate))}, "
                         f"candidate-only={sorted(set(candidate) - set(reference))}")
    initial, reference, candidate = ({n: torch.as_tensor(v) for n, v in d.items()}
                                     for d in (initial, reference, candidate))
    errors = {}
    for name, ref in reference.items():
        moved = (ref - initial[name]).abs().max().item()
        if moved == 0.0:
            raise ValueError(f"reference parameter {name} did not change; the comparison cannot fail")
        errors[name] = (candidate[name].float() - ref).abs().max().item() / moved
    return errors
