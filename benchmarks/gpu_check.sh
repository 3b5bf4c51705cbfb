#!/usr/bin/env bash
# The GPU checks, in one run of under 8 minutes on a single CUDA GPU (from the repository root):
#   1. the CUDA tests: Triton kernels against their PyTorch references, the engine on CUDA;
#   2. a decode-step benchmark at OPT-13B layer shapes (hidden 5120, 40 heads; two layers of random
#      weights): KV vs hidden pages, fused vs unfused hidden decode, Triton vs the PyTorch path.
# Results land in ${OUT:-out}/gpu_check/ (pytest log, decode_step.json, the table on stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
dest=${OUT:-out}/gpu_check
mkdir -p "$dest"
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
timeout 240 .venv/bin/python -m pytest -q -ra -m gpu tests/ 2>&1 | tee "$dest/pytest_gpu.log"
timeout 300 .venv/bin/python benchmarks/decode_step.py --device cuda --shape opt-13b-2l --dtypes bfloat16 \
    --batches 1 8 32 --contexts 512 2048 --repeats 5 --json "$dest/decode_step.json" 2>&1 | tee "$dest/decode_step.log"
