# Source this on the device machine (the TPU v5e the `device` tool lends) to install what tpudist
# needs there and put it on PYTHONPATH:   source scripts/chip_env.sh [--transformers]
#
# That machine has JAX with libtpu and pytest but no torch and no internet: torch 2.13.0 (CPU build)
# comes from its local wheel folder, the rest from its own package index, each into a folder under
# /tmp that is *appended* to PYTHONPATH, so the machine's JAX stays first. About a minute.
_chip_pip() {
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-warn-conflicts \
        --index-url file:///opt/pypi/simple --find-links /opt/wheels "$@"
}
_chip_t0=$(date +%s)
[ -d /tmp/site/torch ] || _chip_pip --target /tmp/site torch==2.13.0 || return 1
# tpudist's own needs beyond JAX and torch (flatbuffers: jax.export's serialisation of fused programs)
# and the test tools the suite imports; a package the index lacks is reported, not fatal.
for _p in flatbuffers pytest-timeout; do
    _chip_pip --no-deps --target /tmp/site2 "$_p" >/dev/null 2>&1 || echo "chip_env: $_p not in the index" >&2
done
# Wheels the index lacks (expecttest, which torch's OpInfo tests import) travel in .whl-tpu (carry it):
# fetched on the development machine, see docs/testing.md.
if ls .whl-tpu/*.whl >/dev/null 2>&1; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
        --target /tmp/site2 .whl-tpu/*.whl || echo "chip_env: .whl-tpu did not install" >&2
fi
if [ "${1:-}" = "--transformers" ] && [ ! -d /tmp/site4/transformers ]; then
    _chip_pip --target /tmp/site4 transformers || echo "chip_env: transformers did not install" >&2
fi
rm -rf /tmp/site3
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --index-url file:///opt/pypi/simple \
    --target /tmp/site3 . >/dev/null || return 1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site3:/tmp/site:/tmp/site2:/tmp/site4"
export PYTHONUNBUFFERED=1
echo "chip_env: ready in $(( $(date +%s) - _chip_t0 )) s"
