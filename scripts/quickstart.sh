#!/usr/bin/env bash
# One command from a fresh clone to a finished job on the embedded default (a local worker, no
# Docker): set up .venv, start a local worker, submit the main example and stream its logs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
offload-jobs up --local
offload-jobs submit "${1:-examples/toy.yaml}"
