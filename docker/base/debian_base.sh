#!/usr/bin/env bash
# Builds the base of the CPU image without an image registry: Debian 12 (bookworm) with
# Python 3.11 and venv, made by debootstrap from Debian's own archive and imported as an image.
# It stands in for python:3.11-slim-bookworm (the default base when a registry is reachable):
# same OS release, same Python minor, `python3.11` on PATH.
#   docker/base/debian_base.sh [--engine podman|docker] [--tag TAG] [--mirror URL]
# Needs root (debootstrap), debootstrap and the engine. Prints the image tag on success.
set -euo pipefail

ENGINE=podman
TAG=localhost/sglang-hack-base:bookworm-py3.11
MIRROR=http://deb.debian.org/debian
while [ $# -gt 0 ]; do
    case "$1" in
        --engine) ENGINE=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        --mirror) MIRROR=$2; shift 2 ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$ENGINE" in podman|docker) ;; *) echo "error: --engine must be podman or docker, got $ENGINE" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "error: debootstrap is missing (apt-get install -y debootstrap)" >&2; exit 1; }
command -v "$ENGINE" >/dev/null || { echo "error: $ENGINE is missing" >&2; exit 1; }

ROOTFS=$(mktemp -d /var/tmp/sglang-hack-base.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
# minbase: dpkg, apt and what they need; Python 3.11 with venv (ensurepip) on top
# (python3-distutils named too: it provides the python3.11-distutils that venv depends on, which debootstrap's resolver does not follow).
debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-distutils,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" >&2
cat > "$ROOTFS/etc/apt/sources.list" <<SRC
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SRC
# Like the official slim images: no package lists, caches or logs in the base layer.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/*
tar --numeric-owner -C "$ROOTFS" -c . | "$ENGINE" import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$TAG" >&2
echo "$TAG"
