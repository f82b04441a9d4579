#!/usr/bin/env bash
# The suite's device, ops, kernels and compile tests on a TPU chip, in one process.
#
#   bash scripts/chip_suite.sh [pytest paths and options]     # on a TPU VM, from the repository root
#
# A chip takes one process at a time (a second one cannot open it) and the `device` tool's machine
# allows no TCP socket, so: no `pytest -n`; RankPool pools of one rank without a process group run
# their functions in this process (TPUDIST_POOL_START=inprocess) and every test that needs several rank
# processes is skipped with that reason. Tests that need a chip run here and skip elsewhere.
# CHIP_SUITE_SHARD=i/n runs the i-th of n contiguous slices of the collected tests (tests/conftest.py's
# TPUDIST_TEST_SHARD), so the suite can be covered a slice per command, each slice recorded by its name;
# i-j/n runs the i-th to the j-th in one pytest session (their programs compiled once for all of them).
# CHIP_SUITE_SECONDS (default 480) bounds this script's wall time, installing included: pytest's session
# ends between two tests 30 s before it, and a test still running at the bound is interrupted (SIGINT),
# so the summary, failures included, is printed inside a command's time limit either way.
# The log goes to $OUT/chip_suite.log ($OUT: the folder the device tool brings back; /tmp elsewhere).
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=scripts/chip_env.sh
source scripts/chip_env.sh --transformers || exit 1
export TPUDIST_POOL_START=inprocess
# tests/conftest.py: this process holds the chip; the Python processes tests start run JAX on the CPU
export TPUDIST_CHIP_SUITE=1
[ -n "${CHIP_SUITE_SHARD:-}" ] && export TPUDIST_TEST_SHARD="$CHIP_SUITE_SHARD"
python3 -c "import jax; d = jax.devices()[0]; assert d.platform == 'tpu', d; print('chip:', d.device_kind)" || exit 1
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests/device tests/kernels tests/compile tests/ops)
# the bound counts from this script's start: installing (chip_env) comes out of it
seconds=$(( ${CHIP_SUITE_SECONDS:-480} - ($(date +%s) - started) ))
limit=(--session-timeout "$(( seconds > 60 ? seconds - 30 : seconds ))")
python3 -m pytest --help 2>/dev/null | grep -q -- --session-timeout || limit=()  # pytest-timeout < 2.3
timeout -s INT -k 20 "$seconds" python3 -m pytest -p no:xdist -p no:cacheprovider -o addopts="" -v -rfE \
    --tb=short --durations=20 --timeout 300 "${limit[@]}" "${args[@]}" 2>&1 | tee "${OUT:-/tmp}/chip_suite.log"
