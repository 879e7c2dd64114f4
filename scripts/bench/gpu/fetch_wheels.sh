#!/usr/bin/env bash
# Here (registry access): download into ./.whl what the GPU machine (Python 3.12, torch preinstalled, no
# registry) needs beside torch to run kvpush's GPU tests and benchmarks: the pinned NIXL wheels (the `nixl`
# meta wheel goes in with --no-deps beside nixl-cu13) and the pure-Python or cp312 wheels of msgspec, pyzmq,
# prometheus_client and the pytest plugins.  `.whl` stays out of git.  On the GPU machine: gpu_env.sh.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
NIXL_VERSION=${NIXL_VERSION:-$(sed -n 's/^NIXL_VERSION = "\(.*\)"$/\1/p' common/transport/nixl.py)}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
  "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION" msgspec pyzmq prometheus_client pytest-timeout pytest-xdist \
  execnet hypothesis sortedcontainers
ls -la .whl
