#!/usr/bin/env bash
# Runs the commands of docs/operations.md against a real `serve run` and saves
# what they print in bench/results/operations.txt (each command, its output, its exit code).
#
#   bash scripts/operations_check.sh          # ≈3 min on 2 cores, ≈6 GB of memory
#
# Two departures from docs/operations.md, both to share a machine: the app listens on a free
# port instead of 8000 (a copy of serve_config.yaml), and its Redis is a private
# password-protected redis-server (the cluster setup: password in IRIS_REDIS_PASSWORD).
# The Ray cluster is the one `serve run` starts; it ends when `serve run` gets SIGTERM.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${IRIS_VENV:-$ROOT/.venv}
export PATH="$VENV/bin:$PATH"
unset RAY_AUTH_MODE RAY_AUTH_TOKEN RAY_ADDRESS RAY_DASHBOARD_ADDRESS
# The serve CLI imports LLMDecode's request router class (deployments.image_affinity_router):
# install.sh installs the project, so this only matters for a checkout beside another install.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
OUT=$ROOT/bench/results/operations.txt
WORK=$(mktemp -d)
CONFIG=$WORK/serve_config.yaml
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
HTTP_PORT=$(free_port)
REDIS_PORT=$(free_port)

# Record a command as typed, then what it printed and how it ended.
run() {
  echo "\$ $1" >>"$OUT"
  bash -c "$1" >>"$OUT" 2>&1
  echo "[exit $?]" >>"$OUT"
  echo >>"$OUT"
}

cleanup() {
  [ -n "${SERVE_PID:-}" ] && kill -TERM "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID"
  [ -n "${REDIS_PID:-}" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID"
  rm -rf "$WORK"
}
trap cleanup EXIT

export IRIS_REDIS_PASSWORD=$(python -c 'import secrets; print(secrets.token_hex(16))')
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --maxmemory 256mb --maxmemory-policy allkeys-lru --requirepass "$IRIS_REDIS_PASSWORD" >/dev/null &
REDIS_PID=$!

python - "$CONFIG" "$HTTP_PORT" "$REDIS_PORT" <<'EOF'
import sys, yaml
path, http_port, redis_port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = yaml.safe_load(open("serve_config.yaml"))
config["http_options"]["port"] = http_port
config["applications"][0]["args"]["cache"]["redis_url"] = f"redis://:${{IRIS_REDIS_PASSWORD}}@127.0.0.1:{redis_port}/0"
yaml.safe_dump(config, open(path, "w"), sort_keys=False)
EOF

{
  echo "# Operating Iris: docs/operations.md commands run by scripts/operations_check.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "# serve_config.yaml copied to \$CONFIG with http port $HTTP_PORT and redis_url on a password-protected redis-server"
  echo
} >"$OUT"

echo "\$ serve run \$CONFIG &   (log in serve_run.log)" >>"$OUT"
serve run "$CONFIG" >"$WORK/serve_run.log" 2>&1 &
SERVE_PID=$!
# With a config file, `serve run` logs no "ready" line: ask Serve until the app is RUNNING.
app_running() {
  RAY_AUTH_MODE=token serve status 2>/dev/null | python -c '
import sys, yaml
s = yaml.safe_load(sys.stdin) or {}
app = s.get("applications", {}).get("iris", {})
want = {d: int(n) for d, n in (a.split("=") for a in sys.argv[1:])}
ok = app.get("status") == "RUNNING" and all(
    app["deployments"][d]["replica_states"].get("RUNNING") == n for d, n in want.items())
sys.exit(0 if ok else 1)' "$@"
}
START=$SECONDS
for _ in $(seq 300); do
  app_running && break
  kill -0 "$SERVE_PID" 2>/dev/null || break
  sleep 2
done
sed 's/\x1b\[[0-9;]*m//g' "$WORK/serve_run.log" | grep -E "Submitted deploy config|dashboard at|Error" >>"$OUT"
echo "# app RUNNING after $((SECONDS - START)) s" >>"$OUT"
echo >>"$OUT"
# Ray picks another dashboard port when 8265 is taken (shared machine): follow it.
DASH=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/serve_run.log" | grep -oE "dashboard at (http://)?[0-9.]+:[0-9]+" | head -1 | grep -oE "[0-9.]+:[0-9]+$")
DASH=${DASH:-127.0.0.1:8265}
[ "$DASH" != "127.0.0.1:8265" ] && export RAY_DASHBOARD_ADDRESS=http://$DASH && echo "# dashboard at $DASH: RAY_DASHBOARD_ADDRESS=$RAY_DASHBOARD_ADDRESS" >>"$OUT"

echo "## serve status without the token (the reported failure)" >>"$OUT"
run "serve status"

echo "## with the token ray.init saved in ~/.ray/auth_token" >>"$OUT"
export RAY_AUTH_MODE=token
run "serve status"
run "serve config | head -20"

echo "## a request, and the health of the cache's Redis (password from IRIS_REDIS_PASSWORD)" >>"$OUT"
run "curl -s localhost:$HTTP_PORT/health"
run "curl -s -o /dev/null -w '%{http_code} x-iris-images: %header{x-iris-images}\n' localhost:$HTTP_PORT/v1/chat/completions -H 'content-type: application/json' -d '{\"model\": \"builtin:tiny-llava\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGUlEQVR4nGM8ISfHQApgIkn1qIZRDUNKAwBPHwEkcYw1mAAAAABJRU5ErkJggg==\"}}, {\"type\": \"text\", \"text\": \"What is in this picture?\"}]}]}'"

echo "## the dashboard's REST API: 401 without the token, 200 with it" >>"$OUT"
run "curl -s -o /dev/null -w '%{http_code}\n' http://$DASH/api/serve/applications/"
run "curl -s -H \"Authorization: Bearer \$(ray get-auth-token 2>/dev/null)\" http://$DASH/api/serve/applications/ | jq -c '.applications.iris.deployments | map_values({status, replicas: (.replicas | length)})'"

echo "## the metrics endpoint (Prometheus): its address is in Ray's service-discovery file" >>"$OUT"
run "jq -r '.[].targets[]' /tmp/ray/prom_metrics_service_discovery.json"
for _ in $(seq 60); do  # metrics are exported every few seconds
  for t in $(jq -r '.[].targets[]' /tmp/ray/prom_metrics_service_discovery.json); do curl -s "http://$t/metrics"; done | grep -q '^ray_iris_requests_total' && break
  sleep 2
done
run "for t in \$(jq -r '.[].targets[]' /tmp/ray/prom_metrics_service_discovery.json); do curl -s http://\$t/metrics; done | grep -E '^ray_(iris_requests_total|iris_images_total|serve_deployment_replica_healthy)' | grep 'application=\"iris\"' | sed -E 's/(Component|NodeAddress|SessionName|Version|WorkerId|otel_scope_[a-z_]+)=\"[^\"]*\",?//g'"

echo "## scaling: Preprocess to 2 replicas by editing the config, then serve deploy" >>"$OUT"
python - "$CONFIG" <<'EOF'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
(pre,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Preprocess"]
pre["autoscaling_config"].update(min_replicas=2, max_replicas=2)
yaml.safe_dump(config, open(sys.argv[1], "w"), sort_keys=False)
EOF
run "grep -A6 'name: Preprocess' $CONFIG"
run "serve deploy $CONFIG"
for _ in $(seq 150); do
  app_running Preprocess=2 && break
  sleep 2
done
run "serve status | grep -B1 -A4 'Preprocess:'"
sed -i "s|$WORK/serve_config.yaml|\$CONFIG|g" "$OUT"
echo "saved $OUT"
