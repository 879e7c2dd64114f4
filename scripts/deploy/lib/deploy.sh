# Sourced by scripts/deploy/run.sh (not run by itself).  One driver, kp_main:
#   [install] -> plans from `kvpush config` -> `kvpush doctor` per server -> start P and D servers
#   -> wait for /health -> start the kvpush router -> wait -> `vllm bench serve` sweep -> stop all.
# run.sh sets KP_TARGET (neuron|cuda), KP_SCENARIO (the layout) and default options, then calls kp_main "$@".
# --dry-run prints every command (and each server's generated environment) and runs nothing: only
# the generator (`kvpush config`, pure) runs, and nothing is written.
set -euo pipefail

KP_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
# kvpush's own NIXL pin, installed for the CUDA target only: on Neuron the SDK's plugin brings its own
# (nixl==1.3.2), which kvpush uses as it is (installing another over it breaks the plugin's NixlConnector)
NIXL_VERSION=${NIXL_VERSION:-$(sed -n 's/^NIXL_VERSION = "\(.*\)"$/\1/p' "$KP_REPO/common/transport/nixl.py")}
PYTHON=${PYTHON:-python3}
VLLM=${VLLM:-vllm}
if [ -z "${KVPUSH:-}" ]; then
  KVPUSH=$(command -v kvpush || true)
  [ -n "$KVPUSH" ] || KVPUSH=$KP_REPO/.venv/bin/kvpush
fi

kp_usage() {
  cat <<EOF
usage: $0 ${KP_USAGE:+$KP_USAGE }[options]
  --dry-run              print every command (with each server's environment); run nothing
  --install              first install kvpush$([ "$KP_TARGET" = neuron ] && echo " into the vLLM Neuron plugin's environment (PYTHON; install the SDK's plugin first)") (on every host used)
  --model M              model to serve (default: $KP_MODEL)
  --tp N                 tensor-parallel size per server (default: $KP_TP)
  --num-prefill X        prefill servers (default: $KP_NP)
  --num-decode Y         decode servers (default: $KP_ND)
  --topology T           same-host | two-host (default: $KP_TOPOLOGY)
  --prefill-host ADDR    two-host: prefill host address (EFA subnet); local or reached by ssh
  --decode-host ADDR     two-host: decode host address
  --results DIR          results directory (default: runs/$KP_TARGET-$KP_SCENARIO-<time>)
  --inputs "1024 ..."    prompt lengths (default: $KP_INPUTS)
  --qps "1 2 4 8"        request rates (default: $KP_QPS)
  --output-len N         output tokens (default: $KP_OUTPUT_LEN)
  --duration S           seconds of arrivals per sweep point: num-prompts = qps * S (default: $KP_DURATION)
  --health-timeout S     deadline for every /health (default: $KP_HEALTH_TIMEOUT)
  --skip-doctor          do not run kvpush doctor before starting servers
  --config-arg ARG       extra argument for every kvpush config (repeat)
EOF
}

kp_defaults() {
  KP_MODEL=${KP_MODEL:-meta-llama/Llama-3.1-8B-Instruct}
  KP_TP=${KP_TP:-8}; KP_NP=${KP_NP:-1}; KP_ND=${KP_ND:-1}; KP_TOPOLOGY=${KP_TOPOLOGY:-same-host}
  KP_INPUTS=${KP_INPUTS:-"1024 2048 4096 8192 16384"}; KP_QPS=${KP_QPS:-"1 2 4 8"}
  KP_OUTPUT_LEN=${KP_OUTPUT_LEN:-128}; KP_DURATION=${KP_DURATION:-60}
  KP_HEALTH_TIMEOUT=${KP_HEALTH_TIMEOUT:-1800}; KP_ROUTER_PORT=${KP_ROUTER_PORT:-8000}
  KP_PREFILL_HOST=${KP_PREFILL_HOST:-}; KP_DECODE_HOST=${KP_DECODE_HOST:-}
  DRY_RUN=0; INSTALL=0; SKIP_DOCTOR=0; KP_CONFIG_ARGS=()
}

kp_parse() {
  while [ $# -gt 0 ]; do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --install) INSTALL=1 ;;
      --skip-doctor) SKIP_DOCTOR=1 ;;
      --model) KP_MODEL=$2; shift ;;
      --tp) KP_TP=$2; shift ;;
      --num-prefill) KP_NP=$2; shift ;;
      --num-decode) KP_ND=$2; shift ;;
      --topology) KP_TOPOLOGY=$2; shift ;;
      --prefill-host) KP_PREFILL_HOST=$2; shift ;;
      --decode-host) KP_DECODE_HOST=$2; shift ;;
      --results) KP_RESULTS=$2; shift ;;
      --inputs) KP_INPUTS=$2; shift ;;
      --qps) KP_QPS=$2; shift ;;
      --output-len) KP_OUTPUT_LEN=$2; shift ;;
      --duration) KP_DURATION=$2; shift ;;
      --health-timeout) KP_HEALTH_TIMEOUT=$2; shift ;;
      --config-arg) KP_CONFIG_ARGS+=("$2"); shift ;;
      -h|--help) kp_usage; exit 0 ;;
      *) echo "$0: unknown option $1" >&2; kp_usage >&2; exit 2 ;;
    esac
    shift
  done
  case $KP_TOPOLOGY in
    same-host) KP_PREFILL_HOST=${KP_PREFILL_HOST:-${KP_DECODE_HOST:-127.0.0.1}}; KP_DECODE_HOST=${KP_DECODE_HOST:-$KP_PREFILL_HOST}
               [ "$KP_PREFILL_HOST" = "$KP_DECODE_HOST" ] || {
                 echo "$0: --topology same-host puts P and D on one host; use --topology two-host for two" >&2; exit 2; } ;;
    two-host) [ -n "$KP_PREFILL_HOST" ] && [ -n "$KP_DECODE_HOST" ] || {
                echo "$0: --topology two-host needs --prefill-host and --decode-host" >&2; exit 2; } ;;
    *) echo "$0: --topology must be same-host or two-host" >&2; exit 2 ;;
  esac
  KP_RESULTS=${KP_RESULTS:-$KP_REPO/runs/$KP_TARGET-$KP_SCENARIO-$(date +%Y%m%d-%H%M%S)}
  KP_RUN=$KP_RESULTS/run
}

