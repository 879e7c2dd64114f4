#!/usr/bin/env bash
# Long chaos and fuzzing runs (CI runs a short seeded version: pytest -m chaos).
#
#   scripts/chaos/chaos.sh                 # everything: fuzz, core chaos over many seeds, vLLM load under faults
#   scripts/chaos/chaos.sh fuzz|core|load  # one part
#
# Knobs (environment): FUZZ_RUNS (inputs per fuzz target, default 100000), SEEDS (core chaos seeds,
# default 1..10), LOAD_S (load test seconds, default 240), OUT (results folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
OUT=${OUT:-runs/chaos/$(date -u +%Y%m%dT%H%M%SZ)}
FUZZ_RUNS=${FUZZ_RUNS:-100000}
SEEDS=${SEEDS:-1,2,3,4,5,6,7,8,9,10}
LOAD_S=${LOAD_S:-240}
PARTS=${1:-all}
mkdir -p "$OUT"
rc=0

if [[ $PARTS == all || $PARTS == fuzz ]]; then
  if $PY -c "import atheris" 2>/dev/null; then
    for target in wire handshake router registrations; do
      echo "== atheris $target: $FUZZ_RUNS inputs"
      $PY tests/chaos/fuzz_atheris.py "$target" -runs="$FUZZ_RUNS" -rss_limit_mb=2048 -timeout=10 \
          -print_final_stats=1 >"$OUT/fuzz-$target.log" 2>&1
      r=$?; tail -n 12 "$OUT/fuzz-$target.log" | grep -E "Done|stat::number_of_executed_units|peak_rss|ERROR" || true
      [[ $r -eq 0 ]] || { echo "atheris $target FAILED (rc $r): $OUT/fuzz-$target.log"; rc=1; }
    done
  else
    echo "== atheris not installed: hypothesis with $FUZZ_RUNS examples per target instead"
    KVPUSH_FUZZ_EXAMPLES=$FUZZ_RUNS $PY -m pytest -q -p no:cacheprovider tests/chaos/test_chaos_fuzz.py \
        -k fuzz_ --timeout 0 >"$OUT/fuzz-hypothesis.log" 2>&1 || rc=1
    tail -n 3 "$OUT/fuzz-hypothesis.log"
  fi
fi

if [[ $PARTS == all || $PARTS == core ]]; then
  echo "== core chaos, seeds $SEEDS"
  KVPUSH_CHAOS_SEEDS=$SEEDS KVPUSH_CHAOS_ROWS="$OUT/core-rows.jsonl" \
    $PY -m pytest -q -p no:cacheprovider tests/chaos/test_chaos_core.py --timeout 0 >"$OUT/core.log" 2>&1 || rc=1
  tail -n 3 "$OUT/core.log"
fi

if [[ $PARTS == all || $PARTS == load ]]; then
  echo "== vLLM pair under faults, ${LOAD_S}s"
  $PY scripts/chaos/chaos_load.py --duration "$LOAD_S" --out "$OUT/load.json" >"$OUT/load.log" 2>&1 || rc=1
  tail -n 40 "$OUT/load.log"
fi
echo "results in $OUT (rc $rc)"
exit $rc
