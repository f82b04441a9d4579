"""Shape advice for TPUs: which model dimensions waste the matrix units, and what to use instead.

A TPU multiplies matrices on MXUs, systolic arrays of ``MXU_SIZE x MXU_SIZE`` cells; XLA pads every
matmul operand dimension up to a multiple of the array size, so a width of 64 on a 128-wide MXU
computes half zeros. Attention kernels tile heads in 128-lane blocks, and the vocabulary is the
output dimension of the largest matmul in a small model.

Example:
    >>> from tpudist.training.model import ModelArgs
    >>> for advice in advise(ModelArgs(vocab_size=128, dim=256, n_heads=4, n_kv_heads=2, ffn_hidden=768), "v5e"):
    ...     print(advice)
    head_dim=64 (dim=256 / n_heads=4) is not a multiple of 128: attention matmuls fill 64 of the 128 MXU lanes; suggested: n_heads=2 (head_dim=128)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tpudist.training.model import ModelArgs

# MXU array side per generation. Source: Google Cloud TPU system architecture pages and the JAX
# scaling book, "How to Think About TPUs": 128x128 MXUs up to v5p, 256x256 on v6e (Trillium).
MXU_SIZE = {"v2": 128, "v3": 128, "v4": 128, "v5e": 128, "v5p": 128, "v6e": 256}
# Attention kernels (Pallas flash attention, splash attention) tile head_dim in 128-lane blocks on
# every generation, and TPU vector registers are 128 lanes wide.
HEAD_DIM_MULTIPLE = 128
VOCAB_MULTIPLE = 128
DEFAULT_GENERATION = "v5e"


@dataclass(frozen=True, slots=True)
class Advice:
    """One TPU-unfriendly shape: the ``rule`` broken, a sentence for people, the suggested fields."""

    rule: str
    message: str
    suggested: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return self.message


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def resolve_generation(generation: str = "") -> str:
    """``generation`` if given, else the prefix of ``TPUDIST_TOPOLOGY`` (``v5p:2x2x1``), else v5e."""
    name = generation or os.environ.get("TPUDIST_TOPOLOGY", "").split(":")[0] or DEFAULT_GENERATION
    name = name.lower()
    if name not in MXU_SIZE:
        raise ValueError(f"tpu generation={name!r} is unknown; known: {sorted(MXU_SIZE)}")
    return name


def advise(args: ModelArgs, generation: str = "", tp: int = 1) -> list[Advice]:
    """Warnings for the shapes of ``args`` that run poorly on ``generation``, each with a fix.

    With tensor parallelism of degree ``tp`` the matmuls each chip runs are ``dim / tp`` and
    ``ffn_hidden / tp`` wide: those widths are checked too.
    """
    generation = resolve_generation(generation)
    mxu = MXU_SIZE[generation]
    found = []
    if args.head_dim % HEAD_DIM_MULTIPLE:
        head_dim = _round_up(args.head_dim, HEAD_DIM_MULTIPLE)
        n_heads = max(1, _round_up(args.dim, mxu) // head_dim)
        n_kv_heads = math.gcd(args.n_kv_heads, n_heads)
        suggested = (("n_heads", n_heads),) + ((("n_kv_heads", n_kv_heads),) if n_kv_heads != args.n_kv_heads else ())
        fix = ", ".join(f"{name}={value}" for name, value in suggested)
        found.append(Advice(
            "head_dim", f"head_dim={args.head_dim} (dim={args.dim} / n_heads={args.n_heads}) is not a multiple "
            f"of {HEAD_DIM_MULTIPLE}: attention matmuls fill {args.head_dim} of the {HEAD_DIM_MULTIPLE} MXU "
            f"lanes; suggested: {fix} (head_dim={head_dim})", suggested))
    for name, value in (("dim", args.dim), ("ffn_hidden", args.hidden_dim)):
        if value % mxu:
            padded = _round_up(value, mxu)
            waste = round(100 * (1 - value / padded))
            found.append(Advice(
                "matmul_dim", f"{name}={value} is not a multiple of {mxu}: matmuls over it are padded to the "
                f"{generation} MXU's {mxu}x{mxu} tiles, wasting {waste}%; suggested: {name}={padded}",
                ((name, padded),)))
        elif tp > 1 and (value // tp) % mxu:
            smaller_tp = max(t for t in range(1, tp + 1) if tp % t == 0 and value % t == 0 and (value // t) % mxu == 0)
            padded = _round_up(value, mxu * tp)
            found.append(Advice(
                "tp_shard", f"{name}/tp={value // tp} ({name}={value} split over tp={tp}) is not a multiple of "
                f"{mxu}: each chip's matmuls are padded to the {generation} MXU's {mxu}x{mxu} tiles; "
                f"suggested: tp={smaller_tp} or {name}={padded}", (("tp", smaller_tp), (name, padded))))
    if args.vocab_size % VOCAB_MULTIPLE:
        padded = _round_up(args.vocab_size, VOCAB_MULTIPLE)
        found.append(Advice(
            "vocab", f"vocab_size={args.vocab_size} is not padded to a multiple of {VOCAB_MULTIPLE}: the "
            f"embedding and output matmul are padded anyway; suggested: vocab_size={padded} "
            "(the extra rows are never targets)", (("vocab_size", padded),)))
    return found
