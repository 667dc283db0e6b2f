# syntax=docker/dockerfile:1
# Betelgeuse: one image, two processes (the expert store and the GPU worker).
#
#   docker build -t betelgeuse .
#   docker run ... betelgeuse services.store_main  --config /etc/betelgeuse/betelgeuse.toml
#   docker run ... betelgeuse services.worker_main --config /etc/betelgeuse/betelgeuse.toml   (default)
#
# Run them as two containers sharing /run/betelgeuse (a volume: the store's sockets) and an IPC
# namespace (`--ipc=shareable` on the store, `--ipc=container:<store>` on the worker), the model
# directory mounted read-only, `--ulimit memlock=-1`, GPUs only on the worker (`--gpus all`), and
# a 12 GiB memory limit without swap on each or, better, on a common parent cgroup
# (`--memory=12g --memory-swap=12g`). The configuration baked in below listens on 0.0.0.0 so the
# ports can be published; mount your own at /etc/betelgeuse/betelgeuse.toml to change it.
# Health: grpc.health.v1 on the worker's gRPC port (SERVING once the model is loaded); for the
# store container pass --no-healthcheck, or set BETELGEUSE_HEALTH_TARGET=unix:/run/betelgeuse/store.sock.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# ---- build: a venv with torch (PyPI's Linux wheel carries its CUDA libraries) and the package ----
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_SPEC=torch
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# systemd-python is sdist-only: it needs a compiler, pkg-config and the libsystemd headers
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
       pkg-config libsystemd-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/betelgeuse
RUN python3 -m venv /opt/betelgeuse/.venv
ENV PATH=/opt/betelgeuse/.venv/bin:$PATH
# hadolint ignore=DL3013
RUN pip install --upgrade pip && pip install "${TORCH_SPEC}" grpcio-tools
COPY pyproject.toml README.md* ./
COPY proto proto
COPY betelgeuse betelgeuse
COPY services services
# generated gRPC modules are part of the image, not of the repository
# hadolint ignore=DL3013
RUN python -m services.codegen --force \
    && pip install ".[systemd]" \
    && pip uninstall -y grpcio-tools \
    && find /opt/betelgeuse -name __pycache__ -prune -exec rm -rf {} +

# ---- runtime: CUDA base (driver libraries come from the NVIDIA container runtime) ----
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libsystemd0 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 betelgeuse \
    && useradd --system --uid 10001 --gid betelgeuse --home-dir /var/lib/betelgeuse --create-home --shell /usr/sbin/nologin betelgeuse \
    && install -d -o betelgeuse -g betelgeuse -m 0750 /run/betelgeuse
COPY --from=build /opt/betelgeuse /opt/betelgeuse
COPY deploy/betelgeuse.toml /etc/betelgeuse/betelgeuse.toml
RUN sed -i -e 's/"127\.0\.0\.1:/"0.0.0.0:/g' /etc/betelgeuse/betelgeuse.toml
WORKDIR /opt/betelgeuse
ENV PATH=/opt/betelgeuse/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    BETELGEUSE_HEALTH_TARGET=127.0.0.1:50051
# numeric, so that the runtime can tell it is not root without reading /etc/passwd
USER 10001:10001
VOLUME ["/run/betelgeuse"]
# gRPC, worker /metrics, store /metrics
EXPOSE 50051 9464 9465
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel(os.environ['BETELGEUSE_HEALTH_TARGET']); r = g.HealthStub(ch).Check(h.HealthCheckRequest(service=''), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["python", "-m"]
CMD ["services.worker_main", "--config", "/etc/betelgeuse/betelgeuse.toml"]
