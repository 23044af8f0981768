#!/usr/bin/env bash
# One command from a fresh clone to a finished job on the embedded default (a local worker, no
# Docker): set up .venv, link `offload-jobs` into ~/.local/bin, build the tiny random pipelines
# (offline, into .tiny/), start a local worker, and run the main job, a real tiny LoRA training run
# (examples/tiny-train.yaml), streaming its log. Afterwards, in any new shell:
#     source .venv/bin/activate && offload-jobs ps
#
# torch: a CUDA build already in .venv is kept; on a box where `nvidia-smi` sees a GPU the CUDA
# build is installed (from the PyTorch index for the driver's CUDA, or $OFFLOAD_TORCH_INDEX); the
# CPU pin of the [test] extra (scripts/setup.sh, as .ci/run does) only where there is no GPU.
#     bash scripts/quickstart.sh --plan     # print the install plan and stop
set -euo pipefail
cd "$(dirname "$0")/.."
plan_only=0
if [ "${1:-}" = "--plan" ]; then plan_only=1; shift; fi
PY=${PYTHON:-python3}
VENV_PY=${OFFLOAD_QUICKSTART_PYTHON:-.venv/bin/python}  # where an installed torch is looked for

torch_now=""       # "VERSION CUDA" of the torch in .venv ("2.7.0+cu128 12.8"; CUDA empty for a CPU build)
if [ -x "$VENV_PY" ]; then
    torch_now=$("$VENV_PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")' 2>/dev/null || true)
fi
torch_cuda=$(echo "$torch_now" | awk '{print $2}')
driver_cuda=""    # the CUDA version the driver supports, when nvidia-smi sees a GPU
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n1)
    driver_cuda=${driver_cuda:-unknown}
fi

# The PyTorch wheel index for a driver's CUDA version: the newest build it can run.
cuda_index() {
    local v=$1 major minor
    major=${v%%.*}; minor=${v#*.}
    if [ "$v" = unknown ]; then echo "https://download.pytorch.org/whl/cu126"; return; fi
    if [ "$major" -gt 12 ] || { [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; }; then echo "https://download.pytorch.org/whl/cu128"
    elif [ "$major" -eq 12 ] && [ "$minor" -ge 6 ]; then echo "https://download.pytorch.org/whl/cu126"
    else echo "https://download.pytorch.org/whl/cu118"; fi
}

if [ -n "$torch_cuda" ]; then
    mode=keep
    echo "install plan: keep torch ${torch_now%% *} (CUDA $torch_cuda) in .venv; install offload-jobs without the CPU pin" >&2
elif [ -n "$driver_cuda" ]; then
    mode=cuda
    index=${OFFLOAD_TORCH_INDEX:-$(cuda_index "$driver_cuda")}
    echo "install plan: nvidia-smi sees a GPU (driver CUDA $driver_cuda): install the CUDA build of torch from $index; install offload-jobs without the CPU pin" >&2
else
    mode=cpu
    echo "install plan: no GPU (no nvidia-smi or it lists none): install offload-jobs with the [test] extra, torch==2.13.0 on the CPU" >&2
fi
if [ "$plan_only" = 1 ]; then
    exit 0
fi

case $mode in
    cpu) bash scripts/setup.sh ;;
    keep|cuda)
        [ -x .venv/bin/python ] || "$PY" -m venv .venv
        if [ "$mode" = cuda ]; then
            .venv/bin/python -m pip install -q --disable-pip-version-check torch --index-url "$index"
        fi
        # no [test] extra: its torch==2.13.0 pin would replace the CUDA build with the CPU one
        .venv/bin/python -m pip install -q --disable-pip-version-check -e . 2>&1 | grep -v "^WARNING: Location" || true
        .venv/bin/python -c "import torch; assert torch.version.cuda, 'torch lost its CUDA build'; print('offload-jobs environment ready: torch', torch.__version__, 'CUDA', torch.version.cuda, 'available:', torch.cuda.is_available())"
        ;;
esac
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
