#!/usr/bin/env bash
# The benchmark as run on one NVIDIA H200: python -m bench over P1, P2 and P3, every variant, one process.
#   bash bench/run_h200.sh            # from the repository root
#   bash bench/run_h200.sh tiers      # the link-tier table (issue 29): P1 and flux-dev-lora-8g, resident and
#                                     # ours at emulated 13, 25, 50 GB/s and the real link (bench/RESULTS.md
#                                     # "Link tiers" gives its device time); writes bench-tiers-h200.{json,md}
# diffusers is not installed on that machine: carry its wheel in .whl/ (git-ignored), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 diffusers==0.42.1 -d .whl
# Writes bench-h200.json and bench-h200.md (copied into "$OUT" when that is set) and prints the table last.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers" 2>/dev/null; then
    if ls .whl/diffusers-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/bench-site .whl/diffusers-*.whl
        export PYTHONPATH=/tmp/bench-site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "diffusers is missing and .whl/ holds no diffusers wheel: the diffusers rows will read n/a" >&2
    fi
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" >&2
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,clocks.sm,memory.total --format=csv >&2 || true
if [ "${1:-}" = tiers ]; then
    shift
    "$PY" -m bench --workloads p1,flux-dev-lora-8g --only resident,ours --link-gbps 13,25,50,real --device cuda \
        --warmup 3 --repeats 3 --no-profile --json bench-tiers-h200.json --md bench-tiers-h200.md "$@"
    if [ -n "${OUT:-}" ]; then
        cp bench-tiers-h200.json bench-tiers-h200.md "$OUT"/
    fi
    exit 0
fi
"$PY" -m bench --workloads p1,p2,p3 --device cuda --warmup 3 --repeats 10 --paired 10 \
    --json bench-h200.json --md bench-h200.md "$@"
if [ -n "${OUT:-}" ]; then
    cp bench-h200.json bench-h200.md "$OUT"/
fi
