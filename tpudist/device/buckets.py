"""Bounded dynamism: pad a varying dimension to a few bucket sizes so XLA compiles a few programs.

Every distinct shape is a new XLA program (seconds to compile). Padding lengths up to multiples of
128 with at most 8 buckets (TorchTPU's scheme) bounds the programs a run compiles: 16 sequence
lengths up to 1024 become at most 8 shapes.

    buckets = Buckets(max_length=1024)              # sizes 128, 256, ..., 1024
    batch = pad_batch(tokens, targets, buckets)     # on the host, before .to("tpu"): right padding,
                                                    # targets -100 on padding
    loss = F.cross_entropy(model(batch.tokens).flatten(0, 1), batch.targets.flatten())  # ignore_index=-100

Pad on the host: padding a device tensor is itself an op on the unpadded shape (a new kernel, and
in Fused mode a new program, per length). Right padding leaves a causal model's outputs at real positions unchanged (padding comes after
them). Bidirectional attention must not attend to padding: pass ``batch.key_padding_mask`` (True for
real tokens) as an attention mask, e.g. ``attention_mask(batch.key_padding_mask)`` for SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MULTIPLE = 128    # XLA TPU tiles are 128 wide on the lane axis: pad to whole tiles
MAX_BUCKETS = 8   # TorchTPU's bound on programs per varying dimension
IGNORE_INDEX = -100  # torch's cross_entropy / nll_loss default ignore_index


@dataclass(frozen=True, slots=True)
class Buckets:
    """Bucket sizes for lengths up to ``max_length``: multiples of ``multiple``, at most ``max_buckets``.

    If ``max_length / multiple`` exceeds ``max_buckets``, the step grows to the smallest multiple of
    ``multiple`` that covers ``max_length`` in ``max_buckets`` steps.

    Example:
        >>> Buckets(1024).sizes
        (128, 256, 384, 512, 640, 768, 896, 1024)
        >>> Buckets(2048).size_for(300)
        512
    """

    max_length: int
    multiple: int = MULTIPLE
    max_buckets: int = MAX_BUCKETS

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.multiple < 1 or self.max_buckets < 1:
            raise ValueError(f"max_length={self.max_length}, multiple={self.multiple} and "
                             f"max_buckets={self.max_buckets} must all be >= 1")

    @property
    def step(self) -> int:
        per_bucket = -(-self.max_length // self.max_buckets)
        return -(-per_bucket // self.multiple) * self.multiple

    @property
    def sizes(self) -> tuple[int, ...]:
        step = self.step
        return tuple(step * i for i in range(1, -(-self.max_length // step) + 1))

    def size_for(self, length: int) -> int:
        """The bucket a length pads to; ValueError beyond ``max_length``."""
        if length > self.max_length or length < 0:
            raise ValueError(f"length={length} is outside the buckets (0..max_length={self.max_length}); "
                             "raise max_length (more or wider buckets)")
        step = self.step
        return max(step, -(-length // step) * step)


@dataclass(frozen=True, slots=True)
class Growth:
    """Storage sizes for a tensor that grows on the device (generate's token ids, ``cat([ids, next])``).

    Up to ``multiple * max_buckets`` the capacity is the next multiple of ``multiple``; beyond it,
    ``per_octave`` sizes per power of two. A generation of N tokens then compiles one kernel per
    capacity it reaches, not one per token.

    Example:
        >>> Growth().capacity_for(5), Growth().capacity_for(129), Growth().capacity_for(1500)
        (128, 256, 1536)
    """

    multiple: int = MULTIPLE
    max_buckets: int = MAX_BUCKETS
    per_octave: int = 4

    def __post_init__(self) -> None:
        if self.multiple < 1 or self.max_buckets < 1 or self.per_octave < 1:
            raise ValueError(f"multiple={self.multiple}, max_buckets={self.max_buckets} and "
                             f"per_octave={self.per_octave} must all be >= 1")

    def capacity_for(self, length: int) -> int:
        if length <= self.multiple * self.max_buckets:
            return max(self.multiple, -(-length // self.multiple) * self.multiple)
        octave = 1 << (length - 1).bit_length() - 1  # the power of two just below length
        step = max(1, octave // self.per_octave)
        return -(-length // step) * step


_growth = Growth()


def growth() -> Growth:
    """The capacities growing device tensors are padded to (``set_growth`` changes them)."""
    return _growth


def set_growth(rule: Growth) -> Growth:
    """Use ``rule`` for tensors that grow on the device from now on; returns the previous rule."""
    global _growth
    if not isinstance(rule, Growth):
        raise TypeError(f"rule={rule!r} is not a tpudist.device.buckets.Growth")
    previous, _growth = _growth, rule
    return previous


def pad_right(x: torch.Tensor, length: int, dim: int = 1, value=0) -> torch.Tensor:
    """``x`` padded with ``value`` at the end of ``dim`` to ``length`` (returned as is if already there)."""
    have = x.shape[dim]
    if have > length:
        raise ValueError(f"dim {dim} has size {have}, longer than length={length}")
    if have == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - have
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def key_padding_mask(lengths, padded_length: int, device=None) -> torch.Tensor:
    """Bool ``(batch, padded_length)``: True at real positions, False at padding."""
    lengths = torch.as_tensor(lengths)
    return torch.arange(padded_length)[None, :].lt(lengths[:, None]).to(device or "cpu")


def attention_mask(key_padding: torch.Tensor) -> torch.Tensor:
    """An SDPA boolean ``attn_mask`` ``(batch, 1, 1, keys)`` from a key-padding mask (True = attend)."""
    return key_padding[:, None, None, :]


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    tokens: torch.Tensor            # (batch, bucket length), padded on the right with pad_id
    targets: torch.Tensor | None    # same shape, IGNORE_INDEX on padding
    key_padding_mask: torch.Tensor  # (batch, bucket length), True at real tokens
    length: int                     # the unpadded length


def pad_batch(tokens: torch.Tensor, targets: torch.Tensor | None, buckets: Buckets, pad_id: int = 0) -> PaddedBatch:
    """Pad ``(batch, length)`` tokens (and targets) on the right to the length's bucket."""
    length = tokens.shape[1]
    size = buckets.size_for(length)
    mask = key_padding_mask([length] * tokens.shape[0], size, device=tokens.device)
    return PaddedBatch(
        tokens=pad_right(tokens, size, 1, pad_id),
        targets=None if targets is None else pad_right(targets, size, 1, IGNORE_INDEX),
        key_padding_mask=mask, length=length)
