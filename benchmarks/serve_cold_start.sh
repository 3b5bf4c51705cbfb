#!/usr/bin/env bash
# Cold start of `serve run serve_config.yaml` to the first chat answer, and the memory of the whole app.
#   benchmarks/serve_cold_start.sh            (from anywhere; needs port 8000 free)
# Starts the server in the background, polls /health, sends one chat request, prints the RSS of every
# process of that Ray instance, then stops the server by its PID (it takes its Ray instance with it).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log=$(mktemp /tmp/serve_cold_start.XXXXXX.log)
now() { date +%s.%N; }
set -m  # the server gets its own process group
t0=$(now)
.venv/bin/serve run serve_config.yaml > "$log" 2>&1 &
pid=$!
stop() { kill -INT "$pid" 2>/dev/null; for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return; sleep 1; done; kill "$pid"; }
trap stop EXIT
until curl -sf localhost:8000/health > /dev/null; do
  kill -0 "$pid" 2>/dev/null || { echo "serve run exited; log: $log"; exit 1; }
  sleep 0.25
done
t1=$(now)
answer=$(curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct", "max_tokens": 40, "temperature": 0,
  "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}')
t2=$(now)
printf 'healthy after %.1f s, first chat answer after %.1f s\n%s\n' "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t0" | bc)" "$answer"
# Every process of this Ray instance descends from the `serve run` process.
pids=$(ps -eo pid=,ppid= | awk -v root="$pid" '{p[$1]=$2} END {for (x in p) {y=x; while (y in p && y!=root && y>1) y=p[y]; if (y==root) print x}; print root}')
echo "RSS (MiB) of the Ray instance started by serve run:"
ps -o rss=,args= -p "$(echo $pids | tr ' ' ',')" | sort -rn | awk '{s+=$1; printf "  %8.1f  %s\n", $1/1024, substr($0, index($0,$2), 70)} END {printf "  %8.1f  total\n", s/1024}'
