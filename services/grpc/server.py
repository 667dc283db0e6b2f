"""The public gRPC server of the worker: InferenceService, grpc.health.v1, reflection.

Thin by design (TGI's server.py): convert with services/grpc/convert.py, call the engine, convert back.
One interceptor maps betelgeuse errors to status codes and counts every RPC's outcome.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from betelgeuse.api import FinalEvent
from betelgeuse.errors import BetelgeuseError, InternalError, InvalidRequestError
from services.auth import MISSING, ApiKeys, load_api_keys  # noqa: F401 (load_api_keys: the worker's import)
from services.grpc import convert
from services.pb.betelgeuse.v1 import inference_pb2 as pb
from services.pb.betelgeuse.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("betelgeuse.grpc")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
MAX_REQUEST_ID_BYTES = 256          # request_id is echoed once, in the first streamed message


def status_of(e: BaseException) -> grpc.StatusCode:
    """The gRPC code of an exception, from the one error table (betelgeuse/errors.py); a bug is INTERNAL."""
    return grpc.StatusCode[e.grpc_code if isinstance(e, BetelgeuseError) else InternalError.grpc_code]


class _Undecodable:
    """What a request body that protobuf cannot parse (e.g. invalid UTF-8 in a string) deserializes to."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _tolerant(deserializer, type_name: str):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:                  # noqa: BLE001 (protobuf's DecodeError and friends)
            return _Undecodable(f"the request is not a valid {type_name} message ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else 'undecodable'}; strings must be UTF-8)")
    return deserialize


def _aborted(e: Exception, context) -> bool:
    """Whether `e` is how gRPC ends a call the handler aborted (re-raise it; its status is already set).
    grpc's `context.abort` raises a bare `Exception()` (1.85; `_AbortionException` in older releases) after
    setting the code, so the type alone cannot tell an abort from a bug."""
    return isinstance(e, grpc.RpcError) or type(e).__name__ == "_AbortionException" or \
        (type(e) is Exception and not e.args and context.code() is not None)


