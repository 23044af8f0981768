#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the GPU box lacks for the train/infer runners and the
# worker (it has torch 2.11, accelerate, peft, safetensors, transformers, numpy; Python 3.12, no network):
#     bash scripts/h200_wheels.sh            # -> .whl/ (git-ignored, ~48 MB: pass it in the device call's carry)
# On the GPU box, before scripts/h200_runners.py:
#     pip install -q --no-index --find-links .whl -r .whl/requirements.txt
# transformers is pinned to the version the CPU tests use (5.24.0; the box's own may be older).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
cat > .whl/requirements.txt <<'REQ'
diffusers==0.42.1
transformers==5.24.0
tokenizers==0.23.3
pydantic>=2.6
fastapi>=0.110
uvicorn>=0.29
sqlalchemy>=2.0
typer>=0.12
prometheus-client>=0.20
httpx>=0.27
pyyaml>=6
rich>=13
psutil>=5.9
tqdm>=4.66
pillow>=10
REQ
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d .whl -r .whl/requirements.txt
rm -f .whl/numpy-*.whl      # on the box already (torch and transformers need it); 15 MB saved
du -sh .whl
ls .whl
