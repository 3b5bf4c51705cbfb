#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
