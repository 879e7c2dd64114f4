#!/usr/bin/env bash
# kvpush on p5en.48xlarge (8 H200, 16 EFA): 1 prefill + 1 decode on one p5en.48xlarge (8 H200, 16 EFA), devices split in halves.
# Starts the vLLM servers with the environment `kvpush config cuda ... --format shell` generates, the kvpush
# router (push), waits for /health, then sweeps `vllm bench serve` (random prompts 1k-16k x 1-8 QPS,
# 128 output tokens; decode without prefix caching) into <results>/bench/*.json.  Not yet run on hardware.
#   scripts/p5en/1p1d-same-host.sh --dry-run     # print every command, run nothing
#   scripts/p5en/1p1d-same-host.sh --install     # install first
# Options: --help.  Shared code: scripts/lib/deploy.sh.
KP_TARGET=cuda KP_SCENARIO=1p1d-same-host KP_TP=${KP_TP:-4} KP_TOPOLOGY=same-host KP_NP=1 KP_ND=1
source "$(dirname "$0")/../lib/deploy.sh"
kp_main "$@"