# ---- running, or printing in --dry-run ------------------------------------------------------------
kp_show() { printf '+'; printf ' %q' "$@"; printf '\n'; }
kp_run() { kp_show "$@"; [ "$DRY_RUN" = 1 ] || "$@"; }
kp_sq() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }   # one shell word, single-quoted
kp_is_local() {
  case $1 in 127.*|localhost|"$(hostname)") return 0 ;; esac
  hostname -I 2>/dev/null | tr ' ' '\n' | grep -qxF "$1"
}
# kp_on HOST CMD...: run CMD (one shell string) on HOST, locally or by ssh
kp_on() {
  local host=$1; shift
  if kp_is_local "$host"; then
    echo "+ $*"
    [ "$DRY_RUN" = 1 ] || bash -c "$*"
  else
    echo "+ ssh $host $(kp_sq "$*")"
    [ "$DRY_RUN" = 1 ] || ssh "$host" "$*"
  fi
}

kp_install() {
  local spec
  if [ "$KP_TARGET" = neuron ]; then  # the SDK's plugin brings vLLM, torch's `neuron` device and NIXL (docs/neuron.md)
    spec="$PYTHON -c 'import vllm_neuron, nixl' && $PYTHON -m pip install -e \"$KP_REPO\""
  else
    spec="$PYTHON -m pip install -e \"$KP_REPO[cuda]\""
    spec="$spec && $PYTHON -m pip install --no-deps nixl==$NIXL_VERSION nixl-cu13==$NIXL_VERSION"
  fi
  local h
  for h in $(printf '%s\n' "$KP_PREFILL_HOST" "$KP_DECODE_HOST" | sort -u); do kp_on "$h" "$spec"; done
}

