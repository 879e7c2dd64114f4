#!/usr/bin/env bash
# Set up .venv if needed, then run the local demo: prefill + decode vLLM servers with kvpush and the
# router, answers checked against a single instance token for token.  (scripts/demo/core_demo.py runs the
# protocol core alone, without vLLM.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/python scripts/demo/demo.py "$@"
