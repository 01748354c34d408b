#!/usr/bin/env bash
# What `make images` needs beyond `make install`: a container engine and its compose tool.
# A working Docker engine (`docker info` answers) is used as it is; otherwise podman from
# Debian's archive with runc (crun fails on hosts with cgroup v1 hybrid mounts), debootstrap
# for the registry-less base image, and podman-compose into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    exit 0
fi
missing=()
for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
    else
        echo "error: ${missing[*]} missing. Run: sudo apt-get install -y podman runc debootstrap" >&2
        exit 1
    fi
fi
"$VENV/bin/pip" install -q -r docker/podman/requirements.txt
