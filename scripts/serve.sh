#!/usr/bin/env bash
# Set up (first run only) and start the server on the default model: an OpenAI-compatible API on :8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/serve run serve_config.yaml "$@"
