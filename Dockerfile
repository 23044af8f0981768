# The offload-jobs worker image. `docker compose up -d` (or `offload-jobs up`) builds and runs it;
# see compose.yaml and the README's "On a GPU box".
#
#   docker build -t offload-jobs .                                             # CUDA PyTorch base
#   docker build --build-arg BASE_IMAGE=local/debian:bookworm -t offload-jobs:cpu .   # plain Debian
#
# BASE_IMAGE is a public CUDA PyTorch runtime image by default, and its torch is used as it is.
# Any Debian or Ubuntu image works too: python3 comes from apt when the base has none, and torch
# from a wheel in .ctx/wheels/ when there is one (how CI builds a CPU image), else from PyPI.
# .ctx/certs/*.crt (extra CA certificates, for a network that inspects TLS) are trusted while
# pip runs and never reach the final image. .ctx/ is git-ignored: scripts/container_context.sh
# fills it.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

# ---- base: the distribution's Python (when missing), the user and the mount points
FROM ${BASE_IMAGE} AS base
USER root
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN set -eu; pkgs=""; \
    python3 -c "import venv, ensurepip" 2>/dev/null || pkgs="python3 python3-venv"; \
    command -v update-ca-certificates >/dev/null || pkgs="$pkgs ca-certificates"; \
    # a CUDA torch's Triton builds its launchers with a C compiler at run time, and so does the bounce
    # ring's streaming-store copy (offload_core/streamcopy.py): a runtime base image has none
    if python3 -c "import triton" 2>/dev/null && ! command -v cc >/dev/null 2>&1; then pkgs="$pkgs gcc libc6-dev"; fi; \
    if [ -n "$pkgs" ]; then \
        apt-get update -qq && apt-get install -y -qq --no-install-recommends $pkgs >/dev/null; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 --version
# uid 1000 runs the worker (compose.yaml's `user:` may pick another); the mount points are its own.
RUN set -eu; \
    getent group 1000 >/dev/null || groupadd --gid 1000 offload; \
    getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --create-home --home-dir /home/offload \
        --shell /bin/sh offload; \
    mkdir -p /state /models /data /cache /outputs /home/offload; \
    chown 1000:1000 /state /models /data /cache /outputs /home/offload; \
    chmod 1777 /home/offload

# ---- deps: a venv with the runtime dependencies only, so a source change rebuilds none of it
FROM base AS deps
COPY pyproject.toml .ct[x] /tmp/build/
# --system-site-packages: the base image's torch (and its CUDA libraries) stay visible to the venv.
RUN set -eu; \
    if ls /tmp/build/certs/*.crt >/dev/null 2>&1; then \
        cp /tmp/build/certs/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates >/dev/null 2>&1; \
        export PIP_CERT=/etc/ssl/certs/ca-certificates.crt; \
    fi; \
    python3 -m venv --system-site-packages /opt/venv; \
    pip="/opt/venv/bin/python -m pip install -q --no-compile"; \
    if /opt/venv/bin/python -c "import torch" 2>/dev/null; then \
        echo "torch from the base image: $(/opt/venv/bin/python -c 'import torch; print(torch.__version__)')"; \
    elif ls /tmp/build/wheels/torch-*.whl >/dev/null 2>&1; then \
        $pip /tmp/build/wheels/torch-*.whl; \
    fi; \
    /opt/venv/bin/python -c "import importlib.util, re, sys; \
toml = importlib.import_module('tomllib' if sys.version_info >= (3, 11) else 'pip._vendor.tomli'); \
deps = toml.load(open('/tmp/build/pyproject.toml', 'rb'))['project']['dependencies']; \
has_torch = importlib.util.find_spec('torch') is not None; \
print('\\n'.join(d for d in deps if not (has_torch and re.match(r'torch\\b(?![-_.])', d))))" \
        > /tmp/build/requirements.txt; \
    $pip "setuptools>=68" wheel -r /tmp/build/requirements.txt; \
    rm -rf /tmp/build

# ---- the image: the venv, then the project (the only layers a source change rebuilds)
# Not byte-compiled here (12,500 files: minutes of build time, +0.27 GB): the worker's uid cannot
# write into /opt/venv, so Python keeps the .pyc files it makes under /cache/python instead, on
# the host folder, and every job after the first imports torch and diffusers from them.
FROM base
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    OFFLOAD_JOBS_HOME=/state \
    OFFLOAD_JOBS_MODEL_CACHE=/models \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    TORCH_HOME=/cache/torch \
    TRITON_CACHE_DIR=/cache/triton \
    PYTHONPYCACHEPREFIX=/cache/python \
    HOME=/home/offload
WORKDIR /app
COPY pyproject.toml README.md byte_sizes.py ./
COPY offload_core ./offload_core
COPY jobs ./jobs
COPY tui ./tui
RUN pip install -q --no-deps --no-build-isolation --no-compile . && rm -rf build ./*.egg-info \
    && offload-jobs --help >/dev/null
COPY examples ./examples
COPY scripts/container-entrypoint.sh /usr/local/bin/offload-jobs-entrypoint
USER 1000:1000
EXPOSE 8765
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/healthz', timeout=4)"]
ENTRYPOINT ["offload-jobs-entrypoint"]
CMD ["offload-jobs", "worker", "--host", "0.0.0.0", "--port", "8765"]
