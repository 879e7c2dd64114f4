#!/usr/bin/env bash
# Set up .venv if needed, then run the local push demo (producer + consumer processes over real NIXL).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/python scripts/core_demo.py "$@"
