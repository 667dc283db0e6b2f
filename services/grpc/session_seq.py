"""The session stream's second transport (issue 21): store.proto's SessionRequest / SessionEvent, one protobuf
message per datagram, on an AF_UNIX SOCK_SEQPACKET connection between the worker and the store.

Why: on gRPC each message crosses three of its Python threads (the request iterator's consumer, the completion
queue's, the servicer's reader): ~290-320 µs a round trip on a 2-core CPU against ~37 µs for a bare SEQPACKET round
trip (deploy/device/store_messages.py), and a device decode spends ~1.3 ms of each disk idle gap in those hops
(docs/benchmarks/gpu-run54-ds4). SEQPACKET keeps message boundaries and order, is connection-oriented (EOF when the
store dies) and a send is atomic, so several threads may send on it without framing or a lock.

Where: its own listening socket beside the gRPC one (session_path: the control socket's path + ".seq"), made and
checked as the others are (0600 / 0660 with socket_group, SO_PEERCRED on accept). A connection of its own (not a
socketpair handed over with the arena fd) because the worker re-opens the stream after a failure (a deadline, a
restarted store) without a new Attach, as it re-opens the gRPC call; the requests carry the session id, checked by
the store as on gRPC. Only the session stream moves: Attach, BeginPass, EndPass... stay gRPC.

Size: a datagram must fit the sender's SO_SNDBUF (the kernel refuses a larger one with EMSGSIZE). Both ends ask
for BUF_BYTES (the kernel caps it at net.core.wmem_max, 208 KiB by default, and doubles it); the sender refuses a
message over limit() with MessageTooBig, before sending (no fallback to gRPC: a message on another stream could
overtake or be overtaken by this one's, and the store relies on their order). The largest real message is a load
of every expert of the model in one request (~7 B an expert: 61 layers x 384 experts = 23424 -> ~165 KB), under
the 200 KB a default-capped buffer allows (tests/worker/test_store_stream.py checks it).
"""

from __future__ import annotations

import socket

from betelgeuse.errors import BetelgeuseError

BUF_BYTES = 4 << 20          # SO_SNDBUF / SO_RCVBUF asked for (the kernel caps it at wmem_max / rmem_max)
MAX_BYTES = 1 << 20          # the largest datagram either end sends or reads (its receive buffer's size)
_OVERHEAD = 1024             # bytes of the send buffer the kernel keeps for itself (it refuses len > sndbuf - 32)


class MessageTooBig(BetelgeuseError):
    """A session message over the SEQPACKET datagram limit (refused before it is sent; nothing else fails)."""


def session_path(socket_path: str) -> str:
    """The store's SEQPACKET session socket beside its gRPC control socket `socket_path`."""
    return f"{socket_path}.seq"


def tune(sock: socket.socket) -> int:
    """Ask for BUF_BYTES of send and receive buffer -> the largest message this end may send (bytes)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUF_BYTES)
        except OSError:
            pass                                  # the default stays (and limit() says what it allows)
    return min(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - _OVERHEAD, MAX_BYTES)


def check_size(n: int, limit: int, what: str = "session message"):
    if n > limit:
        raise MessageTooBig(f"a {what} of {n} bytes is over the SOCK_SEQPACKET session socket's {limit}-byte "
                            "datagram limit (its SO_SNDBUF, capped by net.core.wmem_max); send fewer experts a "
                            "request, raise net.core.wmem_max, or set store.session_transport = \"grpc\"")


class Reader:
    """One end's reads of whole datagrams from `sock` into one buffer of MAX_BYTES, each parse(bytes-like) ->
    message. A datagram larger than MAX_BYTES (truncated by the kernel) raises MessageTooBig."""

    __slots__ = ("sock", "parse", "buf", "view")

    def __init__(self, sock: socket.socket, parse):
        self.sock, self.parse = sock, parse
        self.buf = bytearray(MAX_BYTES)
        self.view = memoryview(self.buf)

    def read(self, flags: int = 0):
        """The next message, or None at EOF (the peer closed or died). flags: socket.MSG_DONTWAIT reads without a
        wait (none queued: BlockingIOError)."""
        # MSG_TRUNC: the datagram's whole length, also where it was longer than the buffer (Linux's AF_UNIX), so a
        # truncated one reads n > limit; recv_into, not recvmsg_into: no list, flags tuple or control buffer an answer
        # (the reader thread's, issue 21, cpu-host62)
        n = self.sock.recv_into(self.buf, MAX_BYTES, socket.MSG_TRUNC | flags)
        if not n:
            return None
        if n > MAX_BYTES:
            raise MessageTooBig(f"a session message over {MAX_BYTES} bytes arrived truncated")
        return self.parse(bytes(self.view[:n]))     # a copy: the buffer is reused for the next one


def receiver(sock: socket.socket, parse):
    """The messages read from `sock` (Reader), each parse(bytes-like) -> message, until EOF (the peer closed or
    died)."""
    read = Reader(sock, parse).read
    while (m := read()) is not None:
        yield m
