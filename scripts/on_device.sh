#!/usr/bin/env bash
# Run a command on an accelerator machine that has JAX but none of braintrace's other dependencies.
#
#   scripts/on_device.sh python -m benchmarks --models gru256
#   scripts/on_device.sh make test-device
#
# Installs from the wheels of .device-wheels/ (made by `make device-wheels` on a machine with an
# index) the distributions this machine lacks, each in the build for its Python, into a private
# folder, without their dependencies; what the machine has (its JAX, numpy, scipy and anything
# else) is left as it is and used. Then runs the command in the repository root with this
# checkout's braintrace importable. Needs pip, no network.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device-wheels
SITE=${BRAINTRACE_DEVICE_SITE:-${TMPDIR:-/tmp}/braintrace-device-site}
if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "on_device.sh: no wheels in $WHEELS/; run 'make device-wheels' where PyPI is reachable, then carry $WHEELS" >&2
    exit 2
fi
if [ ! -f "$SITE/.installed" ]; then
    # The distributions of the wheels (a wheel's name up to its first '-') not installed here.
    missing=$(python3 - "$WHEELS" <<'PYTHON'
import importlib.metadata
import pathlib
import sys

def installed(name):
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True

names = {wheel.name.split("-")[0] for wheel in pathlib.Path(sys.argv[1]).glob("*.whl")}
print(" ".join(sorted(name for name in names if not installed(name))))
PYTHON
)
    if [ -n "$missing" ]; then
        # shellcheck disable=SC2086  # one argument per distribution
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated --quiet --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --find-links "$WHEELS" --target "$SITE" $missing
    fi
    mkdir -p "$SITE"
    touch "$SITE/.installed"
fi
# Appended, and holding only what the machine lacks: nothing there shadows the machine's own packages.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$SITE"
export PYTHONUNBUFFERED=1
exec "$@"
