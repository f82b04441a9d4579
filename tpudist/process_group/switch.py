"""A process-wide on/off setting with a scoped override: the check and path switches of the backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Switch:
    """A module-level flag that code reads on every call and tests or benchmarks flip for a scope.

    Every rank must flip a switch at the same point of its program: the switches here change which
    XLA programs or store exchanges a collective runs.
    """

    def __init__(self, on: bool):
        self.on = on

    def __bool__(self) -> bool:
        return self.on

    @contextlib.contextmanager
    def scoped(self, enabled: bool) -> Iterator[None]:
        saved, self.on = self.on, enabled
        try:
            yield
        finally:
            self.on = saved
