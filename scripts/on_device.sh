#!/usr/bin/env bash
# Run a command on an accelerator machine that has JAX but none of braintrace's other dependencies.
#
#   scripts/on_device.sh python -m benchmarks --models gru256
#   scripts/on_device.sh make test-device
#
# Installs the wheels of .device-wheels/ (made by `make device-wheels` on a machine with an index)
# into a private folder, without their dependencies and without touching the machine's own JAX,
# numpy or scipy, which stay first on the path; then runs the command in the repository root with
# this checkout's braintrace importable. Needs pip, no network.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device-wheels
SITE=${BRAINTRACE_DEVICE_SITE:-${TMPDIR:-/tmp}/braintrace-device-site}
if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "on_device.sh: no wheels in $WHEELS/; run 'make device-wheels' where PyPI is reachable, then carry $WHEELS" >&2
    exit 2
fi
if [ ! -f "$SITE/.installed" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated --quiet --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    touch "$SITE/.installed"
fi
# Appended: the machine's JAX (built for its accelerator) keeps precedence over any copy here.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$SITE"
export PYTHONUNBUFFERED=1
exec "$@"
