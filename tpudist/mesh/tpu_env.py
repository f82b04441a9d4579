"""One process per chip on a TPU host: libtpu's variables for each local rank, and the check after start.

libtpu lets one process hold a chip, and a process told nothing opens every chip of its host. JAX's
multi-process TPU tests (``jax/_src/test_multiprocess.py``) and PyTorch/XLA (``configure_topology`` in
``torch_xla/_internal/tpu.py``) give each process, before its TPU backend starts:

| variable | value |
|---|---|
| ``TPU_VISIBLE_CHIPS`` | the local rank: this process's chip on the host |
| ``TPU_CHIPS_PER_PROCESS_BOUNDS`` | ``1,1,1``: one chip a process |
| ``TPU_PROCESS_BOUNDS`` | the slice's chip grid in processes: host bounds x chips-per-host bounds |
| ``CLOUD_TPU_TASK_ID`` | worker id x processes per host + local rank (= the torch rank) |
| ``TPU_PROCESS_PORT`` | base port (8476) + local rank |
| ``TPU_PROCESS_ADDRESSES`` | ``host:port`` of every process, workers in order (``localhost`` on one host) |
| ``ALLOW_MULTIPLE_LIBTPU_LOAD`` | ``1`` |

A variable already set in the environment wins. Plans are data (`host_plan`), printed by
``python -m tpudist tpu-env`` and applied by `configure_process`, which the "tpu" process group's
runtime and the "tpu" device call before JAX starts its TPU backend. None of this has run on a
multi-chip TPU host yet; the one-process path (`one_chip_env`) is the one a single v5e chip boots with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from tpudist.mesh.generations import GENERATIONS
from tpudist.mesh.topology import Topology
from tpudist.mesh.tpu_facts import SliceFacts, TpuEnvError, read_slice_facts

# [JAX] cloud_tpu_cluster.py's coordinator port and [PTXLA] configure_topology's base_port.
DEFAULT_BASE_PORT = 8476
BASE_PORT_ENV = "TPUDIST_TPU_BASE_PORT"
PLATFORM_ENV = "TPUDIST_PLATFORM"
TOPOLOGY_ENV = "TPUDIST_TOPOLOGY"
ENV_NAMES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID",
             "TPU_PROCESS_PORT", "TPU_PROCESS_ADDRESSES", "ALLOW_MULTIPLE_LIBTPU_LOAD")
_ONE_CHIP = "1,1,1"


@dataclasses.dataclass(frozen=True, slots=True)
class RankEnv:
    """libtpu's variables for one local rank, in `ENV_NAMES` order; ``user_set`` names those the
    environment already held (their values are the user's)."""

    local_rank: int
    env: tuple[tuple[str, str], ...]
    user_set: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclasses.dataclass(frozen=True, slots=True)
class HostPlan:
    """What every local rank of one host sets, and the slice they form.

    Example:
        >>> facts = SliceFacts("v4-16", 1, (1, 1, 2), (2, 2, 1), ("10.0.0.2", "10.0.0.3"), "example")
        >>> plan = host_plan(facts, 4)
        >>> str(plan.slice), plan.ranks[2].as_dict()["CLOUD_TPU_TASK_ID"]
        ('v4:2x2x2', '6')
    """

    slice: Topology
    ranks: tuple[RankEnv, ...]

    def to_json(self) -> dict[str, Any]:
        return {"slice": str(self.slice),
                "ranks": [{"local_rank": r.local_rank, "env": r.as_dict()} for r in self.ranks]}


def platform(environ: Mapping[str, str] = os.environ) -> str:
    """"cpu" emulates chips with processes; "tpu" drives real chips (``TPUDIST_PLATFORM`` overrides;
    else "tpu" exactly when libtpu is installed)."""
    explicit = environ.get(PLATFORM_ENV)
    if explicit:
        if explicit not in ("cpu", "tpu"):
            raise ValueError(f"{PLATFORM_ENV}={explicit!r} is not a platform: use 'cpu' or 'tpu'")
        return explicit
    return "tpu" if importlib.util.find_spec("libtpu") is not None else "cpu"


def base_port(environ: Mapping[str, str] = os.environ) -> int:
    text = environ.get(BASE_PORT_ENV, str(DEFAULT_BASE_PORT))
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{BASE_PORT_ENV}={text!r} is not a port: give an integer 1..65535 (default "
                         f"{DEFAULT_BASE_PORT}); each host uses it and the next LOCAL_WORLD_SIZE - 1 ports.")
    return int(text)


def slice_topology(facts: SliceFacts) -> Topology:
    """The slice in `Topology` form: ``v5litepod-16`` with host bounds 2,2,1 and chips per host 2,2,1
    is ``v5e:4x4``. The torus model's hosts must be the hardware's, or ranks would sit on other chips."""
    x, y, z = facts.chip_bounds
    shape = (x, y, z)
    if GENERATIONS[facts.generation].num_dims == 2:
        if z != 1:
            raise TpuEnvError(f"accelerator_type={facts.accelerator_type!r} is a 2-D generation but its "
                              f"chip bounds are {x},{y},{z} (from {facts.source}): z must be 1.")
        shape = (x, y)
    topology = Topology(facts.generation, shape)
    chips = facts.chips_per_host_bounds[:len(shape)]
    if topology.num_hosts > 1 and tuple(topology.host_shape) != tuple(chips):
        raise TpuEnvError(
            f"the torus model of {topology} has hosts of {'x'.join(map(str, topology.host_shape))} chips "
            f"but the hardware's chips_per_host_bounds are {','.join(map(str, facts.chips_per_host_bounds))} "
            f"(from {facts.source}): ranks would not run host-major like the chips. Please report this "
            "with the values; meanwhile set libtpu's variables yourself.")
    return topology


def host_plan(facts: SliceFacts, num_local_processes: int, port: int = DEFAULT_BASE_PORT,
              environ: Mapping[str, str] | None = None) -> HostPlan:
    """libtpu's variables for each of ``num_local_processes`` ranks on the host ``facts`` describe.

    One process per chip of every host; on a one-host slice a single process may also take chip 0
    alone (`one_chip_env`). Variables set in ``environ`` win (and are listed in ``user_set``).
    """
    if isinstance(num_local_processes, bool) or not isinstance(num_local_processes, int) or num_local_processes < 1:
        raise TpuEnvError(f"nproc_per_node={num_local_processes!r} must be an int >= 1.")
    per_host = facts.chips_per_host
    if num_local_processes > per_host:
        raise TpuEnvError(
            f"nproc_per_node={num_local_processes} processes on a host of {facts.accelerator_type} that has "
            f"chips_per_host={per_host} chips: tpudist runs one process per chip, and libtpu lets one process "
            f"hold a chip. Launch torchrun --nproc-per-node {per_host}.")
    if num_local_processes == 1 and facts.num_hosts == 1:
        shape = (1,) * GENERATIONS[facts.generation].num_dims
        return HostPlan(Topology(facts.generation, shape), (_with_user(one_chip_env(port), environ),))
    if num_local_processes != per_host:
        raise TpuEnvError(
            f"nproc_per_node={num_local_processes} on a host of {facts.accelerator_type} with "
            f"chips_per_host={per_host} chips (num_hosts={facts.num_hosts}): tpudist runs one process per "
            f"chip of the slice, so launch --nproc-per-node {per_host} on every worker"
            f"{'' if facts.num_hosts > 1 else ' (or 1, which takes chip 0 alone)'}.")
    topology = slice_topology(facts)
    ports = [port + r for r in range(per_host)]
    addresses = ",".join(f"{host}:{p}" for host in facts.worker_hosts for p in ports)
    bounds = ",".join(map(str, facts.chip_bounds))
    ranks = (_with_user(_rank_env(r, bounds, facts.worker_id * per_host + r, ports[r], addresses), environ)
             for r in range(per_host))
    return HostPlan(topology, tuple(ranks))


def one_chip_env(port: int = DEFAULT_BASE_PORT) -> RankEnv:
    """A one-process world: chip 0 of the host, alone (PyTorch/XLA's ``configure_one_chip_topology``
    sets the first three). Needs no slice facts."""
    return _rank_env(0, _ONE_CHIP, 0, port, f"localhost:{port}")


def _rank_env(local_rank: int, process_bounds: str, task_id: int, port: int, addresses: str) -> RankEnv:
    """The variables of `ENV_NAMES`, in that order, for the process on chip ``local_rank`` of its host."""
    values = (str(local_rank), _ONE_CHIP, process_bounds, str(task_id), str(port), addresses, "1")
    return RankEnv(local_rank, tuple(zip(ENV_NAMES, values, strict=True)))


def _with_user(rank: RankEnv, environ: Mapping[str, str] | None) -> RankEnv:
    if not environ:
        return rank
    user = tuple(name for name, _ in rank.env if name in environ)
    env = tuple((name, environ.get(name, value)) for name, value in rank.env)
    return RankEnv(rank.local_rank, env, user)


def _int_env(environ: Mapping[str, str], name: str, world_size: int) -> int:
    text = environ.get(name)
    if text is None or not text.strip().isdigit():
        raise TpuEnvError(
            f"{name}={text!r}: a TPU world of world_size={world_size} runs one process per chip, and "
            f"which chip is this process's comes from torchrun's {name}. Launch with torchrun "
            "--nproc-per-node <chips per host> (or set LOCAL_RANK and LOCAL_WORLD_SIZE).")
    return int(text)


def configure_process(rank: int, world_size: int, environ: MutableMapping[str, str] = os.environ,
                      timeout_s: float | None = None) -> Topology | None:
    """Sets libtpu's variables for this process in ``environ`` (those already set win), before JAX
    starts its TPU backend. Returns the slice, or None for a one-process world (chip 0 alone, no
    slice facts read: its generation is known once the backend reports the chip).

    Raises:
        TpuEnvError: more processes on the host than chips, facts that cannot be read, a rank that
            is not where the slice puts it (torchrun's ``--node-rank`` is not the TPU worker id), or
            a ``TPUDIST_TOPOLOGY`` that disagrees with the hardware.
    """
    port = base_port(environ)
    if world_size == 1:
        chosen = one_chip_env(port)
        topology = None
    else:
        local_world_size = _int_env(environ, "LOCAL_WORLD_SIZE", world_size)
        local_rank = _int_env(environ, "LOCAL_RANK", world_size)
        kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
        facts = read_slice_facts(environ, **kwargs)
        plan = host_plan(facts, local_world_size, port)
        topology = plan.slice
        if topology.num_chips != world_size:
            raise TpuEnvError(
                f"world_size={world_size} but the slice {topology} ({facts.accelerator_type}, from "
                f"{facts.source}) has {topology.num_chips} chips: tpudist runs one rank per chip. Launch "
                f"--nproc-per-node {facts.chips_per_host} on each of the {facts.num_hosts} workers.")
        if not 0 <= local_rank < len(plan.ranks):
            raise TpuEnvError(f"LOCAL_RANK={local_rank} is not a local rank of LOCAL_WORLD_SIZE={local_world_size}.")
        chosen = plan.ranks[local_rank]
        task_id = int(chosen.as_dict()["CLOUD_TPU_TASK_ID"])
        if rank != task_id:
            raise TpuEnvError(
                f"rank={rank} (LOCAL_RANK={local_rank}) runs on TPU worker_id={facts.worker_id}, whose chips "
                f"are ranks {facts.worker_id * local_world_size}..{(facts.worker_id + 1) * local_world_size - 1}: "
                f"ranks must run host-major like the chips. Launch torchrun with --node-rank "
                f"{facts.worker_id} on this worker (the TPU worker id).")
        check_topology_env(topology, environ)
    for name, value in chosen.env:
        environ.setdefault(name, value)
    return topology


def check_topology_env(topology: Topology, environ: Mapping[str, str] = os.environ) -> None:
    """A ``TPUDIST_TOPOLOGY`` that disagrees with the slice the hardware reports is an error naming both."""
    text = environ.get(TOPOLOGY_ENV)
    if text and Topology.parse(text) != topology:
        raise TpuEnvError(
            f"{TOPOLOGY_ENV}={text} but this TPU slice is {topology} (from the hardware's facts): on a TPU "
            f"the slice comes from the hardware. Unset {TOPOLOGY_ENV}, or set it to {topology}.")


def topology_of_chip(device_kind: str) -> Topology:
    """The one-chip slice of a generation named by JAX's ``device_kind`` (a one-process world)."""
    from tpudist.mesh.generations import GENERATIONS

    for info in GENERATIONS.values():
        if info.device_kind == device_kind:
            return Topology(info.name, (1,) * info.num_dims)
    raise TpuEnvError(f"device_kind={device_kind!r} is not a TPU generation tpudist models "
                      f"({', '.join(g.device_kind for g in GENERATIONS.values())}).")


def check_chip_coords(topology: Topology, devices: Sequence[Any]) -> None:
    """Each rank's chip, as JAX reports it (``Device.coords``), must be where the torus model puts
    that rank, so that mesh layouts use the real chips. ``devices[r]`` is rank r's device."""
    wrong = []
    for rank, device in enumerate(devices):
        seen = tuple(int(c) for c in device.coords)
        expected = tuple(topology.coords(rank)) + (0,) * (len(seen) - topology.num_dims)
        if seen != expected:
            wrong.append(f"rank {rank} on coords={seen}, model {expected}")
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise TpuEnvError(
            f"the chips JAX reports do not sit where the torus model of {topology} puts the ranks ({shown}): "
            "mesh layouts would use other chips than they plan. Launch torchrun with --node-rank = the TPU "
            "worker id, leave TPU_VISIBLE_CHIPS / CLOUD_TPU_TASK_ID unset (tpudist sets them per rank), "
            "and report this with `python -m tpudist tpu-env --nproc-per-node N --json` if it persists.")

