"""A TPU slice's facts as the hardware states them: accelerator type, this host's worker id, bounds.

Two sources, as JAX (``jax/_src/clusters/cloud_tpu_cluster.py``) and PyTorch/XLA
(``torch_xla/_internal/tpu.py``) read them (FACTS.md, "A TPU host with several chips"):

- a TPU VM's metadata server: ``http://<host>/computeMetadata/v1/instance/attributes/<key>`` with the
  header ``Metadata-Flavor: Google``; key ``tpu-env`` holds YAML lines (``ACCELERATOR_TYPE: 'v4-16'``,
  ``WORKER_ID: '1'``, ``HOST_BOUNDS: '1,1,2'``, ``CHIPS_PER_HOST_BOUNDS: '2,2,1'``), key
  ``worker-network-endpoints`` the workers in order as ``hostname:uid:ip,...``. ``GCE_METADATA_HOST``
  (Google's client libraries) or ``GCE_METADATA_IP`` (JAX) names another server;
- on GKE, and wherever ``TPU_SKIP_MDS_QUERY`` is set, variables: ``TPU_ACCELERATOR_TYPE``,
  ``TPU_HOST_BOUNDS``, ``TPU_CHIPS_PER_HOST_BOUNDS``, ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``.

Nothing here has been read from a real TPU VM's metadata server (the only TPU used so far had none
reachable): the keys and formats are those the two sources above parse.
"""

from __future__ import annotations

import dataclasses
import math
import re
import urllib.error
import urllib.request
from collections.abc import Mapping

from tpudist.mesh._errors import TopologyError

METADATA_HOST_ENVS = ("GCE_METADATA_HOST", "GCE_METADATA_IP")
DEFAULT_METADATA_HOST = "metadata.google.internal"
METADATA_PATH = "/computeMetadata/v1/instance/attributes/"
# A TPU VM's metadata server answers in milliseconds; a host without one must fail within seconds.
METADATA_TIMEOUT_S = 2.0
SKIP_METADATA_ENV = "TPU_SKIP_MDS_QUERY"

# Accelerator type prefix -> (tpudist generation, TensorCores per chip in the name's count).
# [GCP] v4-N and v5p-N count TensorCores (two a chip: v4-8 is 4 chips); v5litepod-N and v6e-N chips.
ACCELERATOR_PREFIXES = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5litepod": ("v5e", 1), "v6e": ("v6e", 1)}

_GKE_HINT = ("TPU_SKIP_MDS_QUERY=1 TPU_ACCELERATOR_TYPE=v5litepod-16 TPU_HOST_BOUNDS=2,2,1 "
             "TPU_CHIPS_PER_HOST_BOUNDS=2,2,1 TPU_WORKER_ID=<this host's worker id> "
             "TPU_WORKER_HOSTNAMES=<worker 0>,<worker 1>")


class TpuEnvError(TopologyError):
    """The slice's facts are missing, unreadable or contradict each other, or a launch does not fit them."""


@dataclasses.dataclass(frozen=True, slots=True)
class SliceFacts:
    """What a TPU host knows of its slice.

    Attributes:
        accelerator_type: e.g. "v5litepod-16" or "v4-16".
        worker_id: this host's index among the slice's hosts (TPU VM workers), 0-based.
        host_bounds: hosts along x, y, z.
        chips_per_host_bounds: chips of one host along x, y, z.
        worker_hosts: every worker's address, workers in order ("localhost" on a one-host slice).
        source: where the facts came from, for error messages.

    Example:
        >>> facts = SliceFacts("v5litepod-16", 1, (2, 2, 1), (2, 2, 1), ("10.0.0.2", "10.0.0.3",
        ...                    "10.0.0.4", "10.0.0.5"), "example")
        >>> facts.generation, facts.num_chips, facts.chips_per_host
        ('v5e', 16, 4)
    """

    accelerator_type: str
    worker_id: int
    host_bounds: tuple[int, int, int]
    chips_per_host_bounds: tuple[int, int, int]
    worker_hosts: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        _, num_chips = parse_accelerator_type(self.accelerator_type)
        grid = self.chip_bounds
        if math.prod(grid) != num_chips:
            raise TpuEnvError(
                f"accelerator_type={self.accelerator_type!r} names {num_chips} chips but host_bounds="
                f"{_bounds(self.host_bounds)} x chips_per_host_bounds={_bounds(self.chips_per_host_bounds)} "
                f"is {math.prod(grid)} chips (from {self.source}): the slice's facts contradict each "
                "other; correct the variables (or report the metadata you see).")
        if len(self.worker_hosts) != self.num_hosts:
            raise TpuEnvError(
                f"the slice has num_hosts={self.num_hosts} (host_bounds={_bounds(self.host_bounds)}) but "
                f"{len(self.worker_hosts)} worker addresses were given ({', '.join(self.worker_hosts)}; "
                f"from {self.source}): list every worker, in worker-id order.")
        if not 0 <= self.worker_id < self.num_hosts:
            raise TpuEnvError(
                f"worker_id={self.worker_id} is not a worker of a slice of num_hosts={self.num_hosts} "
                f"(from {self.source}): worker ids run 0..{self.num_hosts - 1}.")

    @property
    def generation(self) -> str:
        return parse_accelerator_type(self.accelerator_type)[0]

    @property
    def chip_bounds(self) -> tuple[int, int, int]:
        """Chips of the slice along x, y, z: host bounds times chips-per-host bounds."""
        return tuple(h * c for h, c in zip(self.host_bounds, self.chips_per_host_bounds))  # type: ignore[return-value]

    @property
    def num_hosts(self) -> int:
        return math.prod(self.host_bounds)

    @property
    def chips_per_host(self) -> int:
        return math.prod(self.chips_per_host_bounds)

    @property
    def num_chips(self) -> int:
        return math.prod(self.chip_bounds)


