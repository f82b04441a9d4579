"""Per-step metrics: a progress line on rank 0 and, optionally, one JSON object per line in a file."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import TextIO


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one optimizer step measured (``tokens`` counts the global batch)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else float("inf")

    def __str__(self) -> str:
        return (f"step {self.step:5d}  loss {self.loss:.4f}  lr {self.lr:.2e}  grad_norm {self.grad_norm:.3f}"
                f"  {self.tokens_per_s:,.0f} tokens/s  {1000 * self.step_time_s:.1f} ms")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tokens_per_s": self.tokens_per_s})


class MetricsLogger:
    """Writes :class:`StepMetrics` when ``enabled`` (rank 0): a line to ``stream`` every
    ``log_every`` steps and every step to the JSONL file at ``path`` (appended, so a resumed run
    continues the same file)."""

    def __init__(self, *, enabled: bool, path: str = "", log_every: int = 1, stream: TextIO | None = None):
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stdout
        self._file = None
        if enabled and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, metrics: StepMetrics) -> None:
        if not self.enabled:
            return
        if metrics.step % self.log_every == 0:
            print(metrics, file=self.stream, flush=True)
        if self._file is not None:
            self._file.write(metrics.to_json() + "\n")
            self._file.flush()

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
