"""The worker's StoreClient over gRPC on a Unix socket, plus the arena fd over a second socket."""

from __future__ import annotations

import os
import socket

import grpc
import numpy as np

from betelgeuse.errors import StoreUnavailableError
from betelgeuse.store.arena import Arena, recv_fd
from betelgeuse.store.plan import SlotPlan
from betelgeuse.store.store import Loaded
from services.pb.betelgeuse.v1 import store_pb2 as pb
from services.pb.betelgeuse.v1 import store_pb2_grpc as pb_grpc


def _unavailable(e: grpc.RpcError) -> StoreUnavailableError:
    code = e.code() if hasattr(e, "code") else None
    detail = (e.details() if hasattr(e, "details") else str(e)) or ""
    # grpc's connection errors are long and repetitive; the first clause says what happened
    detail = detail.split(";")[0].strip()
    return StoreUnavailableError(f"expert store unavailable ({code.name if code else 'error'}): {detail}")


class GrpcStoreClient:
    def __init__(self, socket_path: str, fd_socket_path: str, timeout: float = 30.0):
        self.socket_path, self.fd_socket_path, self.timeout = socket_path, fd_socket_path, timeout
        self.channel = None
        self.stub = None
        self.session = ""

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, timeout=self.timeout, **kw)
        except grpc.RpcError as e:
            raise _unavailable(e) from None

    def attach(self) -> tuple[Arena, SlotPlan]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout)
                s.connect(self.fd_socket_path)
                fd, header = recv_fd(s)
        except OSError as e:
            raise StoreUnavailableError(f"cannot reach the expert store at {self.fd_socket_path}: {e.strerror or e}") from None
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(f"unix:{self.socket_path}")
        self.stub = pb_grpc.ExpertStoreStub(self.channel)
        try:
            reply = self._call(self.stub.Attach, pb.AttachRequest(worker_pid=os.getpid()))
        except BaseException:
            os.close(fd)
            raise
        self.session = reply.session
        return Arena.attach(fd, header["arena_bytes"]), SlotPlan.from_json(reply.layout_json)

    def ping(self) -> dict:
        """The store's status, without attaching (start-up waits on this)."""
        with grpc.insecure_channel(f"unix:{self.socket_path}") as ch:
            try:
                reply = pb_grpc.ExpertStoreStub(ch).Status(pb.StatusRequest(), timeout=5)
            except grpc.RpcError as e:
                raise _unavailable(e) from None
        import json
        return json.loads(reply.json)

    def begin_pass(self) -> int:
        return self._call(self.stub.BeginPass, pb.BeginPassRequest(session=self.session)).epoch

    def load(self, keys):
        req = pb.LoadRequest(session=self.session, experts=[pb.ExpertId(layer=l, expert=e) for l, e in keys])
        try:
            for m in self.stub.Load(req, timeout=max(self.timeout, 600.0)):
                yield Loaded(m.layer, m.expert, m.staging_slot, m.disk_bytes, m.prefetched)
        except grpc.RpcError as e:
            raise _unavailable(e) from None

    def prefetch(self, keys) -> int:
        req = pb.LoadRequest(session=self.session, experts=[pb.ExpertId(layer=l, expert=e) for l, e in keys])
        return self._call(self.stub.Prefetch, req).queued

    def release(self, slots) -> None:
        self._call(self.stub.Release, pb.ReleaseRequest(session=self.session, staging_slots=list(slots)))

    def end_pass(self, usage: np.ndarray, consolidate: bool) -> int:
        L, E = usage.shape
        req = pb.EndPassRequest(session=self.session, n_layer=L, n_expert=E,
                                usage=usage.astype(np.uint32).ravel().tolist(), consolidate=consolidate)
        return self._call(self.stub.EndPass, req).promoted

    def status(self) -> dict:
        import json
        return json.loads(self._call(self.stub.Status, pb.StatusRequest()).json)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
