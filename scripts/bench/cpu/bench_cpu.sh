#!/usr/bin/env bash
# CPU benchmark: kvpush push vs vLLM NixlPushConnector vs NixlConnector on this machine (see bench_cpu.py).
set -euo pipefail
cd "$(dirname "$0")/../../.."
bash scripts/setup-venv.sh
exec .venv/bin/python -m scripts.bench.e2e --device cpu --workload single "$@"
