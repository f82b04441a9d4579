#!/usr/bin/env bash
# The suite's device, ops, kernels and compile tests on a TPU chip, in one process.
#
#   bash scripts/chip_suite.sh [pytest paths and options]     # on a TPU VM, from the repository root
#
# A chip takes one process at a time (a second one cannot open it) and the `device` tool's machine
# allows no TCP socket, so: no `pytest -n`; RankPool pools of one rank without a process group run
# their functions in this process (TPUDIST_POOL_START=inprocess) and every test that needs several rank
# processes is skipped with that reason. Tests that need a chip run here and skip elsewhere.
# CHIP_SUITE_SECONDS (default 480) ends the session between two tests, so the summary is printed
# inside a command's time limit; what was not reached is counted as such in the log's last line.
# The log goes to $OUT/chip_suite.log ($OUT: the folder the device tool brings back; /tmp elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=scripts/chip_env.sh
source scripts/chip_env.sh --transformers || exit 1
export TPUDIST_POOL_START=inprocess
python3 -c "import jax; d = jax.devices()[0]; assert d.platform == 'tpu', d; print('chip:', d.device_kind)" || exit 1
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests/device tests/kernels tests/compile tests/ops)
limit=(--session-timeout "${CHIP_SUITE_SECONDS:-480}")
python3 -m pytest --help 2>/dev/null | grep -q -- --session-timeout || limit=()  # pytest-timeout < 2.3
python3 -m pytest -p no:xdist -p no:cacheprovider -o addopts="" -q -rfE --durations=20 --timeout 300 \
    "${limit[@]}" "${args[@]}" 2>&1 | tee "${OUT:-/tmp}/chip_suite.log"
