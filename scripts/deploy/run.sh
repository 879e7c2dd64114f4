#!/usr/bin/env bash
# kvpush on trn2.48xlarge (--target neuron: 16 Trainium2 chips = 64 logical NeuronCores at LNC=2, 16 EFA) or
# p5en.48xlarge (--target cuda: 8 H200, 16 EFA), in one of three layouts:
#   1p1d-same-host  1 prefill + 1 decode on one host, devices split in halves
#   1p1d-two-host   1 prefill on one host, 1 decode on another (same subnet and placement group; ssh to the
#                   remote one): needs --prefill-host and --decode-host
#   xpyd            X prefill + Y decode servers (default 2P2D on one host; --topology two-host puts each role
#                   on its host)
# Starts the vLLM servers with the environment `kvpush config <target> ... --format shell` generates, the kvpush
# router (push), waits for /health, then sweeps `vllm bench serve` (random prompts 1k-16k x 1-8 QPS,
# 128 output tokens; decode without prefix caching) into <results>/bench/*.json.  Not yet run on hardware.
#   scripts/deploy/run.sh --target neuron --layout 1p1d-same-host --dry-run     # print every command, run nothing
#   scripts/deploy/run.sh --target cuda --layout 1p1d-two-host --install --prefill-host 10.0.0.1 --decode-host 10.0.0.2
#   scripts/deploy/run.sh --target neuron --layout xpyd --dry-run --num-prefill 2 --num-decode 2
# --install installs first (neuron: the neuron extra from the Neuron index).  Default TP per server: neuron 8;
# cuda 4 (1p1d) or 2 (xpyd).  Other options: --target T --layout L --help.  Shared code: scripts/deploy/lib/deploy.sh.
KP_TARGET= KP_SCENARIO=
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --target) KP_TARGET=${2:-}; shift ;;
    --layout) KP_SCENARIO=${2:-}; shift ;;
    --config-arg) args+=("$1"); [ $# -gt 1 ] && { args+=("$2"); shift; } ;;  # its value goes to kvpush config
    *) args+=("$1") ;;
  esac
  shift
done
run_usage() {
  echo "usage: $0 --target neuron|cuda --layout 1p1d-same-host|1p1d-two-host|xpyd [options]"
  echo "  (--target T --layout L --help lists the options and their defaults for that layout)"
}
if [ -z "$KP_TARGET" ] || [ -z "$KP_SCENARIO" ]; then
  case " ${args[*]-} " in
    *" --help "*|*" -h "*) run_usage; exit 0 ;;
  esac
  echo "$0: --target and --layout are required" >&2; run_usage >&2; exit 2
fi
case $KP_TARGET in
  neuron) tp=8 ;;
  cuda) tp=4; [ "$KP_SCENARIO" = xpyd ] && tp=2 ;;
  *) echo "$0: --target must be neuron or cuda" >&2; run_usage >&2; exit 2 ;;
esac
case $KP_SCENARIO in
  1p1d-same-host) KP_TOPOLOGY=same-host KP_NP=1 KP_ND=1 ;;
  1p1d-two-host) KP_TOPOLOGY=two-host KP_NP=1 KP_ND=1 ;;
  xpyd) KP_TOPOLOGY=same-host KP_NP=2 KP_ND=2 ;;
  *) echo "$0: --layout must be 1p1d-same-host, 1p1d-two-host or xpyd" >&2; run_usage >&2; exit 2 ;;
esac
KP_TP=${KP_TP:-$tp}
KP_USAGE="--target $KP_TARGET --layout $KP_SCENARIO"
source "$(dirname "$0")/lib/deploy.sh"
kp_main ${args[@]+"${args[@]}"}
