#!/usr/bin/env bash
# Issue 6 in one device command: heterogeneous-TP push on a 4-GPU H200 machine, one GPU per rank.
#   1. the backend conformance scenarios on CUDA (every byte verified; P TP=2 -> D TP=2, 2 -> 1, 1 -> 2
#      among them, each rank on its own GPU: tests/nixl/test_conformance.py gpu_for_rank);
#   2. the timeline benchmark at its most loaded 16k-token point for each of the three shapes,
#      push and kvpush's pull side by side (vLLM-style pull runs one rank per engine only).
# Results go to $OUT (default ./four-gpu-out); ~6 minutes.  Run from the repository root with the
# wheels carried (.whl, see gpu_env.sh):   bash scripts/bench/gpu/four_gpu.sh
set -uo pipefail
OUT=${OUT:-four-gpu-out}
mkdir -p "$OUT"
source scripts/bench/gpu/gpu_env.sh
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/nixl/test_conformance.py tests/unit/test_cuda_layouts.py \
    > "$OUT/conformance.txt" 2>&1
echo "conformance: $(tail -1 "$OUT/conformance.txt")"
for shape in 2x2 2x1 1x2; do
    p=${shape%x*} d=${shape#*x}
    python3 -m scripts.bench.handoff.engine_loop --modes push,kvpush-pull --p-tp "$p" --d-tp "$d" --block-sizes 16 \
        --lengths 16384 --rates 8 --point-seconds 2.5 --min-requests 8 --out "$OUT/tp-$shape.json" \
        > "$OUT/tp-$shape.log" 2>&1
    echo "P TP=$p -> D TP=$d: exit $? $(grep -E '^(push|kvpush-pull) ' "$OUT/tp-$shape.log" | tr -s ' ' | tr '\n' '|')"
done
