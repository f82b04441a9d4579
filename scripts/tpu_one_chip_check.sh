#!/usr/bin/env bash
# On a single-chip TPU VM (no metadata server needed): tpudist's TPU start-up path still boots the chip.
#
#   bash scripts/tpu_one_chip_check.sh        # from the repository root; log in $OUT (or /tmp)
#
# 1. `python -m tpudist tpu-env --nproc-per-node 1 --json` from GKE-style facts of a v5litepod-1;
# 2. the "tpu" device's start (tpudist.device -> tpudist.mesh.tpu_env.configure_process) sets libtpu's
#    variables before JAX's TPU backend starts, and they equal what tpu-env printed;
# 3. JAX then sees exactly one chip, and its coords are where the torus model (v5e:1x1) puts rank 0.
# No process group: jax.distributed needs a socket, which that machine does not allow.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=scripts/chip_env.sh
source scripts/chip_env.sh || exit 1
export TPU_SKIP_MDS_QUERY=1 TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_HOST_BOUNDS=1,1,1 TPU_CHIPS_PER_HOST_BOUNDS=1,1,1 \
    TPU_WORKER_ID=0
log="${OUT:-/tmp}/tpu_one_chip_check.log"
timeout 120 python3 -m tpudist tpu-env --nproc-per-node 1 --json > "${OUT:-/tmp}/tpu_env.json" || exit 1
timeout 300 python3 - "${OUT:-/tmp}/tpu_env.json" <<'PY' 2>&1 | tee "$log"
import json, os, sys
plan = json.load(open(sys.argv[1]))
expected = plan["ranks"][0]["env"]
assert not any(name in os.environ for name in expected), "libtpu's variables were set before the start"
import torch
import tpudist.device  # noqa: F401  the "tpu" device
x = torch.ones(4, device="tpu") * 2  # starts JAX's TPU backend through tpudist.device._runtime.device()
got = {name: os.environ.get(name) for name in expected}
assert got == expected, (got, expected)
import jax
from tpudist.mesh import Topology, tpu_env
devices = jax.devices()
assert len(devices) == 1 and devices[0].platform == "tpu", devices
topology = tpu_env.topology_of_chip(devices[0].device_kind)
assert str(topology) == plan["slice"], (topology, plan["slice"])
tpu_env.check_chip_coords(topology, devices)
assert x.cpu().tolist() == [2.0] * 4
print(f"ok: {devices[0].device_kind} coords={devices[0].coords} slice={topology} env={got}")
PY
