#!/usr/bin/env bash
# Set up .venv if needed, then run the local demo: prefill + decode vLLM servers (float32) with kvpush and the
# router, answers checked against the decode instance alone token for token; exit 1 on a mismatch, printing
# both texts.  --control gives the prefill instance other weights: then the demo must say MISMATCH.
# (scripts/demo/core_demo.py runs the protocol core alone, without vLLM.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/python scripts/demo/demo.py "$@"
