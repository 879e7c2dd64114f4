#!/usr/bin/env bash
# kvpush on p5en.48xlarge (8 H200, 16 EFA): 1 prefill on one host, 1 decode on another (same subnet and placement group; ssh to the remote one).
# Starts the vLLM servers with the environment `kvpush config cuda ... --format shell` generates, the kvpush
# router (push), waits for /health, then sweeps `vllm bench serve` (random prompts 1k-16k x 1-8 QPS,
# 128 output tokens; decode without prefix caching) into <results>/bench/*.json.  Not yet run on hardware.
#   scripts/p5en/1p1d-two-host.sh --dry-run --prefill-host 10.0.0.1 --decode-host 10.0.0.2     # print every command, run nothing
#   scripts/p5en/1p1d-two-host.sh --install --prefill-host 10.0.0.1 --decode-host 10.0.0.2     # install first
# Options: --help.  Shared code: scripts/lib/deploy.sh.
KP_TARGET=cuda KP_SCENARIO=1p1d-two-host KP_TP=${KP_TP:-4} KP_TOPOLOGY=two-host KP_NP=1 KP_ND=1
source "$(dirname "$0")/../lib/deploy.sh"
kp_main "$@"
