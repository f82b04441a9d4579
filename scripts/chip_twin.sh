#!/usr/bin/env bash
# The speed anchor on a TPU chip: the JAX twins (splash, tpudist's flash kernel, XLA attention) against
# the compiled and Fused torch modes of the same model, in one command sized for a device-tool call
# (about 8 minutes, installing included).
#
#   bash scripts/chip_twin.sh        # on a TPU VM, from the repository root
#
# tpu_step.py runs the modes in this order and its deadline drops the last ones first; --add-to keeps
# the earlier run's rows it does not measure (old twin, HF, per-layer, Strict). $OUT/tpu_step.json comes
# back: copy it to benchmarks/results/tpu_step.json and run `python benchmarks/report.py render` on the
# development machine to update benchmarks/RESULTS.md (the chip's machine has no matplotlib for the plots).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${OUT:-/tmp}"
# shellcheck source=scripts/chip_env.sh
source scripts/chip_env.sh --transformers || exit 1
python3 benchmarks/tpu_step.py --modes twin_flash,twin_splash,compiled,fused,twin_xla,compiled_shaped,fused_shaped \
    --steps 5 --unsynced-steps 5 --profile-steps 1 --deadline-s 380 \
    --add-to benchmarks/results/tpu_step.json --json "$out/tpu_step.json" || exit 1
echo "chip_twin: copy $out/tpu_step.json to benchmarks/results/tpu_step.json, then python benchmarks/report.py render"
