"""A deterministic synthetic language-modelling task: token streams from a fixed random Markov chain.

Every token has ``branching`` likely successors, so a model that learns the bigram table brings the
loss from ``ln(vocab_size)`` down towards the chain's entropy rate (about ``ln(branching)``). The
batch of a step is a pure function of ``(seed, step)``: resuming at step ``s`` sees exactly the
data an uninterrupted run would have seen, with nothing lost or repeated.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MarkovTask:
    """Sequences from a seeded random Markov chain over ``vocab_size`` tokens.

    Example:
        >>> task = MarkovTask(vocab_size=32, seq_len=8, seed=0)
        >>> inputs, targets = task.batch(step=3, batch_size=4)
        >>> inputs.shape, bool((inputs[:, 1:] == targets[:, :-1]).all())
        (torch.Size([4, 8]), True)
    """

    vocab_size: int
    seq_len: int
    seed: int = 0
    branching: int = 4

    def transition_table(self) -> torch.Tensor:
        """``(vocab, vocab)`` row-stochastic matrix: ``branching`` random successors per token."""
        gen = torch.Generator().manual_seed(self.seed)
        logits = torch.full((self.vocab_size, self.vocab_size), -math.inf)
        successors = torch.rand(self.vocab_size, self.vocab_size, generator=gen).argsort(dim=1)[:, :self.branching]
        weights = torch.rand(self.vocab_size, self.branching, generator=gen) * 2.0
        logits.scatter_(1, successors, weights)
        return logits.softmax(dim=1)

    def entropy_rate(self) -> float:
        """Nats per token of the chain under its stationary distribution: the loss floor."""
        table = self.transition_table().double()
        stationary = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(200):
            stationary = stationary @ table
        row_entropy = -(table * table.clamp_min(1e-300).log()).sum(dim=1)
        return float(stationary @ row_entropy)

    def batch(self, step: int, batch_size: int, shard: int = 0, num_shards: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[shard::num_shards]`` of the global batch of ``step``: ``(inputs, targets)`` int64.

        ``batch_size`` is the global batch size; it must divide evenly among ``num_shards``.
        """
        if batch_size % num_shards:
            raise ValueError(f"global batch_size={batch_size} must be divisible by num_shards={num_shards} "
                             "(the data-parallel degree)")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        table = self.transition_table()
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen)
        for t in range(self.seq_len):
            tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=gen).squeeze(1)
        local = tokens[shard::num_shards]
        return local[:, :-1].contiguous(), local[:, 1:].contiguous()

    def length_of(self, step: int) -> int:
        """The sequence length of ``step`` in a variable-length run: uniform in ``[seq_len/8, seq_len]``.

        A pure function of ``(seed, step)``, like the batch, and the same on every rank.
        """
        low = max(1, self.seq_len // 8)
        return random.Random(f"{self.seed}:{step}:length").randint(low, self.seq_len)
