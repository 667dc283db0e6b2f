#!/usr/bin/env python3
"""The session reader's work an answer, main vs host62 (services/grpc/session_seq.receiver; issue 21, cpu-host62): the
thread's CPU µs a datagram reading 32-byte datagrams already queued on a SOCK_SEQPACKET pair (no wakeups: the
syscall and the Python around it) with recvmsg_into([buf]) + its flags (main) and recv_into(buf, n, MSG_TRUNC)
(host62), each copied out as bytes; and a Condition's notify_all with no waiter (main: every routed answer) against
the waiters counter's test (host62). Medians of 7 rounds.

    python3 docs/benchmarks/cpu-host62/recv_micro.py
"""
import socket
import statistics
import threading
import time

MAX = 1 << 20
N = 200                    # datagrams a round (within the pair's queue: the sender does not block)


def old(sock, n):
    buf = bytearray(MAX)
    view = memoryview(buf)
    for _ in range(n):
        k, _, flags, _ = sock.recvmsg_into([buf])
        if flags & socket.MSG_TRUNC:
            raise RuntimeError("truncated")
        bytes(view[:k])


def new(sock, n):
    buf = bytearray(MAX)
    view = memoryview(buf)
    recv = sock.recv_into
    for _ in range(n):
        k = recv(buf, MAX, socket.MSG_TRUNC)
        if k > MAX:
            raise RuntimeError("truncated")
        bytes(view[:k])


res: dict = {"recvmsg_into (main)": [], "recv_into MSG_TRUNC (host62)": []}
for _ in range(7):
    for name, fn in zip(res, (old, new)):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        a.setblocking(False)
        for _ in range(N):
            a.send(b"x" * 32)
        t = time.thread_time()
        fn(b, N)
        res[name].append((time.thread_time() - t) / N * 1e6)
        a.close()
        b.close()
print({k: round(statistics.median(v), 2) for k, v in res.items()}, "µs a datagram (thread CPU)")

lock = threading.RLock()
cv = threading.Condition(lock)
waiting = 0
M = 100000
a_us, b_us = [], []
for _ in range(7):
    t = time.thread_time()
    for _ in range(M):
        with lock:
            cv.notify_all()
    a_us.append((time.thread_time() - t) / M * 1e6)
    t = time.thread_time()
    for _ in range(M):
        with lock:
            if waiting:
                cv.notify_all()
    b_us.append((time.thread_time() - t) / M * 1e6)
print(f"an answer's lock + notify_all with no waiter (main): {statistics.median(a_us):.2f} µs; "
      f"lock + the counter's test (host62): {statistics.median(b_us):.2f} µs")
