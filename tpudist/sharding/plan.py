"""SPMD or MPMD, decided as data, then agreed on by the ranks through the c10d store.

A :class:`Plan` says which path a call takes, why, and which collectives it implies; it can be
printed and compared without any process running. Before a call runs (SPMD or MPMD), the ranks of
its mesh publish the plan's fingerprint under ``tpudist/sharding/<mesh>/<seq>/<rank>`` (``seq`` counts
tpudist.sharding calls on that mesh in this process) and wait, with a timeout, for the others':

- all equal: one XLA program runs across the mesh;
- same meaning, different compiled program (another JAX version, other XLA flags, a rank-local
  ``jax.debug.print``...): each rank falls back to per-rank collectives (MPMD) if the call allows,
  since the c10d collectives issued are still the same on every rank;
- different meaning (shapes, placements, function): :class:`PlanMismatch` names the ranks.
- a rank that never arrives: :class:`AgreementTimeout` names it. Never a hang.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

_KEY_PREFIX = "tpudist/sharding"
DEFAULT_TIMEOUT = timedelta(seconds=30)


class Path(enum.Enum):
    SPMD = "spmd"  # one XLA program across the mesh
    MPMD = "mpmd"  # per-rank eager collectives (DTensor's own)

    def __repr__(self) -> str:
        return f"Path.{self.name}"


@dataclass(frozen=True, slots=True)
class Collective:
    """One mesh axis transition and the XLA collective it becomes."""

    kind: str  # all_gather | psum | psum_scatter | all_to_all | local_slice | local
    axis: str
    src: str  # short placement strings: S(0), R, P(sum)
    dst: str

    def __str__(self) -> str:
        return f"{self.kind}[{self.axis}] {self.src}->{self.dst}"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a call will do: path, reason, implied collectives, fingerprints.

    ``meaning`` identifies what the call computes (same on every rank or it is a user error);
    ``program`` identifies the compiled XLA program (same on every rank or SPMD is unsafe).
    """

    op: str
    path: Path
    reason: str
    collectives: tuple[Collective, ...] = ()
    meaning: str = ""
    program: str = ""

    @property
    def fingerprint(self) -> str:
        return f"{self.meaning}/{self.program}"

    def with_program(self, program: str) -> "Plan":
        return Plan(self.op, self.path, self.reason, self.collectives, self.meaning, program)

    def __str__(self) -> str:
        steps = ", ".join(str(c) for c in self.collectives) or "no communication"
        return f"{self.op}: {self.path.value} ({self.reason}); {steps}; fingerprint {self.fingerprint}"


def digest(*parts: object) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def environment() -> tuple[str, ...]:
    """What beyond the program text decides the compiled program on a rank."""
    import jax

    return (jax.__version__, os.environ.get("XLA_FLAGS", ""))


# -- the transition table: one small rule per (src kind, dst kind) ----------------------------------
def _short(p: Placement) -> str:
    return str(p)


def transition(axis: str, src: Placement, dst: Placement) -> Collective | None:
    """The XLA collective one mesh axis transition becomes (None if the placement is unchanged)."""
    if src == dst:
        return None
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        kind = "all_gather"
    elif isinstance(src, Partial) and isinstance(dst, Replicate):
        kind = "psum"
    elif isinstance(src, Partial) and isinstance(dst, Shard):
        kind = "psum_scatter"
    elif isinstance(src, Shard) and isinstance(dst, Shard):
        kind = "all_to_all"
    elif isinstance(src, Replicate) and isinstance(dst, Shard):
        kind = "local_slice"
    else:
        kind = "local"  # Replicate -> Partial: a local split, no communication
    return Collective(kind, axis, _short(src), _short(dst))


def collectives(axis_names: Sequence[str], src: Sequence[Placement],
                dst: Sequence[Placement]) -> tuple[Collective, ...]:
    steps = (transition(a, s, d) for a, s, d in zip(axis_names, src, dst))
    return tuple(c for c in steps if c is not None)


# -- agreement --------------------------------------------------------------------------------------
class PlanMismatch(ValueError):
    """Ranks asked for different programs at the same point on a mesh."""


