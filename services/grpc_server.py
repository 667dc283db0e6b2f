"""The public gRPC server of the worker: InferenceService, grpc.health.v1, reflection.

Thin by design (TGI's server.py): convert with services/convert.py, call the engine, convert back.
One interceptor maps betelgeuse errors to status codes and counts every RPC's outcome.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from betelgeuse.errors import (BetelgeuseError, CancelledError, InvalidRequestError, ModelFormatError,
                               QueueFullError, StoreUnavailableError)
from betelgeuse.worker.api import FinalEvent
from services import convert
from services.pb.betelgeuse.v1 import inference_pb2 as pb
from services.pb.betelgeuse.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("betelgeuse.grpc")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name

STATUS = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreUnavailableError: grpc.StatusCode.UNAVAILABLE,
    CancelledError: grpc.StatusCode.CANCELLED,
    ModelFormatError: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_of(e: BetelgeuseError) -> grpc.StatusCode:
    for cls, code in STATUS.items():
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


class ErrorInterceptor(grpc.ServerInterceptor):
    """BetelgeuseError -> its status code with the message; anything else -> INTERNAL, logged.
    Also counts each InferenceService RPC by method and final code (betelgeuse_requests)."""

    def __init__(self, metrics=None):
        self.metrics = metrics

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        method = details.method.rsplit("/", 1)[-1]

        def count(code: grpc.StatusCode):
            if self.metrics:
                self.metrics.requests.labels(method=method, code=code.name).inc()

        def fail(e, context):
            if isinstance(e, BetelgeuseError):
                code = status_of(e)
                count(code)
                context.abort(code, str(e))
            log.exception("internal error in %s", method)
            count(grpc.StatusCode.INTERNAL)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the worker log")

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                try:
                    r = inner(request, context)
                    count(grpc.StatusCode.OK)
                    return r
                except Exception as e:      # noqa: BLE001 (abort raises; a non-Betelgeuse error is a bug)
                    if type(e).__name__ == "_AbortionException" or isinstance(e, grpc.RpcError):
                        raise
                    fail(e, context)
            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(request, context):
                try:
                    yield from inner_s(request, context)
                    code = grpc.StatusCode.OK
                    if not context.is_active():
                        code = grpc.StatusCode.DEADLINE_EXCEEDED if context.time_remaining() is not None and \
                            context.time_remaining() <= 0 else grpc.StatusCode.CANCELLED
                    count(code)
                except Exception as e:      # noqa: BLE001
                    if type(e).__name__ == "_AbortionException" or isinstance(e, grpc.RpcError):
                        raise
                    fail(e, context)
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
        return handler


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine):
        self.engine = engine

    def Generate(self, request, context):
        req = convert.request_from_pb(request)
        req.request_id = req.request_id or uuid.uuid4().hex
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        handle = self.engine.submit(req, deadline=deadline)
        # a client that goes away (cancel, deadline, disconnect) stops the engine's work on it
        context.add_callback(handle.cancel)
        for ev in handle:
            if isinstance(ev, FinalEvent) and ev.finish_reason == "cancelled" and not context.is_active():
                return
            yield convert.event_to_pb(ev, req.request_id)

    def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=self.engine.tokenize(request.text, request.add_special,
                                                                  request.parse_special))

    def Detokenize(self, request, context):
        return pb.DetokenizeResponse(text=self.engine.detokenize(list(request.token_ids)))

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model=convert.model_info_to_pb(self.engine.model_info()))

    def GetServerInfo(self, request, context):
        return pb.GetServerInfoResponse(server=convert.server_info_to_pb(self.engine.server_info()))


def build_server(engine, addresses: list[str], metrics=None, max_workers: int = 32):
    """A started-later grpc.Server with the service, health and reflection. Returns (server, health, ports)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                         interceptors=[ErrorInterceptor(metrics)])
    pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(engine), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    ports = []
    for addr in addresses:
        if addr.startswith("unix:"):
            import os
            os.makedirs(os.path.dirname(os.path.abspath(addr[5:])), exist_ok=True)
        port = server.add_insecure_port(addr)
        if not addr.startswith("unix:") and port == 0:
            raise BetelgeuseError(f"cannot listen on {addr}")
        ports.append(port)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer, ports


def set_health(health_servicer, serving: bool):
    st = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, st)