def parse_accelerator_type(text: str) -> tuple[str, int]:
    """``"v4-16"`` -> ``("v4", 8)``: the tpudist generation and the slice's chips.

    Example:
        >>> parse_accelerator_type("v5litepod-16"), parse_accelerator_type("v5p-8")
        (('v5e', 16), ('v5p', 4))
    """
    match = re.fullmatch(r"\s*([a-z0-9]+)-(\d+)\s*", str(text))
    prefix = match.group(1) if match else None
    if prefix not in ACCELERATOR_PREFIXES:
        raise TpuEnvError(
            f"accelerator_type={text!r} is not a TPU type tpudist knows: expected <type>-<count> with "
            f"type one of {', '.join(ACCELERATOR_PREFIXES)} (e.g. v5litepod-16, v6e-8, v4-16, v5p-8). "
            "Other generations have no torus model here; set the variables of libtpu yourself or "
            "run on one of these.")
    generation, per_chip = ACCELERATOR_PREFIXES[prefix]
    count = int(match.group(2))
    if count < 1 or count % per_chip:
        raise TpuEnvError(
            f"accelerator_type={text!r}: {prefix}-N counts TensorCores, {per_chip} a chip, so N must be "
            f"a positive multiple of {per_chip}.")
    return generation, count // per_chip


def _bounds(bounds: tuple[int, ...]) -> str:
    return ",".join(map(str, bounds))


def parse_bounds(name: str, text: str | None, source: str) -> tuple[int, int, int]:
    """``"2,2,1"`` -> ``(2, 2, 1)``; anything else is a TpuEnvError naming ``name``."""
    parts = str(text or "").split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise TpuEnvError(
            f"{name}={text!r} (from {source}) is not bounds: expected three positive integers "
            "'x,y,z', e.g. '2,2,1'.")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def _parse_int(name: str, text: str | None, source: str) -> int:
    if text is None or not str(text).strip().isdigit():
        raise TpuEnvError(f"{name}={text!r} (from {source}) is not a non-negative integer.")
    return int(text)


def uses_variables(environ: Mapping[str, str]) -> bool:
    """Whether the facts come from variables (GKE, ``TPU_SKIP_MDS_QUERY``) rather than the metadata server."""
    return environ.get(SKIP_METADATA_ENV, "").strip().lower() not in ("", "0", "false")


def read_slice_facts(environ: Mapping[str, str], timeout_s: float = METADATA_TIMEOUT_S) -> SliceFacts:
    """The slice's facts, from variables where ``TPU_SKIP_MDS_QUERY`` is set, else the metadata server.

    Raises:
        TpuEnvError: a fact is missing or malformed, or the server does not answer within ``timeout_s``
            per request (the message names what to set instead).
    """
    if uses_variables(environ):
        return _facts_from_variables(environ)
    return _facts_from_metadata(environ, timeout_s)


