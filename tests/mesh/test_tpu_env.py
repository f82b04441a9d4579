"""libtpu's variables per local rank (tpudist.mesh.tpu_env), the slice's facts (tpu_facts) and `tpu-env`.

Expected values are written out from the contract in PyTorch/XLA's ``configure_topology`` and JAX's
``test_multiprocess.py`` (FACTS.md, "A TPU host with several chips"), not taken from the code:
TPU_PROCESS_BOUNDS = host bounds x chips-per-host bounds, CLOUD_TPU_TASK_ID = worker x nproc + local
rank, ports 8476 + local rank, addresses every worker's ports, workers in order. No real TPU VM's
metadata server was ever read: the fake one here serves what those sources parse.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from tpudist.__main__ import main
from tpudist.mesh import Topology, tpu_env
from tpudist.mesh.tpu_facts import TpuEnvError, parse_accelerator_type, read_slice_facts


def _gke(accelerator, host_bounds, chips_per_host, worker_id=None, hostnames=None):
    env = {"TPU_SKIP_MDS_QUERY": "true", "TPU_ACCELERATOR_TYPE": accelerator,
           "TPU_HOST_BOUNDS": host_bounds, "TPU_CHIPS_PER_HOST_BOUNDS": chips_per_host}
    if worker_id is not None:
        env["TPU_WORKER_ID"] = str(worker_id)
    if hostnames is not None:
        env["TPU_WORKER_HOSTNAMES"] = hostnames
    return env


@pytest.mark.parametrize("text, expected", [
    ("v4-8", ("v4", 4)), ("v4-16", ("v4", 8)), ("v5p-8", ("v5p", 4)), ("v5p-128", ("v5p", 64)),
    ("v5litepod-4", ("v5e", 4)), ("v5litepod-16", ("v5e", 16)), ("v6e-8", ("v6e", 8)), ("v6e-256", ("v6e", 256))])
def test_accelerator_types_count_chips_or_tensorcores(text, expected):
    assert parse_accelerator_type(text) == expected


@pytest.mark.parametrize("text, rule", [
    ("v3-8", "not a TPU type tpudist knows"), ("tpu7x-8", "not a TPU type tpudist knows"),
    ("v5litepod", "not a TPU type"), ("v4-7", "counts TensorCores, 2 a chip")])
def test_unknown_accelerator_types_are_named(text, rule):
    with pytest.raises(TpuEnvError, match=rule) as info:
        parse_accelerator_type(text)
    assert repr(text) in str(info.value)


def test_v5e_pod_slice_worker_2():
    env = _gke("v5litepod-16", "2,2,1", "2,2,1", 2, "h0,h1,h2,h3")
    plan = tpu_env.host_plan(read_slice_facts(env), 4)
    assert str(plan.slice) == "v5e:4x4"
    addresses = ",".join(f"{h}:{p}" for h in ("h0", "h1", "h2", "h3") for p in (8476, 8477, 8478, 8479))
    assert [r.as_dict() for r in plan.ranks] == [
        {"TPU_VISIBLE_CHIPS": str(i), "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "4,4,1",
         "CLOUD_TPU_TASK_ID": str(8 + i), "TPU_PROCESS_PORT": str(8476 + i), "TPU_PROCESS_ADDRESSES": addresses,
         "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"} for i in range(4)]


@pytest.mark.parametrize("accelerator, host_bounds, chips, worker, hosts, slice_, bounds, task_ids", [
    ("v4-8", "1,1,1", "2,2,1", 0, None, "v4:2x2x1", "2,2,1", [0, 1, 2, 3]),
    ("v4-16", "1,1,2", "2,2,1", 1, "a,b", "v4:2x2x2", "2,2,2", [4, 5, 6, 7]),
    ("v5p-8", "1,1,1", "2,2,1", 0, None, "v5p:2x2x1", "2,2,1", [0, 1, 2, 3]),
    ("v5p-32", "1,2,2", "2,2,1", 3, "a,b,c,d", "v5p:2x4x2", "2,4,2", [12, 13, 14, 15]),
    ("v5litepod-4", "1,1,1", "2,2,1", 0, None, "v5e:2x2", "2,2,1", [0, 1, 2, 3]),
    ("v5litepod-8", "1,1,1", "4,2,1", 0, None, "v5e:4x2", "4,2,1", list(range(8))),
    ("v6e-8", "1,1,1", "2,4,1", 0, None, "v6e:2x4", "2,4,1", list(range(8))),
    ("v6e-16", "2,2,1", "2,2,1", 3, "a,b,c,d", "v6e:4x4", "4,4,1", [12, 13, 14, 15]),
])
def test_slices_of_every_generation(accelerator, host_bounds, chips, worker, hosts, slice_, bounds, task_ids):
    plan = tpu_env.host_plan(read_slice_facts(_gke(accelerator, host_bounds, chips, worker, hosts)), len(task_ids))
    assert str(plan.slice) == slice_
    assert [r.as_dict()["CLOUD_TPU_TASK_ID"] for r in plan.ranks] == [str(t) for t in task_ids]
    assert {r.as_dict()["TPU_PROCESS_BOUNDS"] for r in plan.ranks} == {bounds}
    one_host = hosts is None
    first = plan.ranks[0].as_dict()["TPU_PROCESS_ADDRESSES"].split(",")[0]
    assert first == ("localhost:8476" if one_host else "a:8476")


def test_one_process_takes_chip_0_alone_and_the_base_port_moves():
    plan = tpu_env.host_plan(read_slice_facts(_gke("v5litepod-8", "1,1,1", "4,2,1")), 1, port=9000)
    assert plan.to_json() == {"slice": "v5e:1x1", "ranks": [{"local_rank": 0, "env": {
        "TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1",
        "CLOUD_TPU_TASK_ID": "0", "TPU_PROCESS_PORT": "9000", "TPU_PROCESS_ADDRESSES": "localhost:9000",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}}]}


def test_user_variables_win():
    env = _gke("v5litepod-4", "1,1,1", "2,2,1")
    plan = tpu_env.host_plan(read_slice_facts(env), 4, environ={"TPU_PROCESS_PORT": "7000"})
    assert [r.as_dict()["TPU_PROCESS_PORT"] for r in plan.ranks] == ["7000"] * 4
    assert plan.ranks[0].user_set == ("TPU_PROCESS_PORT",)
    environ = {**env, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TPU_VISIBLE_CHIPS": "3",
               tpu_env.BASE_PORT_ENV: "9100"}
    tpu_env.configure_process(1, 4, environ)
    assert environ["TPU_VISIBLE_CHIPS"] == "3" and environ["TPU_PROCESS_PORT"] == "9101"
    assert environ["CLOUD_TPU_TASK_ID"] == "1"


@pytest.mark.parametrize("env, nproc, rule", [
    (_gke("v5litepod-4", "1,1,1", "2,2,1"), 8, "nproc_per_node=8 processes on a host of v5litepod-4 that has "
                                             "chips_per_host=4 chips"),
    (_gke("v5litepod-16", "2,2,1", "2,2,1", 0, "a,b,c,d"), 2, "launch --nproc-per-node 4 on every worker"),
    (_gke("v5litepod-8", "2,2,1", "2,2,1", 0, "a,b,c,d"), 4, "names 8 chips but host_bounds=2,2,1"),
    (_gke("v4-16", "1,1,2", "2,2,1", 0, "a"), 4, "num_hosts=2 .* but 1 worker addresses"),
    (_gke("v4-16", "1,1,2", "2,2,1", 2, "a,b"), 4, "worker_id=2 is not a worker"),
    (_gke("v4-16", "1,1,2", "2,2,1"), 4, "TPU_WORKER_ID .* must be set"),
    (_gke("v4-8", "1,1", "2,2,1"), 4, r"TPU_HOST_BOUNDS='1,1' .* is not bounds"),
    ({"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v4-8"}, 4,
     "TPU_HOST_BOUNDS, TPU_CHIPS_PER_HOST_BOUNDS are not set"),
])
def test_bad_inputs_name_the_rule_and_values(env, nproc, rule):
    with pytest.raises(TpuEnvError, match=rule):
        tpu_env.host_plan(read_slice_facts(env), nproc)


def _process(rank, world, local_rank, local_world, **extra):
    return {**_gke("v5litepod-16", "2,2,1", "2,2,1", 1, "a,b,c,d"), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), **extra}


def test_configure_process_sets_the_ranks_variables():
    environ = _process(6, 16, 2, 4)
    assert str(tpu_env.configure_process(6, 16, environ)) == "v5e:4x4"
    assert (environ["TPU_VISIBLE_CHIPS"], environ["CLOUD_TPU_TASK_ID"], environ["TPU_PROCESS_PORT"]) == ("2", "6", "8478")


@pytest.mark.parametrize("rank, world, local_rank, local_world, extra, rule", [
    (2, 16, 2, 4, {}, "rank=2 .* worker_id=1, whose chips are ranks 4..7.*--node-rank 1"),
    (6, 8, 2, 4, {}, "world_size=8 but the slice v5e:4x4 .* has 16 chips"),
    (6, 16, 2, 4, {"TPUDIST_TOPOLOGY": "v5p:2x2x4"}, "TPUDIST_TOPOLOGY=v5p:2x2x4 but this TPU slice is v5e:4x4"),
    (6, 16, 2, 4, {"TPUDIST_TPU_BASE_PORT": "x"}, "TPUDIST_TPU_BASE_PORT='x' is not a port"),
])
def test_configure_process_refuses_a_launch_that_does_not_fit(rank, world, local_rank, local_world, extra, rule):
    environ = _process(rank, world, local_rank, local_world, **extra)
    with pytest.raises(ValueError, match=rule):
        tpu_env.configure_process(rank, world, environ)
    assert "TPU_VISIBLE_CHIPS" not in environ  # nothing set when the launch is refused


def test_configure_process_needs_torchruns_local_rank():
    environ = _gke("v5litepod-16", "2,2,1", "2,2,1", 1, "a,b,c,d")
    with pytest.raises(TpuEnvError, match="LOCAL_WORLD_SIZE=None.*torchrun"):
        tpu_env.configure_process(4, 16, environ)


def test_one_process_world_reads_no_facts():
    environ = {"GCE_METADATA_HOST": "127.0.0.1:9"}  # nothing listens there: a read would fail
    assert tpu_env.configure_process(0, 1, environ) is None
    assert environ["TPU_VISIBLE_CHIPS"] == "0" and environ["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert str(tpu_env.topology_of_chip("TPU v5 lite")) == "v5e:1x1"
    assert str(tpu_env.topology_of_chip("TPU v4")) == "v4:1x1x1"


# -- the metadata server ----------------------------------------------------------------------------
V4_256_TPU_ENV = ("ACCELERATOR_TYPE: 'v4-256'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\nHOST_BOUNDS: '2,2,8'\n"
                  "TOPOLOGY: '4x4x8'\nTPU_CHIPS_PER_PROCESS_BOUNDS: '2,2,1'\nTPU_PROCESS_BOUNDS: '2,2,8'\n"
                  "TYPE: 'V4'\nWORKER_ID: '5'\nZONE: 'us-central2-b'\n")


@pytest.fixture
def metadata_server():
    """A fake TPU VM metadata server on 127.0.0.1 (a free port); answers only with Metadata-Flavor: Google."""
    values: dict[str, str] = {}
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            key = self.path.rpartition("/")[2]
            ok = self.headers.get("Metadata-Flavor") == "Google" and key in values and self.path.startswith(
                "/computeMetadata/v1/instance/attributes/")
            body = values[key].encode() if ok else b"not found"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"GCE_METADATA_HOST": f"127.0.0.1:{server.server_address[1]}"}, values, seen
    server.shutdown()
    server.server_close()


def test_metadata_of_a_v4_pod_worker(metadata_server):
    environ, values, seen = metadata_server
    values["tpu-env"] = V4_256_TPU_ENV
    values["worker-network-endpoints"] = ",".join(f"w{i}:uid{i}:10.0.0.{i}" for i in range(32))
    facts = read_slice_facts(environ)
    assert (facts.worker_id, facts.host_bounds, facts.chips_per_host_bounds) == (5, (2, 2, 8), (2, 2, 1))
    plan = tpu_env.host_plan(facts, 4)
    assert str(plan.slice) == "v4:4x4x8"  # the metadata's own TOPOLOGY: '4x4x8'
    env = plan.ranks[3].as_dict()
    assert (env["CLOUD_TPU_TASK_ID"], env["TPU_PROCESS_BOUNDS"]) == ("23", "4,4,8")
    assert env["TPU_PROCESS_ADDRESSES"].split(",")[:5] == [
        "10.0.0.0:8476", "10.0.0.0:8477", "10.0.0.0:8478", "10.0.0.0:8479", "10.0.0.1:8476"]
    assert seen == ["/computeMetadata/v1/instance/attributes/tpu-env",
                    "/computeMetadata/v1/instance/attributes/worker-network-endpoints"]


def test_metadata_of_one_host_asks_no_endpoints(metadata_server, capsys, monkeypatch):
    environ, values, seen = metadata_server
    values["tpu-env"] = "ACCELERATOR_TYPE: 'v6e-8'\nCHIPS_PER_HOST_BOUNDS: '2,4,1'\nHOST_BOUNDS: '1,1,1'\nWORKER_ID: '0'\n"
    monkeypatch.setenv("GCE_METADATA_HOST", environ["GCE_METADATA_HOST"])
    # `import jax` on a machine without TPU chips sets TPU_SKIP_MDS_QUERY=1 (jax/_src/cloud_tpu_init.py): a
    # TPU VM's process has it unset, and reads the metadata server
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)
    assert main(["tpu-env", "--nproc-per-node", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["slice"] == "v6e:2x4" and [r["local_rank"] for r in printed["ranks"]] == list(range(8))
    assert printed["ranks"][7]["env"]["TPU_PROCESS_ADDRESSES"] == ",".join(f"localhost:{8476 + i}" for i in range(8))
    assert set(printed["ranks"][0]["env"]) == set(tpu_env.ENV_NAMES)
    assert len(seen) == 1


def test_metadata_without_tpu_env_is_an_error(metadata_server):
    environ, values, _ = metadata_server
    with pytest.raises(TpuEnvError, match="could not read the TPU VM's metadata key 'tpu-env'.*answered HTTP 404"):
        read_slice_facts(environ)
    values["tpu-env"] = "ZONE: 'x'\n"
    with pytest.raises(TpuEnvError, match="has no ACCELERATOR_TYPE"):
        read_slice_facts(environ)


def test_a_silent_metadata_server_fails_within_its_timeout():
    with socket.socket() as listener:  # accepts connections (the backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        environ = {"GCE_METADATA_IP": f"127.0.0.1:{listener.getsockname()[1]}"}
        start = time.monotonic()
        with pytest.raises(TpuEnvError, match="no answer within 0.3 s: timed out.*TPU_SKIP_MDS_QUERY=1"):
            read_slice_facts(environ, timeout_s=0.3)
        assert time.monotonic() - start < 3


def test_cli_errors_exit_non_zero(monkeypatch, capsys):
    for name, value in _gke("v5litepod-4", "1,1,1", "2,2,1").items():
        monkeypatch.setenv(name, value)
    assert main(["tpu-env", "--nproc-per-node", "5"]) == 2
    assert "nproc_per_node=5 processes on a host of v5litepod-4" in capsys.readouterr().err
    assert main(["tpu-env", "--nproc-per-node", "4", "--base-port", "9000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("slice v5e:2x2: 4 chips, 1 host(s); 4 process(es) on this host")
    assert "TPU_PROCESS_PORT=9003" in out


# -- the chips JAX reports ---------------------------------------------------------------------------
class FakeChip:
    def __init__(self, coords):
        self.coords = coords


def test_chip_coordinates_match_the_torus_model():
    # v5e:2x2, one host: ranks x fastest; v4:2x2x2: host 1 (ranks 4..7) is the z=1 layer.
    tpu_env.check_chip_coords(Topology.parse("v5e:2x2"), [FakeChip(c) for c in
                                                          [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]])
    cube = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    tpu_env.check_chip_coords(Topology.parse("v4:2x2x2"), [FakeChip(c) for c in cube])
    swapped = cube[4:] + cube[:4]  # the hosts' ranks the wrong way round (--node-rank != worker id)
    with pytest.raises(TpuEnvError, match=r"rank 0 on coords=\(0, 0, 1\), model \(0, 0, 0\).*and 4 more.*--node-rank"):
        tpu_env.check_chip_coords(Topology.parse("v4:2x2x2"), [FakeChip(c) for c in swapped])
