# Source on the GPU machine after the parts of scripts/bench/gpu/gpu_vllm_carry.sh are in /tmp/g: unpacks CUDA
# vLLM 0.26.0 into /tmp/site (once per machine), installs NIXL there and the router's wheels into
# /tmp/site-extra (after the machine's own packages on sys.path), copies kvpush to /tmp/kvpush (servers
# started with setsid outlive the call's working tree), and exports the environment to run them.
set -e
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/g/part.* > /tmp/g/all.tar
  mkdir -p /tmp/g/x && tar -C /tmp/g/x -xf /tmp/g/all.tar
  mkdir -p /tmp/c && cp /tmp/g/x/vllm/part.* /tmp/c/
  bash /tmp/g/x/vllm/unpack.sh > /dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/g/x/nixl/*.whl 2>&1 | grep -v WARNING || true
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-extra /tmp/g/x/extra/*.whl 2>&1 | grep -v WARNING || true
fi
rm -rf /tmp/kvpush && mkdir -p /tmp/kvpush && cp -r common kvpush_cuda kvpush_neuron scripts /tmp/kvpush/
ln -sfn /tmp/kvpush/common /tmp/kvpush/kvpush_common
export PYTHONPATH=/tmp/site:/tmp/kvpush:$(python3 -c 'import sys; print(":".join(p for p in sys.path if p))'):/tmp/site-extra
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
set +e
