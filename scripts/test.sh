#!/usr/bin/env bash
# Installs the CPU test stack (.venv, idempotent) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-cpu-venv.sh
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1800 --durations=40 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    exit 1
fi
exit "$status"
