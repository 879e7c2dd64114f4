#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite; arguments go to pytest (e.g. scripts/test.sh -m nixl).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/python -m pytest "$@"
