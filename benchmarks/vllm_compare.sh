#!/usr/bin/env bash
# Our Ray Serve app against vLLM's CPU build, one server at a time, same checkpoint, cache bytes,
# token budget, max_num_seqs, dtype and compute threads; the client is benchmarks/peer_sweep.py.
#
#   PEER=/path/to/vllm-peer bash benchmarks/vllm_compare.sh [probe|sweep|all] [dtype] [threads]
#   SERVERS=ours (or vllm) runs one side only and keeps the other's results in the JSON; RUN=2 labels a
#   repeat run apart from the first (the machines are noisy: repeat before concluding).
#   VLLM_ARGS / OURS_ARGS: extra server arguments (e.g. VLLM_ARGS="--kv-cache-dtype fp8",
#   OURS_ARGS="cache_kinds=[hidden,kv-int8,hidden-int8] cache_ratio=0.5"), TAG: a label suffix for them;
#   WORKLOADS="longbench" sweeps one workload only; LONGBENCH_RATES="0.6 1.2 1.8 2.4" replaces its rates.
#   SHAPE=opt-350m or tinyllama-1.1b: a bigger random-weight checkpoint (apt_serve_ray.models.checkpoints.SHAPES;
#   labels get the shape); PROBE_ARGS: the probe's sizes for it (e.g. "--probe-single 2 --probe-saturated 16
#   --probe-input-len 256 --probe-output-len 64": at 1.1B in fp32 a 384-token prefill takes ~7 s here).
#
# PEER holds vLLM's venv and its vllm-cli wrapper (../shared/tools/vllm-peer/README.md says how to
# make it). probe: single-stream TTFT/TPOT and saturated tok/s (~3 min per server); sweep: SLO
# attainment per rate on ShareGPT- and LongBench-like traces (~25 min per server). Results are
# merged into docs/benchmarks/peer/ (JSON and plots); labels say server, dtype and threads.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
dtype=${2:-bfloat16}
threads=${3:-1}
: "${PEER:?set PEER to the folder holding the vLLM venv and vllm-cli}"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
PY=.venv/bin/python
shape=${SHAPE:-opt-125m}
CKPT=$HOME/.cache/apt-serve-ray/$shape-bf16  # for opt-125m: the random-weight checkpoint serving_policies.py writes
$PY -c "import sys; from apt_serve_ray.models.checkpoints import make_random_checkpoint as m; m(sys.argv[1], sys.argv[2], dtype='bfloat16')" "$CKPT" "$shape"
OUT=docs/benchmarks/compare
mkdir -p "$OUT"
short=${dtype/bfloat16/bf16}; short=${short/float32/fp32}
run=${RUN:+-$RUN}${TAG:+-$TAG}  # RUN=2: labels of a repeat run, kept beside the first
[ "$shape" = opt-125m ] || short="$shape-$short"  # labels: vllm-tinyllama-1.1b-fp32-2t
workloads=${WORKLOADS:-sharegpt longbench}

wait_up() {  # port
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null && return 0
        sleep 2
    done
    echo "server on :$1 did not come up" >&2
    return 1
}

wait_free() {  # port: a previous server still shutting down would answer for the next one
    for _ in $(seq 1 60); do
        curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null || return 0
        sleep 2
    done
    echo "port $1 is still in use" >&2
    return 1
}

stop() {  # pid
    kill -INT "$1" 2> /dev/null || true
    for _ in $(seq 1 30); do kill -0 "$1" 2> /dev/null || return 0; sleep 1; done
    kill -KILL "$1" 2> /dev/null || true
}

client() {  # port label extra-args...
    local port=$1 label=$2
    shift 2
    if [ "$what" = probe ] || [ "$what" = all ]; then
        $PY benchmarks/peer_sweep.py --base-url "http://127.0.0.1:$port" --label "$label" --probe-only \
            --json "$OUT/compare.json" --disable-tqdm ${PROBE_ARGS:-} "$@"
    fi
    if [ "$what" = sweep ] || [ "$what" = all ]; then
        case " $workloads " in *" sharegpt "*)
        $PY benchmarks/peer_sweep.py --base-url "http://127.0.0.1:$port" --label "$label" --workloads sharegpt \
            --rates 1 2 3 4 6 --json "$OUT/compare.json" --disable-tqdm "$@";; esac
        case " $workloads " in *" longbench "*)
        $PY benchmarks/peer_sweep.py --base-url "http://127.0.0.1:$port" --label "$label" --workloads longbench \
            --rates ${LONGBENCH_RATES:-0.3 0.6 0.9 1.2 1.8} --json "$OUT/compare.json" --out-dir "$OUT" --disable-tqdm "$@";; esac
    fi
}

# vLLM: 189 blocks of 32 = 6,048 KV tokens; its compute threads bound to the first cores.
binds=0; [ "$threads" = 2 ] && binds=0-1
set -m
servers=${SERVERS:-both}
if [ "$servers" != ours ]; then
wait_free 8100
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=$binds \
    "$PEER/venv/bin/python" "$PEER/vllm-cli" serve "$CKPT" --served-model-name "$shape" --max-model-len 1024 \
    --dtype "$dtype" --no-enable-prefix-caching --block-size 32 --num-gpu-blocks-override 189 \
    --max-num-batched-tokens 512 --max-num-seqs 64 --port 8100 ${VLLM_ARGS:-} > "/tmp/vllm_compare_vllm.log" 2>&1 &
pid=$!
wait_up 8100 && client 8100 "vllm-$short-${threads}t$run" || true
stop $pid
fi
[ "$servers" = vllm ] && exit 0
wait_free 8000

# Ours: 378 pages of 16 = 6,048 KV tokens; watermarks at 1.0 (vLLM has no admission control, and a
# 503 would count as a miss); the SLOs told to the server, as apt schedules by them.
.venv/bin/serve run deployments.app:build_app model="$CKPT" served_model_name="$shape" dtype="$dtype" \
    num_threads="$threads" num_pages=378 max_model_len=1024 max_num_seqs=64 max_num_batched_tokens=512 \
    policy=apt light_watermark=1.0 heavy_watermark=1.0 default_ttft_slo_ms=4000 default_tbt_slo_ms=1000 \
    ${OURS_ARGS:-} > "/tmp/vllm_compare_ours.log" 2>&1 &
pid=$!
wait_up 8000 && client 8000 "apt-serve-$short-${threads}t$run" --baseline "vllm-$short-${threads}t$run" || true
stop $pid
