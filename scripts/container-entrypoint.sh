#!/bin/sh
# The worker container's entry point: check that the mounted folders are writable, hand the worker
# the token from .env (through its state dir's token file, then out of the environment), and run
# the command (by default `offload-jobs worker --host 0.0.0.0 --port 8765`).
set -eu
home=${OFFLOAD_JOBS_HOME:-/state}
host_dir=${OFFLOAD_HOST_DIR:-the host folder}
for dir in "$home" /outputs /cache; do
    if [ ! -w "$dir" ]; then
        echo "error: $dir (from $host_dir) is not writable by uid $(id -u) in the container:" \
             "create the folder as the user who runs the worker (offload-jobs up does)," \
             "or set OFFLOAD_UID and OFFLOAD_GID in .env to its owner's ids" >&2
        exit 2
    fi
done
if [ -n "${OFFLOAD_JOBS_TOKEN:-}" ]; then
    umask 077
    printf '%s\n' "$OFFLOAD_JOBS_TOKEN" > "$home/.token.$$"
    mv -f "$home/.token.$$" "$home/token"
fi
unset OFFLOAD_JOBS_TOKEN
exec "$@"