# ---- servers ----------------------------------------------------------------------------------------
KP_STARTED=()   # "host pid name" of every process this run started
KP_URLS=()

kp_config() { "$KVPUSH" config "$KP_TARGET" "$@" ${KP_CONFIG_ARGS[@]+"${KP_CONFIG_ARGS[@]}"}; }

# kp_server ROLE INDEX HOST: generate its plan, check the host with kvpush doctor, start it
kp_server() {
  local role=$1 index=$2 host=$3 name=$1$2 args script url
  args=(--role "$role" --index "$index" --model "$KP_MODEL" --tp "$KP_TP" --topology "$KP_TOPOLOGY"
        --advertise-host "$host" --vllm-bin "$VLLM")
  script=$(kp_config "${args[@]}" --format shell)
  url=$(kp_config "${args[@]}" --format json | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["url"])')
  KP_URLS+=("$name=$url")
  echo "# ---- $name on $host ($url): $KP_RUN/$name.sh"
  echo "$script"
  local run; run=$(printf %q "$KP_RUN")
  local launch="cd $(printf %q "$KP_REPO") && mkdir -p $run && setsid nohup bash $run/$name.sh > $run/$name.log 2>&1 < /dev/null & echo \$!"
  local doctor="$(printf %q "$KVPUSH") doctor --target $KP_TARGET --plan $run/$name.json"
  if [ "$DRY_RUN" = 1 ]; then
    echo "+ $(printf %q "$KVPUSH") config $KP_TARGET ${args[*]} --format json > $KP_RUN/$name.json"
    if ! kp_is_local "$host"; then
      echo "+ ssh $host 'mkdir -p $run && cat > $run/$name.sh' < $KP_RUN/$name.sh"
      echo "+ ssh $host 'cat > $run/$name.json' < $KP_RUN/$name.json"
    fi
    [ "$SKIP_DOCTOR" = 1 ] || kp_on "$host" "$doctor"
    kp_on "$host" "$launch"
    return
  fi
  mkdir -p "$KP_RUN"
  printf '%s\n' "$script" > "$KP_RUN/$name.sh"
  kp_config "${args[@]}" --format json > "$KP_RUN/$name.json"
  if ! kp_is_local "$host"; then
    kp_run ssh "$host" "mkdir -p $run && cat > $run/$name.sh" < "$KP_RUN/$name.sh"
    kp_run ssh "$host" "cat > $run/$name.json" < "$KP_RUN/$name.json"
  fi
  if [ "$SKIP_DOCTOR" != 1 ] && ! kp_on "$host" "$doctor"; then
    echo "$0: kvpush doctor found problems for $name on $host (above); fix them or pass --skip-doctor" >&2
    exit 1
  fi
  local pid
  if kp_is_local "$host"; then pid=$(bash -c "$launch"); else pid=$(ssh "$host" "$launch"); fi
  KP_STARTED+=("$host $pid $name")
  echo "# $name started on $host: pid $pid, log $KP_RUN/$name.log"
}

# kp_wait_health URL: poll URL/health until it answers 200 or the deadline passes
kp_wait_health() {
  local url=$1 deadline=$((SECONDS + KP_HEALTH_TIMEOUT))
  echo "+ until curl -sf -m 5 -o /dev/null $url/health; do sleep 5; done  # health wait, deadline ${KP_HEALTH_TIMEOUT}s"
  [ "$DRY_RUN" = 1 ] && return 0
  until curl -sf -m 5 -o /dev/null "$url/health"; do
    if [ $SECONDS -ge $deadline ]; then
      echo "$0: $url/health not ready after ${KP_HEALTH_TIMEOUT}s; see the logs in $KP_RUN" >&2
      exit 1
    fi
    sleep 5
  done
  echo "# $url is healthy"
}

