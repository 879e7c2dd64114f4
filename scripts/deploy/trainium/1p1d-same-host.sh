#!/usr/bin/env bash
# kvpush on trn2.48xlarge (16 Trainium2 chips = 64 logical NeuronCores at LNC=2, 16 EFA): 1 prefill + 1 decode on one trn2.48xlarge (16 Trainium2 chips = 64 logical NeuronCores at LNC=2, 16 EFA), devices split in halves.
# Starts the vLLM servers with the environment `kvpush config neuron ... --format shell` generates, the kvpush
# router (push), waits for /health, then sweeps `vllm bench serve` (random prompts 1k-16k x 1-8 QPS,
# 128 output tokens; decode without prefix caching) into <results>/bench/*.json.  Not yet run on hardware.
#   scripts/trainium/1p1d-same-host.sh --dry-run     # print every command, run nothing
#   scripts/trainium/1p1d-same-host.sh --install     # install first (neuron extra from the Neuron index)
# Options: --help.  Shared code: scripts/lib/deploy.sh.
KP_TARGET=neuron KP_SCENARIO=1p1d-same-host KP_TP=${KP_TP:-8} KP_TOPOLOGY=same-host KP_NP=1 KP_ND=1
source "$(dirname "$0")/../lib/deploy.sh"
kp_main "$@"
