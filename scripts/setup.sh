#!/usr/bin/env bash
# Create .venv and install offload-jobs with its test extras.
# torch is pinned to 2.13.0 (the CPU build on local disk here): an unpinned torch resolves to a
# multi-GB CUDA build. On a GPU box, install a CUDA torch first and drop the [test] extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, diffusers, peft, fastapi, textual; print('offload-jobs environment ready: torch', torch.__version__)"