class AgreementTimeout(RuntimeError):
    """Some ranks of a mesh did not reach an SPMD call within the timeout."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """The outcome of comparing a plan across ranks: rank -> (meaning, program, description)."""

    seq: int
    by_rank: tuple[tuple[int, str, str, str], ...]

    @property
    def same_meaning(self) -> bool:
        return len({m for _, m, _, _ in self.by_rank}) == 1

    @property
    def same_program(self) -> bool:
        return len({(m, p) for _, m, p, _ in self.by_rank}) == 1

    def differing(self) -> str:
        groups: dict[tuple[str, str], list[int]] = {}
        text: dict[tuple[str, str], str] = {}
        for rank, meaning, program, desc in self.by_rank:
            groups.setdefault((meaning, program), []).append(rank)
            text[(meaning, program)] = desc
        return "; ".join(f"ranks {ranks}: {text[k]} [{k[0]}/{k[1]}]" for k, ranks in groups.items())


@dataclass(slots=True)
class _Sequences:
    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, mesh_id: str) -> int:
        with self.lock:
            seq = self.counts.get(mesh_id, 0)
            self.counts[mesh_id] = seq + 1
            return seq


_sequences = _Sequences()
_paths: dict[tuple[str, Path], int] = {}


def path_counts() -> dict[tuple[str, Path], int]:
    """How many calls took each path in this process, by (op, path): makes fallbacks observable."""
    with _sequences.lock:
        return dict(_paths)


def _count(op: str, path: Path) -> Path:
    with _sequences.lock:
        _paths[(op, path)] = _paths.get((op, path), 0) + 1
    return path


def agree(plan: Plan, mesh_ranks: Sequence[int], mesh_id: str, description: str,
          timeout: timedelta = DEFAULT_TIMEOUT) -> Agreement:
    """Publishes ``plan``'s fingerprint for this rank and collects every mesh rank's, in order.

    Raises:
        AgreementTimeout: if a rank's fingerprint did not arrive within ``timeout``.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    seq = _sequences.next(mesh_id)
    base = f"{_KEY_PREFIX}/{mesh_id}/"
    keys = [f"{base}{seq}/{r}" for r in mesh_ranks]
    store.set(f"{base}{seq}/{rank}", f"{plan.meaning}\n{plan.program}\n{description}")
    if seq >= 2:
        # Every rank that reached seq - 1 had read seq - 2 already: our old key is no longer needed.
        store.delete_key(f"{base}{seq - 2}/{rank}")
    try:
        store.wait(keys, timeout)
    except Exception as e:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError by version
        missing = [r for r, k in zip(mesh_ranks, keys) if not store.check([k])]
        raise AgreementTimeout(
            f"{plan.op} #{seq} on mesh ranks {list(mesh_ranks)}: ranks {missing} did not reach it within "
            f"{timeout.total_seconds():g}s (this rank {rank} runs {description}). Every rank of the mesh must "
            "make the same SPMD calls in the same order") from e
    values = [v.decode().split("\n", 2) for v in store.multi_get(keys)]
    return Agreement(seq, tuple((r, m, p, d) for r, (m, p, d) in zip(mesh_ranks, values)))


def settle(plan: Plan, mesh_ranks: Sequence[int], mesh_id: str, description: str, on_mismatch: str,
           timeout: timedelta) -> Path:
    """The path this call takes on this rank, agreed with the mesh.

    MPMD plans are agreed on too: a rank taking another path than the others is caught here, not
    as a hang inside mismatched collectives.
    """
    if on_mismatch not in ("mpmd", "raise"):
        raise ValueError(f"on_mismatch={on_mismatch!r} is not 'mpmd' or 'raise'")
    op = plan.op.split("(")[0]
    agreement = agree(plan, mesh_ranks, mesh_id, description, timeout)
    if not agreement.same_meaning:
        raise PlanMismatch(f"{plan.op} #{agreement.seq} on mesh ranks {list(mesh_ranks)}: ranks made "
                           f"different calls: {agreement.differing()}; every rank of the mesh must make "
                           "the same SPMD calls in the same order")
    if plan.path is Path.MPMD or agreement.same_program:
        return _count(op, plan.path)
    if on_mismatch == "raise":
        raise PlanMismatch(f"{plan.op} #{agreement.seq} on mesh ranks {list(mesh_ranks)}: ranks made "
                           f"different compiled programs: {agreement.differing()}; pass on_mismatch='mpmd' "
                           "to fall back to per-rank collectives, or make the ranks' JAX versions, "
                           "XLA_FLAGS and traced code identical")
    return _count(op, Path.MPMD)


def run_in_order(description: str, program: Callable[[], Any], timeout: timedelta) -> Any:
    """Runs an SPMD program on the process's comm stream, after the c10d collectives issued before it.

    A mesh's program and its c10d group's collectives share one XLA communicator (same devices);
    running in issue order keeps every rank's sequence on it the same (FACTS.md hazard).
    """
    from tpudist.process_group.work import STREAM, Work

    result: list[Any] = []
    work = Work(description, timeout)
    STREAM.submit(work, lambda: result.append(program()), async_op=False)
    work.wait()
    return result[0]


__all__ = ["Agreement", "AgreementTimeout", "Collective", "Path", "Plan", "PlanMismatch", "agree",
           "collectives", "path_counts", "run_in_order", "settle", "transition"]
