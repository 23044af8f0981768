#!/usr/bin/env bash
# Everything a GPU session should check, in one call of the device machine (about 8 minutes on an H200):
#   the copy-timing probe, the GPU tests, the documented toy example, the benchmark with paired rounds, and the P2 timeline.
#
#   bash scripts/gpu_check.sh            # from the repository root, with diffusers' wheel in .whl/
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
#
# Each step has its own time limit, so one slow step cannot eat the others. Logs and JSON go to
# $OUT when it is set (the device machine's result folder), else to ./gpu-check/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-gpu-check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers" 2>/dev/null && ls .whl/diffusers-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: $PY sees no CUDA device (this script is for the GPU machine; CPU tests: see README)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader || true

echo "== copy timing probe (engine event pairs against the profiler's DMA)"
timeout 60 "$PY" -m bench.copyprobe --json "$OUT_DIR/copyprobe.json" 2>&1 | grep -v -i warn
echo "== GPU tests"
timeout 240 "$PY" -m pytest -m gpu tests/offload_core -q -p no:cacheprovider -rf 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -6
echo "== the documented toy example"
timeout 90 "$PY" examples/offload_toy.py 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -3 | tee "$OUT_DIR/toy.log"
if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== bench"
    timeout 330 "$PY" -m bench --workloads p1,p2,p3 --device cuda --warmup 3 --repeats 10 --paired 10 \
        --json "$OUT_DIR/bench-h200.json" --md "$OUT_DIR/bench-h200.md" 2>&1 | grep -E "^p[123] |^workload|^---" | cut -c1-200
fi
echo "== P2 timeline at the default prefetch"
timeout 60 "$PY" -m bench.timeline --workload p2 --json "$OUT_DIR/timeline-p2.json" 2>&1 | grep -v -i warn | head -8