class ErrorInterceptor(grpc.ServerInterceptor):
    """BetelgeuseError -> its status code with the message; anything else -> INTERNAL, logged.
    Also counts each InferenceService RPC by method and final code (betelgeuse_requests), refuses
    undecodable bodies with INVALID_ARGUMENT (one log line), and checks API keys when configured
    (metadata `authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time)."""

    def __init__(self, metrics=None, api_keys: list[str] | None = None):
        self.metrics = metrics
        self.api_keys = ApiKeys(api_keys)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        method = details.method.rsplit("/", 1)[-1]

        def count(code: grpc.StatusCode):
            if self.metrics:
                self.metrics.requests.labels(method=method, code=code.name).inc()

        denied = not self.api_keys.authorized(details.invocation_metadata)
        in_type = getattr(handler.request_deserializer, "__self__", None)
        deser = _tolerant(handler.request_deserializer, getattr(in_type, "__name__", "request"))

        def refuse(request, context) -> bool:
            """Abort for a missing key or an undecodable body (both counted); False when the call may go on."""
            if denied:
                count(grpc.StatusCode.UNAUTHENTICATED)
                context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING.replace("send ", "send metadata "))
            if isinstance(request, _Undecodable):
                log.warning("%s: %s (peer %s)", method, request.why, context.peer())
                count(grpc.StatusCode.INVALID_ARGUMENT)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return False

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
                refuse(request, context)
                try:
                    r = inner(request, context)
                    count(grpc.StatusCode.OK)
                    return r
                except Exception as e:      # noqa: BLE001 (abort raises; a non-Betelgeuse error is a bug)
                    if _aborted(e, context):
                        count(context.code() or grpc.StatusCode.UNKNOWN)
                        raise
                    fail(e, context)
            return grpc.unary_unary_rpc_method_handler(unary, deser, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(request, context):
                refuse(request, context)
                try:
                    yield from inner_s(request, context)
                    code = context.code() or grpc.StatusCode.OK     # a handler may end with set_code
                    if code == grpc.StatusCode.OK and not context.is_active():
                        code = grpc.StatusCode.DEADLINE_EXCEEDED if context.time_remaining() is not None and \
                            context.time_remaining() <= 0 else grpc.StatusCode.CANCELLED
                    count(code)
                except Exception as e:      # noqa: BLE001
                    if _aborted(e, context):
                        count(context.code() or grpc.StatusCode.UNKNOWN)
                        raise
                    fail(e, context)
            return grpc.unary_stream_rpc_method_handler(stream, deser, handler.response_serializer)
        return handler


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine):
        self.engine = engine

    def Generate(self, request, context):
        if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise InvalidRequestError(f"request_id is {len(request.request_id.encode())} bytes, over the limit of "
                                      f"{MAX_REQUEST_ID_BYTES}")
        req = convert.request_from_pb(request)
        req.request_id = req.request_id or uuid.uuid4().hex
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        handle = self.engine.submit(req, deadline=deadline)
        # a client that goes away (cancel, deadline, disconnect) stops the engine's work on it
        context.add_callback(handle.cancel)
        rid = req.request_id                      # sent once, in the first message
        for ev in handle:
            if isinstance(ev, FinalEvent) and ev.finish_reason == "cancelled":
                if not context.is_active():
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    # the engine ended it at the deadline (the same instant as gRPC's, read a hair earlier): the
                    # client is told DEADLINE_EXCEEDED either way, never an OK stream cut short
                    context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                    context.set_details("request deadline exceeded")
                    return
            yield convert.event_to_pb(ev, rid)
            rid = ""

    def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=self.engine.tokenize(request.text, request.add_special,
                                                                  request.parse_special))

    def Detokenize(self, request, context):
        return pb.DetokenizeResponse(text=self.engine.detokenize(list(request.token_ids)))

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model=convert.model_info_to_pb(self.engine.model_info()))

    def GetServerInfo(self, request, context):
        return pb.GetServerInfoResponse(server=convert.server_info_to_pb(self.engine.server_info()))


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise BetelgeuseError(f"{what} {path}: {e.strerror or e}") from None


def server_credentials(cert: str, key: str, client_ca: str = ""):
    """grpc.ssl_server_credentials from PEM files (client_ca: require and verify client certificates)."""
    if bool(cert) != bool(key):
        raise BetelgeuseError("TLS needs both tls_cert and tls_key")
    ca = _read(client_ca, "tls_client_ca") if client_ca else None
    return grpc.ssl_server_credentials([(_read(key, "tls_key"), _read(cert, "tls_cert"))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def build_server(engine, addresses: list[str], metrics=None, max_workers: int = 32, api_keys: list[str] | None = None,
                 tls=None, max_request_bytes: int = 4 << 20):
    """A started-later grpc.Server with the service, health and reflection. Returns (server, health, ports).

    Ports are bound exclusively (no SO_REUSEPORT: a second server on a busy port fails here, naming it,
    instead of splitting connections between two processes). `tls` (grpc.ServerCredentials) applies to
    TCP addresses; unix: sockets stay plain (local, guarded by file modes)."""
    options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", int(max_request_bytes)),
               ("grpc.max_send_message_length", 64 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                         interceptors=[ErrorInterceptor(metrics, api_keys)], options=options)
    pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(engine), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    ports = []
    for addr in addresses:
        if addr.startswith("unix:"):
            os.makedirs(os.path.dirname(os.path.abspath(addr[5:])), exist_ok=True)
        try:
            port = server.add_secure_port(addr, tls) if tls is not None and not addr.startswith("unix:") \
                else server.add_insecure_port(addr)
        except RuntimeError:
            port = 0
        if port == 0:
            raise BetelgeuseError(f"cannot listen on {addr}: the address is in use or not available")
        ports.append(port)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer, ports


def set_health(health_servicer, serving: bool):
    """Safe from any thread (the engine calls it the moment the store goes away or comes back)."""
    st = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, st)
