#!/usr/bin/env bash
# One process per chip on a multi-chip TPU VM (v5e-4/8, v6e-8, v4-8, v5p-8): tpu-env, the collectives,
# the FSDP recipe and the multi-process unit tests of the start-up path, in one call.
#
#   bash scripts/tpu_host_suite.sh [N]      # from the repository root; N processes (default 4)
#
# Never run yet: no multi-chip TPU has been lent to this project. Each step has a hard timeout and
# the log goes to $OUT/tpu_host_suite.log ($OUT: the folder the device tool brings back; /tmp elsewhere).
# On a TPU VM the metadata server gives the slice; elsewhere set TPU_SKIP_MDS_QUERY=1 and the
# TPU_ACCELERATOR_TYPE / TPU_HOST_BOUNDS / TPU_CHIPS_PER_HOST_BOUNDS variables first (docs/tpu-vm.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
n="${1:-4}"
log="${OUT:-/tmp}/tpu_host_suite.log"
: > "$log"
if [ -f scripts/chip_env.sh ] && ! python3 -c "import torch" 2>/dev/null; then
    # shellcheck source=scripts/chip_env.sh
    source scripts/chip_env.sh || exit 1
fi
export TPUDIST_PLATFORM=tpu OMP_NUM_THREADS=1
status=0
step() {  # step NAME SECONDS COMMAND...: runs one step with a hard timeout, logs it, records failure
    local name=$1 seconds=$2; shift 2
    echo "== $name: $*" | tee -a "$log"
    timeout -k 20 "$seconds" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}
step tpu-env 60 python3 -m tpudist tpu-env --nproc-per-node "$n"
step collectives 300 torchrun --standalone --nproc-per-node "$n" scripts/tpu_host_collectives.py
step recipe 600 torchrun --standalone --nproc-per-node "$n" recipes/train_fsdp.py --steps 5
step unit-tests 300 python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" \
    tests/mesh/test_tpu_env.py tests/process_group/test_tpu_start.py
echo "tpu_host_suite: $([ $status -eq 0 ] && echo ok || echo FAILED) (log $log)"
exit $status
