#!/usr/bin/env bash
# Source on the GPU machine (no package registry there): installs the wheels carried in .whl
# (fetch them here first with scripts/bench/gpu/fetch_wheels.sh: NIXL, msgspec, pyzmq,
# prometheus_client and the pytest plugins for Python 3.12) into /tmp/site, and puts the kvpush
# packages on PYTHONPATH under their import names.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING
mkdir -p /tmp/pkgs
ln -sfn "$PWD/common" /tmp/pkgs/kvpush_common
ln -sfn "$PWD/kvpush_cuda" /tmp/pkgs/kvpush_cuda
ln -sfn "$PWD/kvpush_neuron" /tmp/pkgs/kvpush_neuron
export PYTHONPATH=/tmp/site:/tmp/pkgs${PYTHONPATH:+:$PYTHONPATH}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
