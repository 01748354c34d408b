# syntax=docker/dockerfile:1
# SGLang 0.5.23 + HACK serving image for one NVIDIA GPU family (build args from docker/matrix.yaml).
# Build from the repository root:
#   docker build -f docker/gpu.Dockerfile --build-arg SM=90 --build-arg TORCH_CUDA_ARCH_LIST=9.0a \
#     --build-arg GPU_FAMILY=h100 -t sglang-hack:0.1.0-sm90 .
# The server runs through SGLang's own entry point with the HACK plugin installed; the model is
# mounted at run time (nothing is baked in). See docs/docker.md.

# CUDA 13.0 because SGLang 0.5.23 pins torch 2.14.1 and a cu13 stack; devel because
# flashinfer, Triton and the HACK kernels compile for the device at first use.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

# Stage 1, the architecture guard: refuse, at the first step, architectures the pinned wheels
# cannot run on, instead of producing an image that fails at the first forward pass ("no
# kernel image is available"). Its own stage so the family's build arguments reach only the
# last steps of the image: every family shares the heavy layers below.
FROM ${CUDA_IMAGE} AS arch-guard
ARG SM=90
ARG GPU_FAMILY=h100
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "${SM}" in \
      80|86|89|90) echo "building for sm${SM} (${GPU_FAMILY})" ;; \
      70|75) echo "error: sm${SM} is not supported by SGLang 0.5.23's CUDA wheels (sglang-kernel 0.4.10 starts at sm_80; CUDA 13 has no sm_70). See docs/docker.md, 'Unsupported GPUs'." >&2; exit 1 ;; \
      *) echo "error: unknown SM '${SM}'; supported: 80 86 89 90" >&2; exit 1 ;; \
    esac
RUN echo "sm${SM} ${GPU_FAMILY}" > /sglang-hack-arch

# Stage 2, the image.
FROM ${CUDA_IMAGE}
ARG PYTHON_VERSION=3.11

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11 (the project's interpreter) is not in Ubuntu 24.04's archive: deadsnakes has it
# (a base whose archive has it, such as the Debian 12 stand-in of docs/docker.md, skips the PPA).
# libibverbs1/librdmacm1/ibverbs-providers: mooncake's transfer engine links them even over TCP.
# libtcmalloc-minimal4: the servers' allocator (engine/allocator.py).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gnupg \
 && if ! apt-cache show "python${PYTHON_VERSION}-venv" >/dev/null 2>&1; then \
      add-apt-repository -y ppa:deadsnakes/ppa && apt-get update; \
    fi \
 && apt-get install -y --no-install-recommends \
      "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" "python${PYTHON_VERSION}-dev" \
      ca-certificates curl libibverbs1 librdmacm1 ibverbs-providers libnuma1 libtcmalloc-minimal4 \
 && apt-get purge -y --auto-remove software-properties-common gnupg \
 && rm -rf /var/lib/apt/lists/*

RUN "python${PYTHON_VERSION}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv

WORKDIR /opt/sglang-hack

# Same pins as `make install` (requirements/). The registry's torch 2.14.1 wheel is the CUDA 13.0
# build (it requires cuda-toolkit 13.0.x); check_stack.py below verifies that.
COPY requirements/torch.txt requirements/base.txt requirements/
# The secret pip_ca (optional): a CA bundle for a registry reached through a TLS-inspecting
# proxy (docker/build_images.py passes the host pip's); never stored in a layer.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && pip install -r requirements/torch.txt \
 && pip install -r requirements/base.txt -c requirements/torch.txt

# The project itself with the `gpu` extra: sglang with all of its CUDA dependencies,
# the CUDA mooncake transfer engine and the router. The context is filtered by
# gpu.Dockerfile.dockerignore (an allow-list of the packages, README and pyproject).
COPY . .
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && pip install ".[gpu]" -c requirements/torch.txt

# From here on, per family: the guard's verdict, then the stack check for this family.
ARG SM=90
ARG TORCH_CUDA_ARCH_LIST=9.0a
ARG GPU_FAMILY=h100
COPY --from=arch-guard /sglang-hack-arch /etc/sglang-hack-arch
# Fail the build if pip resolved anything but the stack docker/matrix.yaml pins.
RUN python docker/check_stack.py --gpu --sm "${SM}"

# JIT builds (flashinfer, torch extensions, Triton) target this family only.
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    FLASHINFER_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    HACK_GPU_FAMILY=${GPU_FAMILY} \
    HACK_PORT=30000

# Non-root: SGLang needs no privileges to serve; JIT caches go to the user's home.
# /data is the working directory, so the default run directory (runs/) lands in /data/runs.
# (Ubuntu 24.04 ships a user 'ubuntu' with uid 1000: replace it.)
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid 1000 --shell /bin/bash hack \
 && mkdir -p /data/runs /models \
 && chown 1000:1000 /data /data/runs
USER 1000:1000
WORKDIR /data

LABEL org.opencontainers.image.title="sglang-hack" \
      org.opencontainers.image.description="SGLang 0.5.23 with HACK 2-bit KV cache, ${GPU_FAMILY} (sm${SM})" \
      ai.sglang-hack.sm="${SM}" \
      ai.sglang-hack.gpu-family="${GPU_FAMILY}"

EXPOSE 30000 8998

# Model loading and CUDA graph capture take minutes on big models: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["/bin/sh", "-c", "curl -fsS \"http://127.0.0.1:${HACK_PORT}/health\" || exit 1"]

ENTRYPOINT ["python", "-m", "sglang.launch_server"]
CMD ["--model-path", "/models/model", "--kv-cache-dtype", "hack", "--host", "0.0.0.0", "--port", "30000"]
