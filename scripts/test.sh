#!/usr/bin/env bash
# Set up .venv if needed, then run the tests with pytest.
#
#   scripts/test.sh [--all] [pytest arguments...]
#
# With no tier flag: the contributor tiers, `-m "not slow"` (about 15 min on 2 cores): tests/unit, tests/deploy,
# tests/nixl (conformance on the host backend, mixed Neuron <-> host pairs, the Neuron layouts, the benchmarks'
# CPU runs), the short chaos runs, and the quick part of tests/vllm (the compat checks and one real vLLM P + D
# pair behind the router).  `--all` (anywhere among the arguments) runs everything, as CI (.ci/run) does: also
# the `slow` tests, which tests/conftest.py marks (the long vLLM end-to-end, drop-in, xPyD, restart and chaos-vLLM
# modules, the libfabric tier, the conformance scenarios again on the simulated Neuron backend).
#
# Every other argument goes to pytest unchanged.  The rule: the default tier's `-m "not slow"` is added only when
# there is no --all, no -m of your own and no test path (an argument naming a file or folder that exists, with
# or without ::test); so `scripts/test.sh -m nixl` runs every nixl test and `scripts/test.sh tests/vllm/x.py`
# that whole file, while -k, -x, -q ... filter or change the default tier (`--all -k NAME` searches everything).
#
# KVPUSH_VENV / KVPUSH_VLLM pick another venv and vLLM release (see scripts/setup-venv.sh), e.g. the
# older vLLM leg: KVPUSH_VENV=.venv-vllm024 KVPUSH_VLLM=0.24.0 scripts/test.sh --all -m vllm
set -euo pipefail
cd "$(dirname "$0")/.."

all=0 selected=0 skip_value=0
args=()
for a in "$@"; do
  if [ "$skip_value" = 1 ]; then  # the value of the option before (-k EXPR, --timeout 300, ...)
    skip_value=0
    args+=("$a")
    continue
  fi
  case $a in
    --all) all=1; continue ;;
    -m) selected=1; skip_value=1 ;;
    -m?*) selected=1 ;;
    -k|-p|-c|-o|-W|-r|--durations|--durations-min|--timeout|--timeout-method|--tb|--maxfail|--basetemp|--rootdir \
      |--junitxml|--junit-xml|--junit-prefix|--confcutdir|--deselect|--ignore|--ignore-glob|--override-ini \
      |--pythonwarnings|--capture|--color|--import-mode|--log-level|--log-file|--log-file-level|--log-cli-level \
      |--log-format|--hypothesis-profile|--hypothesis-seed|--hypothesis-verbosity) skip_value=1 ;;
    -*) ;;
    *) if [ -e "${a%%::*}" ]; then selected=1; fi ;;
  esac
  args+=("$a")
done

bash scripts/setup-venv.sh
if [ "$all" = 0 ] && [ "$selected" = 0 ]; then
  echo "[test] default tier: -m 'not slow' (scripts/test.sh --all runs every test)" >&2
  args=(-m "not slow" "${args[@]}")
fi
exec "${KVPUSH_VENV:-.venv}/bin/python" -m pytest "${args[@]}"
