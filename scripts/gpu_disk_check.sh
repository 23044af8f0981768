#!/usr/bin/env bash
# Issue 12's GPU acceptance (the disk tier) and issue 15 item 3 (weights=) in one call of the device
# machine, about 6-7 minutes on an H200 (the step limits add up to 560 s):
#   1. pytest -m gpu tests/offload_core/disk tests/offload_core/test_pipeline_offload.py
#      tests/offload_core/test_weights.py (O_DIRECT into pinned slabs, lazy_load on CUDA, the pipeline
#      offload, weights= into a pinned arena)
#   2. python -m bench.disk: a 6 GB stack streamed from shards against the disk's own O_DIRECT rate in
#      the same run, cold and warm at max_memory fractions 0.25/0.5/0.75, FIFO and LRU, the engine,
#      diffusers' disk group offload; prints "cold streaming >= 0.85x raw" and "steady state <= 1.10x floor"
#   3. python -m bench.disk_box --lora: full Flux-dev dims (57 blocks, 23.8 GB of random bf16 weights)
#      sharded on local disk, VRAM capped at 8 GiB, max_memory 6 GiB (3 staging slots + the cache):
#      inference bitwise equal to resident, then LoRA r32 steps; prints the acceptance line
#      (bitwise, peak VRAM <= 7.5 GiB, peak RSS <= 10 GiB) and both times against their floors
#
#   bash scripts/gpu_disk_check.sh     # from the repository root, with the carried wheels in .whl/
#   SKIP_TESTS=1 ...   SKIP_DISK=1 ...   SKIP_BOX=1 ...
#
# Logs and JSON go to $OUT when it is set (the device machine's result folder), else ./gpu-disk-check/.
# The page cache is dropped before cold runs (root on that machine); shards go under /var/tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-gpu-disk-check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers" 2>/dev/null && ls .whl/diffusers-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_disk_check.sh: $PY sees no CUDA device (this script is for the GPU machine)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
df -h /var/tmp | tail -1
T0=$SECONDS

if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== GPU tests (disk tier, pipeline offload, weights=)"
    timeout 100 "$PY" -m pytest -m gpu tests/offload_core/disk tests/offload_core/test_pipeline_offload.py \
        tests/offload_core/test_weights.py -q -p no:cacheprovider -rfs 2>&1 | tee "$OUT_DIR/gpu_tests.log" \
        | grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" | tail -15
    echo "   ($((SECONDS - T0)) s so far)"
fi
if [ -z "${SKIP_DISK:-}" ]; then
    echo "== bench.disk (6 GB stack of DiT-width blocks, bf16, 4 disk workers)"
    timeout 240 "$PY" -m bench.disk --passes 3 --json "$OUT_DIR/bench-disk.json" 2>&1 | tee "$OUT_DIR/bench-disk.log" \
        | grep -vE "^\s*$" | tail -16
    echo "   ($((SECONDS - T0)) s so far)"
fi
if [ -z "${SKIP_BOX:-}" ]; then
    echo "== bench.disk_box --lora (Flux-dev dims, 8 GiB VRAM cap, max_memory 6 GiB)"
    timeout 220 "$PY" -m bench.disk_box --dir /var/tmp/flux-box --lora --steps 2 --json "$OUT_DIR/disk-box.json" 2>&1 \
        | tee "$OUT_DIR/disk-box.log" | grep -vE "^\s*$|should be kept in float32" | tail -10
    rm -rf /var/tmp/flux-box
fi
echo "   (whole check $((SECONDS - T0)) s)"
