#!/usr/bin/env bash
# Fill .ctx/ (git-ignored), what the Dockerfile picks up from the build context on a machine like CI's:
#   .ctx/certs/*.crt      the host's extra CA certificates (a network that inspects TLS), for pip
#   .ctx/wheels/torch-*   the CPU torch wheel (torch==2.13.0 lies on local disk; without it pip
#                         would fetch a multi-GB CUDA build for a base image that has no torch)
# Both change under us (the certificates daily): never commit them.
#   bash scripts/container_context.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-python3}}
mkdir -p .ctx/certs .ctx/wheels
rm -f .ctx/certs/*.crt
shopt -s nullglob
certs=(/usr/local/share/ca-certificates/*.crt /usr/local/share/ca-certificates/*/*.crt)
if [ ${#certs[@]} -gt 0 ]; then
    cp "${certs[@]}" .ctx/certs/
fi
wheels=(.ctx/wheels/torch-2.13.0*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    rm -f .ctx/wheels/torch-*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
        torch==2.13.0 -d .ctx/wheels
fi
wheels=(.ctx/wheels/torch-*.whl)
echo ".ctx: ${#certs[@]} CA certificate(s), ${wheels[*]:-no torch wheel}"