def _facts_from_variables(environ: Mapping[str, str]) -> SliceFacts:
    source = f"variables ({SKIP_METADATA_ENV} is set)"
    missing = [n for n in ("TPU_ACCELERATOR_TYPE", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS")
               if not environ.get(n)]
    if missing:
        raise TpuEnvError(
            f"{SKIP_METADATA_ENV} is set, so the slice's facts come from variables, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Set them all, e.g. "
            f"{_GKE_HINT}; or unset {SKIP_METADATA_ENV} to read the TPU VM's metadata server.")
    host_bounds = parse_bounds("TPU_HOST_BOUNDS", environ["TPU_HOST_BOUNDS"], source)
    chips = parse_bounds("TPU_CHIPS_PER_HOST_BOUNDS", environ["TPU_CHIPS_PER_HOST_BOUNDS"], source)
    num_hosts = math.prod(host_bounds)
    hostnames = [h.strip() for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if num_hosts > 1 and (not hostnames or "TPU_WORKER_ID" not in environ):
        raise TpuEnvError(
            f"TPU_HOST_BOUNDS={_bounds(host_bounds)} is a slice of num_hosts={num_hosts}, so "
            f"TPU_WORKER_ID (this host's index) and TPU_WORKER_HOSTNAMES (every worker, in order) must "
            f"be set; got TPU_WORKER_ID={environ.get('TPU_WORKER_ID')!r}, "
            f"TPU_WORKER_HOSTNAMES={environ.get('TPU_WORKER_HOSTNAMES')!r}.")
    worker_id = _parse_int("TPU_WORKER_ID", environ.get("TPU_WORKER_ID", "0"), source)
    workers = tuple(hostnames) if num_hosts > 1 else ("localhost",)
    return SliceFacts(environ["TPU_ACCELERATOR_TYPE"].strip(), worker_id, host_bounds, chips, workers, source)


def metadata_url(environ: Mapping[str, str], key: str) -> str:
    host = next((environ[n] for n in METADATA_HOST_ENVS if environ.get(n)), DEFAULT_METADATA_HOST)
    host = host.removeprefix("http://").rstrip("/")
    return f"http://{host}{METADATA_PATH}{key}"


def _get(environ: Mapping[str, str], key: str, timeout_s: float) -> str:
    url = metadata_url(environ, key)
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    # The metadata server is link-local: never through a proxy from http_proxy.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as e:
        if isinstance(e, urllib.error.HTTPError):
            what = f"the server answered HTTP {e.code} {e.reason}"
        else:
            what = f"no answer within {timeout_s:g} s: {getattr(e, 'reason', e)}"
        raise TpuEnvError(
            f"could not read the TPU VM's metadata key {key!r} from {url} ({what}). On a TPU VM the metadata server answers this; elsewhere (GKE, a container "
            f"without it, a test) give the slice's facts as variables instead: {_GKE_HINT}.") from None


def parse_tpu_env(text: str) -> dict[str, str]:
    """The ``tpu-env`` metadata value (YAML lines ``KEY: 'value'``) as a dict."""
    values = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*:\s*(.*?)\s*", line)
        if match:
            value = match.group(2)
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[match.group(1)] = value
    return values


def _facts_from_metadata(environ: Mapping[str, str], timeout_s: float) -> SliceFacts:
    source = f"the metadata server at {metadata_url(environ, 'tpu-env')}"
    tpu_env = parse_tpu_env(_get(environ, "tpu-env", timeout_s))
    accelerator = tpu_env.get("ACCELERATOR_TYPE")
    if not accelerator:
        raise TpuEnvError(f"tpu-env from {source} has no ACCELERATOR_TYPE (keys: "
                          f"{', '.join(sorted(tpu_env)) or 'none'}): is this a TPU VM? Give the facts as "
                          f"variables instead: {_GKE_HINT}.")
    # PyTorch/XLA reads TPU_PROCESS_BOUNDS / TPU_CHIPS_PER_PROCESS_BOUNDS, which TPU VMs list too.
    host_bounds = parse_bounds("HOST_BOUNDS", tpu_env.get("HOST_BOUNDS") or tpu_env.get("TPU_PROCESS_BOUNDS"), source)
    chips = parse_bounds("CHIPS_PER_HOST_BOUNDS", tpu_env.get("CHIPS_PER_HOST_BOUNDS")
                         or tpu_env.get("TPU_CHIPS_PER_PROCESS_BOUNDS"), source)
    worker_id = _parse_int("WORKER_ID", tpu_env.get("WORKER_ID"), source)
    workers: tuple[str, ...] = ("localhost",)
    if math.prod(host_bounds) > 1:
        endpoints = _get(environ, "worker-network-endpoints", timeout_s).strip()
        try:
            workers = tuple(entry.split(":")[2] for entry in endpoints.split(","))
        except IndexError:
            raise TpuEnvError(f"worker-network-endpoints={endpoints!r} from {source} is not "
                              "'hostname:uid:ip,...'.") from None
    return SliceFacts(accelerator, worker_id, host_bounds, chips, workers, source)
