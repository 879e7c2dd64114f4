#!/usr/bin/env bash
# Build a carryable CUDA vLLM 0.26.0 for the H200 GPU machine (Python 3.12, torch 2.11.0+cu130 preinstalled,
# no package registry there).  vllm 0.26.0 is the newest PyPI release that pins torch==2.11.0; its PyPI wheel
# is already a CUDA 13 build with the Hopper FlashAttention-3 kernel.
#
# Run here, in your checkout's root:   bash scripts/bench/gpu/vllm_cuda_bundle.sh        (~3-5 min, ~1 GB temp)
# It writes .carry-vllm/part.00 .. part.02 (42 MB each, ~125 MB in all) plus unpack.sh, and keeps
# .carry-vllm out of git.  A device call carries at most 64 MiB, so send the parts in quick successive calls
# while the machine stays warm (it is given back ~30 s after a call ends):
#   run(command="mkdir -p /tmp/c && cp .carry-vllm/part.00 /tmp/c/", carry=[".carry-vllm/part.00"])
#   run(command="cp .carry-vllm/part.01 /tmp/c/", carry=[".carry-vllm/part.01"])
#   run(command="cp .carry-vllm/part.02 /tmp/c/", carry=[".carry-vllm/part.02"])
#   run(command="bash .carry-vllm/unpack.sh && <your run>", carry=[".carry-vllm/unpack.sh", ".whl", ...])
# unpack.sh joins the parts, checks the sha256, extracts into /tmp/site and prints the environment to export.
# Start vLLM with `python3 -m vllm.entrypoints.openai.api_server ...` (bin/ scripts point at another Python).
# Needed at run time: VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is not carried).  Start one vLLM instance at a
# time (wait for /health): each measures free GPU memory at start-up.  Servers started with setsid outlive the
# call, but the call's working tree does not: start them from /tmp, with the packages they import copied there.
# Left out to fit: the FlashAttention-2 kernel (ALiBi / fallback only), the vllm-rs binary, deep_gemm builds for
# other Pythons, flashinfer, cutlass-dsl, tilelang and the other optional kernel packages (FP8/MLA/MoE extras).
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.carry-vllm/' .git/info/exclude 2>/dev/null || echo '/.carry-vllm/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PINS="vllm==0.26.0 annotated-types==0.8.0 apache-tvm-ffi==0.1.10 cachetools==8.0.2 cbor2==6.3.0 distro==1.9.0
fastapi==0.136.3 jiter==0.19.0 jmespath==1.1.0 llguidance==1.7.6 model-hosting-container-standards==0.1.16
msgspec==0.23.0 openai-harmony==0.0.8 openai==2.54.0 partial-json-parser==0.2.1.1.post7
prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0
setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5 typing_extensions==4.16.0
uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.7"
echo "[bundle] downloading $(echo $PINS | wc -w) wheels for cp312 / manylinux x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$work/wheels" $PINS
echo "[bundle] installing into a staging folder (no deps: the GPU machine has torch, numpy, transformers, ...)"
python3 -m pip install -q --no-deps --no-compile --no-index --target "$work/site" --python-version 3.12 \
  --implementation cp --only-binary=:all: --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$work"/wheels/*.whl
rm -rf "$work/site/bin" "$work/site/vllm/vllm-rs" "$work/site"/vllm/vllm_flash_attn/_vllm_fa2_C*.so
find "$work/site/vllm/third_party/deep_gemm" -name '_C.cpython-3*-x86_64-linux-gnu.so' ! -name '*cpython-312*' -delete
echo "[bundle] compressing"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$work/bundle.tar.xz"
rm -rf .carry-vllm && mkdir -p .carry-vllm
split -b 42m -d "$work/bundle.tar.xz" .carry-vllm/part.
sum=$(sha256sum "$work/bundle.tar.xz" | cut -c1-64)
cat > .carry-vllm/unpack.sh <<EOF
#!/usr/bin/env bash
# On the GPU machine: join the parts carried into /tmp/c, check, extract into /tmp/site (once per machine).
set -e
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/c/part.* > /tmp/vllm-bundle.tar.xz
  echo "$sum  /tmp/vllm-bundle.tar.xz" | sha256sum -c --quiet
  mkdir -p /tmp/site && tar -xJf /tmp/vllm-bundle.tar.xz -C /tmp/site
fi
echo 'export PYTHONPATH=/tmp/site\${PYTHONPATH:+:\$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1'
EOF
chmod +x .carry-vllm/unpack.sh
ls -la .carry-vllm
echo "[bundle] sha256 $sum"
