#!/usr/bin/env bash
# Here (CPU machine, registry access): pack everything the real-vLLM GPU benchmark needs on the GPU machine
# (no registry there) into .carry-gpu/part.00 .. part.03, each small enough for one device call (64 MiB
# with the working tree): the CUDA vLLM 0.26.0 bundle (vllm_cuda_bundle.sh), the NIXL
# wheels (fetch_wheels.sh) and the router's pure-Python wheels (aiohttp, prometheus_client).
# Then, on the GPU machine, in quick successive calls (the machine is given back ~30 s after a call):
#   run(command="mkdir -p /tmp/g && cp .carry-gpu/part.00 /tmp/g/", carry=[".carry-gpu/part.00"])
#   run(command="cp .carry-gpu/part.01 /tmp/g/", carry=[".carry-gpu/part.01"])
#   run(command="cp .carry-gpu/part.02 /tmp/g/", carry=[".carry-gpu/part.02"])
#   run(command="cp .carry-gpu/part.03 /tmp/g/ && . scripts/bench/gpu/gpu_vllm_env.sh && cd /tmp/kvpush && python3 -m scripts.bench.e2e --device cuda --workload single ...",
#       carry=[".carry-gpu/part.03"])
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
for d in .carry-gpu .carry-vllm .whl; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
[ -f .carry-vllm/unpack.sh ] || bash scripts/bench/gpu/vllm_cuda_bundle.sh
ls .whl/nixl_cu13-*.whl >/dev/null 2>&1 || bash scripts/bench/gpu/fetch_wheels.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/pack/vllm" "$work/pack/nixl" "$work/pack/extra"
cp .carry-vllm/part.* .carry-vllm/unpack.sh "$work/pack/vllm/"
cp .whl/nixl*.whl "$work/pack/nixl/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$work/pack/extra" \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna prometheus_client
tar -C "$work/pack" -cf "$work/all.tar" .
rm -rf .carry-gpu && mkdir -p .carry-gpu
split -b 46m -d "$work/all.tar" .carry-gpu/part.  # 46 MiB: room for the working tree (~3 MB) and more
sha256sum "$work/all.tar" | cut -c1-64 > .carry-gpu/sha256
ls -la .carry-gpu
