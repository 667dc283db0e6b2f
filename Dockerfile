# syntax=docker/dockerfile:1
# Betelgeuse: one image, two processes (the expert store and the GPU worker); `betelgeuse` is the
# entry point, so any subcommand runs as it would on a host:
#
#   docker build -t betelgeuse .
#   docker run ... betelgeuse store  --config /etc/betelgeuse/betelgeuse.toml
#   docker run ... betelgeuse worker --config /etc/betelgeuse/betelgeuse.toml   (the default CMD)
#   docker run ... betelgeuse serve /models/model.gguf --host 0.0.0.0 --device cuda   (both, one container)
#
# Run store and worker as two containers sharing /run/betelgeuse (a volume: the store's sockets) and
# an IPC namespace (`--ipc=shareable` on the store, `--ipc=container:<store>` on the worker), the model
# directory mounted read-only, `--ulimit memlock=-1`, GPUs only on the worker (`--gpus all`), and a
# 12 GiB memory limit without swap on each or, better, on a common parent cgroup (a Kubernetes pod:
# deploy/kubernetes/). The configuration baked in below listens on 0.0.0.0 so the ports can be
# published: gRPC 50051, the OpenAI-compatible HTTP API 8000 (/v1/chat/completions, /v1/messages, /v1/responses,
# ...), /metrics 9464 (worker) and 9465 (store), WITH NO API KEY AND NO TLS: anyone who reaches a published port can
# run the model. Mount your own /etc/betelgeuse/betelgeuse.toml with [worker] api_key_file and tls_cert / tls_key
# (they apply to gRPC and HTTP alike; /health and /metrics stay open), or publish on a trusted network only.
# Health: grpc.health.v1 on the worker's gRPC port (SERVING once the model is loaded); for the store
# container pass --no-healthcheck, or set BETELGEUSE_HEALTH_TARGET=unix:/run/betelgeuse/store.sock.
#
# CUDA: torch's CUDA 13.0 wheels carry the CUDA runtime libraries; the NVIDIA container runtime adds
# the driver's (NVIDIA_* below). Host driver >= 580. For a 570 driver build with
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128. No systemd in the image: sd_notify is
# betelgeuse/sdnotify.py, a no-op without $NOTIFY_SOCKET.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ---- build: a wheel of the package, with the generated gRPC modules ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN pip install grpcio-tools==1.85.1 build==1.3.0
COPY pyproject.toml README.md ./
COPY proto proto
COPY betelgeuse betelgeuse
COPY services services
# generated gRPC modules are part of the wheel, not of the repository
RUN python -m services.codegen --force \
    && python -m build --wheel --outdir /dist .

# ---- runtime: Python, the pinned CUDA build of torch, the wheel ----
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/betelgeuse/.venv \
    && /opt/betelgeuse/.venv/bin/pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=build /dist /dist
RUN /opt/betelgeuse/.venv/bin/pip install /dist/betelgeuse-*.whl \
    && rm -rf /dist \
    && groupadd --system --gid 10001 betelgeuse \
    && useradd --system --uid 10001 --gid betelgeuse --home-dir /var/lib/betelgeuse --create-home --shell /usr/sbin/nologin betelgeuse \
    && install -d -o betelgeuse -g betelgeuse -m 0750 /run/betelgeuse
COPY deploy/betelgeuse.toml /etc/betelgeuse/betelgeuse.toml
RUN sed -i -e 's/"127\.0\.0\.1:/"0.0.0.0:/g' /etc/betelgeuse/betelgeuse.toml
WORKDIR /var/lib/betelgeuse
ENV PATH=/opt/betelgeuse/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    BETELGEUSE_HEALTH_TARGET=127.0.0.1:50051
# numeric, so that the runtime can tell it is not root without reading /etc/passwd
USER 10001:10001
VOLUME ["/run/betelgeuse"]
# gRPC, the HTTP API, worker /metrics, store /metrics
EXPOSE 50051 8000 9464 9465
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel(os.environ['BETELGEUSE_HEALTH_TARGET']); r = g.HealthStub(ch).Check(h.HealthCheckRequest(service=''), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["betelgeuse"]
CMD ["worker", "--config", "/etc/betelgeuse/betelgeuse.toml"]
