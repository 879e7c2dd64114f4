#!/usr/bin/env bash
# kvpush on p5en.48xlarge (8 H200, 16 EFA): X prefill + Y decode servers (default 2P2D on one host; --topology two-host puts each role on its host).
# Starts the vLLM servers with the environment `kvpush config cuda ... --format shell` generates, the kvpush
# router (push), waits for /health, then sweeps `vllm bench serve` (random prompts 1k-16k x 1-8 QPS,
# 128 output tokens; decode without prefix caching) into <results>/bench/*.json.  Not yet run on hardware.
#   scripts/p5en/xpyd.sh --dry-run --num-prefill 2 --num-decode 2     # print every command, run nothing
#   scripts/p5en/xpyd.sh --install --num-prefill 2 --num-decode 2     # install first
# Options: --help.  Shared code: scripts/lib/deploy.sh.
KP_TARGET=cuda KP_SCENARIO=xpyd KP_TP=${KP_TP:-2} KP_TOPOLOGY=same-host KP_NP=2 KP_ND=2
source "$(dirname "$0")/../lib/deploy.sh"
kp_main "$@"
