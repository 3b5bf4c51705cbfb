#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite: two pytest-xdist workers by default (the tests
# on Ray on one, started once; everything else on the other), APT_TEST_WORKERS=0 for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
workers=${APT_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
    parallel=(-n "$workers" --dist loadgroup)
fi
exec .venv/bin/python -m pytest -q -ra "${parallel[@]}" "$@"
