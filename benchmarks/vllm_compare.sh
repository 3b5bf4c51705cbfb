#!/usr/bin/env bash
# Our Ray Serve app against vLLM's CPU build, one server at a time, same checkpoint, cache bytes,
# token budget, max_num_seqs, dtype and compute threads: benchmarks/peer_sweep.py --start starts each
# (apt_serve_ray/bench/servers.py), measures it and stops it.
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
# merged into docs/benchmarks/compare/ (JSON and plots); labels say server, dtype and threads.
# vLLM runs without prefix caching here (vllm-nopc; every rate gets prompts of its own either way).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, installed or not
what=${1:-all}
dtype=${2:-bfloat16}
threads=${3:-1}
: "${PEER:?set PEER to the folder holding the vLLM venv and vllm-cli}"
shape=${SHAPE:-opt-125m}
OUT=docs/benchmarks/compare
short=${dtype/bfloat16/bf16}; short=${short/float32/fp32}
run=${RUN:+-$RUN}${TAG:+-$TAG}  # RUN=2: labels of a repeat run, kept beside the first
[ "$shape" = opt-125m ] || short="$shape-$short"  # labels: vllm-tinyllama-1.1b-fp32-2t
sweep=(--workloads ${WORKLOADS:-sharegpt longbench} --rates-sharegpt 1 2 3 4 6
       --rates-longbench ${LONGBENCH_RATES:-0.3 0.6 0.9 1.2 1.8} --out-dir "$OUT")
case $what in
    probe) phase=(--probe-only ${PROBE_ARGS:-});;
    sweep) phase=("${sweep[@]}");;
    all) phase=(--probe ${PROBE_ARGS:-} "${sweep[@]}");;
    *) echo "usage: vllm_compare.sh [probe|sweep|all] [dtype] [threads]" >&2; exit 2;;
esac
common=(--shape "$shape" --dtype "$dtype" --threads "$threads" --num-pages 378 --max-model-len 1024
        --json "$OUT/compare.json" --disable-tqdm "${phase[@]}")
servers=${SERVERS:-both}
if [ "$servers" != ours ]; then
    .venv/bin/python benchmarks/peer_sweep.py --start vllm --label "vllm-$short-${threads}t$run" \
        --server-args "${VLLM_ARGS:-}" "${common[@]}" || true
fi
[ "$servers" = vllm ] && exit 0
.venv/bin/python benchmarks/peer_sweep.py --start ours --label "apt-serve-$short-${threads}t$run" \
    --baseline "vllm-$short-${threads}t$run" --server-args "${OURS_ARGS:-}" "${common[@]}" || true