kp_router() {
  local args=(--role router --port "$KP_ROUTER_PORT" --host 127.0.0.1 --kvpush-bin "$KVPUSH") u
  for u in "${KP_URLS[@]}"; do
    case $u in prefill*) args+=(--prefill-url "${u#*=}") ;; decode*) args+=(--decode-url "${u#*=}") ;; esac
  done
  local script
  script=$(kp_config "${args[@]}" --format shell)
  echo "# ---- router on this host: $KP_RUN/router.sh"
  echo "$script"
  local run; run=$(printf %q "$KP_RUN")
  local launch="setsid nohup bash $run/router.sh > $run/router.log 2>&1 < /dev/null & echo \$!"
  echo "+ $launch"
  if [ "$DRY_RUN" != 1 ]; then
    printf '%s\n' "$script" > "$KP_RUN/router.sh"
    KP_STARTED+=("127.0.0.1 $(bash -c "$launch") router")
  fi
  kp_wait_health "http://127.0.0.1:$KP_ROUTER_PORT"
}

kp_stop() {
  local entry host pid name
  for entry in ${KP_STARTED[@]+"${KP_STARTED[@]}"}; do
    read -r host pid name <<<"$entry"
    echo "# stopping $name (pid $pid on $host)"
    if kp_is_local "$host"; then kill -TERM -- "-$pid" 2>/dev/null || true
    else ssh "$host" "kill -TERM -- -$pid" 2>/dev/null || true; fi
  done
  KP_STARTED=()
}

# ---- the sweep ------------------------------------------------------------------------------------------
kp_sweep() {
  local bench=$KP_RESULTS/bench in q n
  [ "$DRY_RUN" = 1 ] || mkdir -p "$bench"
  for in in $KP_INPUTS; do
    for q in $KP_QPS; do
      n=$((q * KP_DURATION)); [ $n -ge 20 ] || n=20
      kp_run "$VLLM" bench serve --backend vllm --base-url "http://127.0.0.1:$KP_ROUTER_PORT" \
        --endpoint /v1/completions --model "$KP_MODEL" --dataset-name random \
        --random-input-len "$in" --random-output-len "$KP_OUTPUT_LEN" --random-range-ratio 0 --ignore-eos \
        --request-rate "$q" --num-prompts "$n" --seed 0 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
        --label "kvpush-$KP_TARGET-$KP_SCENARIO" \
        --metadata "target=$KP_TARGET" "scenario=$KP_SCENARIO" "tp=$KP_TP" "prefill=$KP_NP" "decode=$KP_ND" \
        --save-result --result-dir "$bench" --result-filename "in${in}_qps${q}.json"
    done
  done
}

kp_main() {
  kp_defaults
  kp_parse "$@"
  echo "# kvpush $KP_TARGET $KP_SCENARIO: ${KP_NP}P${KP_ND}D TP$KP_TP $KP_TOPOLOGY, model $KP_MODEL, results $KP_RESULTS$([ "$DRY_RUN" = 1 ] && echo ' (dry run: nothing runs)')"
  if [ "$INSTALL" = 1 ]; then
    kp_install
    [ -x "$KVPUSH" ] || KVPUSH=$(command -v kvpush || echo "$KVPUSH")
  fi
  [ -x "$KVPUSH" ] || command -v "$KVPUSH" >/dev/null || {
    echo "$0: kvpush not found at $KVPUSH (set KVPUSH=/path/to/kvpush, or run with --install)" >&2; exit 2; }
  trap kp_stop EXIT
  trap 'exit 130' INT TERM
  local i
  for ((i = 0; i < KP_NP; i++)); do kp_server prefill "$i" "$KP_PREFILL_HOST"; done
  for ((i = 0; i < KP_ND; i++)); do kp_server decode "$i" "$KP_DECODE_HOST"; done
  local u
  for u in "${KP_URLS[@]}"; do kp_wait_health "${u#*=}"; done
  kp_router
  kp_sweep
  echo "# done: results in $KP_RESULTS/bench"
}
