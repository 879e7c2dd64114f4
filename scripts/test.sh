#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite; arguments go to pytest (e.g. scripts/test.sh -m nixl).
# KVPUSH_VENV / KVPUSH_VLLM pick another venv and vLLM release (see scripts/setup-venv.sh), e.g. the
# older vLLM leg: KVPUSH_VENV=.venv-vllm024 KVPUSH_VLLM=0.24.0 scripts/test.sh -m vllm
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec "${KVPUSH_VENV:-.venv}/bin/python" -m pytest "$@"
