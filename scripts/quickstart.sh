#!/usr/bin/env bash
# One command from a fresh clone to a finished job on the embedded default (a local worker, no
# Docker): set up .venv, link `offload-jobs` into ~/.local/bin, build the tiny random pipelines
# (offline, into .tiny/), start a local worker, and run the main job, a real tiny LoRA training run
# (examples/tiny-train.yaml), streaming its log. Afterwards, in any new shell:
#     source .venv/bin/activate && offload-jobs ps
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bin="$HOME/.local/bin"
mkdir -p "$bin"
if [ ! -e "$bin/offload-jobs" ] || [ -L "$bin/offload-jobs" ]; then
    ln -sfn "$PWD/.venv/bin/offload-jobs" "$bin/offload-jobs"
    echo "linked $bin/offload-jobs -> $PWD/.venv/bin/offload-jobs" >&2
fi
.venv/bin/python scripts/make_tiny_pipelines.py .tiny
.venv/bin/offload-jobs up --local
.venv/bin/offload-jobs submit "${1:-examples/tiny-train.yaml}"
case ":$PATH:" in
    *":$bin:"*) echo "offload-jobs is on your PATH ($bin); try: offload-jobs ps" >&2 ;;
    *) echo "in a new shell: source $PWD/.venv/bin/activate && offload-jobs ps" >&2 ;;
esac
