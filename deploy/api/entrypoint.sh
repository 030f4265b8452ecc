#!/bin/sh
# Entry point of the api image. prometheus_client's multiprocess mode wants
# PROMETHEUS_MULTIPROC_DIR set by the start-up script, before Python starts, and the
# directory wiped between runs (https://prometheus.github.io/client_python/multiprocess/):
# both happen here, then the command (by default `welltempered serve`) replaces the shell.
set -eu

if [ -n "${PROMETHEUS_MULTIPROC_DIR:-}" ]; then
    mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
    # Only the metric files: the directory itself may be a tmpfs mount point.
    find "$PROMETHEUS_MULTIPROC_DIR" -maxdepth 1 -type f -name '*.db' -delete
fi

exec "$@"
