"""Issue 9, items 8 and 12 with a real store + worker: optional API keys (metadata, constant-time comparison) and
TLS on the TCP listener, both from the configuration file; and SIGTERM draining for the configured grace — new
work refused, a short stream finishes, a long one ends with a final message (finish_reason CANCELLED), exit 0.
Issue 25, item 1: the same keys and TLS on the HTTP API (every path but /health and /metrics, both headers, in
each API's error shape), and the project's own clients sending them (`betelgeuse generate --server --api-key`,
BETELGEUSE_API_KEY, `--tls-ca`; `betelgeuse chat --api-key`).

The worker listens on TLS TCP and on a plain unix: socket (local, guarded by file modes); health is not
behind the key (load balancers and systemd probes have none). The certificate is made here by `openssl`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

import service_helpers as h
from services.pb.betelgeuse.v1 import inference_pb2 as pb

service_model = h.service_model
KEY = "s3cret-key-for-tests"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    (d / "keys.txt").write_text(f"# API keys\n{KEY}\n")
    return d


@pytest.fixture(scope="module")
def cluster(service_model, certs, tmp_path_factory):
    d = tmp_path_factory.mktemp("secure")
    cfg = h.write_toml(d / "betelgeuse.toml", {"worker": {
        "api_key_file": str(certs / "keys.txt"), "tls_cert": str(certs / "cert.pem"), "tls_key": str(certs / "key.pem"),
        "drain_grace": 3}})
    unix = f"unix:{d / 'run' / 'api.sock'}"
    c = h.start_cluster(service_model, d / "run", cfg, extra_worker_args=["--listen", unix], health_address=unix,
                        http="auto")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tls_channel(cluster, certs):
    creds = grpc.ssl_channel_credentials(root_certificates=(certs / "cert.pem").read_bytes())
    with grpc.secure_channel(cluster.address, creds) as ch:
        yield ch


def _gen(ch, metadata=None, n=4, **kw):
    call = h.stub(ch).Generate(h.request(ids=[5, 6, 7, 8], max_tokens=n, ignore_eos=True), timeout=60,
                               metadata=metadata, **kw)
    return h.run_stream(call)


def test_api_key_is_required(cluster, tls_channel, service_model):
    want = h.reference_greedy(service_model, [5, 6, 7, 8], 4, ignore_eos=True)[0]
    for md in (None, [("authorization", "Bearer wrong")], [("x-api-key", KEY[:-1])], [("authorization", KEY)]):
        r = _gen(tls_channel, md)
        assert r.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in r.details, (md, r.code)
        with pytest.raises(grpc.RpcError) as e:
            h.stub(tls_channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for md in ([("authorization", f"Bearer {KEY}")], [("x-api-key", KEY)]):
        r = _gen(tls_channel, md)
        assert r.code is None and r.tokens == want, (r.code, r.details)
    assert h.health_status(tls_channel) == SERVING                    # health needs no key
    s = h.scrape(cluster.worker_metrics_url)
    assert h.value(s, "betelgeuse_requests_total", method="Generate", code="UNAUTHENTICATED") == 4


def test_plaintext_is_refused_on_the_tls_port(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            h.health_status(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def _https(cluster, certs, path: str, body=None, headers=None):
    """(status, parsed JSON or text) of one HTTPS request to the worker's HTTP API, verified against the test CA."""
    ctx = ssl.create_default_context(cafile=str(certs / "cert.pem"))
    req = urllib.request.Request(f"https://{cluster.http}{path}", data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


HTTP_CALLS = [("/v1/chat/completions", {"model": "service-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
              ("/v1/completions", {"model": "service-tiny", "max_tokens": 2, "prompt": "Hi"}),
              ("/v1/messages", {"model": "service-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
              ("/v1/messages/count_tokens", {"model": "service-tiny", "messages": [{"role": "user", "content": "Hi"}]}),
              ("/v1/responses", {"model": "service-tiny", "max_output_tokens": 2, "input": "Hi"}),
              ("/tokenize", {"content": "Hi"}), ("/detokenize", {"tokens": [5, 6]}), ("/v1/models", None),
              ("/v1/responses/resp_nothing", None), ("/openapi.json", None)]


def test_http_api_needs_a_key_and_speaks_tls(cluster, certs):
    """Issue 25 item 1. Before: with keys configured, gRPC answered UNAUTHENTICATED but every HTTP path answered 200
    with no key or a wrong one, over plain HTTP."""
    for path, body in HTTP_CALLS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            st, got = _https(cluster, certs, path, body, headers)
            assert st == 401, (path, headers, st, got)
            if path.startswith("/v1/messages"):
                assert got == {"type": "error", "error": {"type": "authentication_error", "message":
                                                          got["error"]["message"]}}, got
            else:
                assert got["error"]["type"] == "authentication_error", got
            assert "API key" in got["error"]["message"]
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            st, got = _https(cluster, certs, path, body, headers)
            assert st == (404 if "resp_nothing" in path else 200), (path, headers, st, got)
    for path in ("/health", "/metrics"):                            # open, for probes and Prometheus
        st, _ = _https(cluster, certs, path)
        assert st == 200, path
    s = h.scrape(cluster.worker_metrics_url)
    assert h.value(s, "betelgeuse_requests_total", method="ChatCompletions", code="UNAUTHENTICATED") == 5
    with pytest.raises(Exception):                                 # plain HTTP on the TLS port: no answer
        urllib.request.urlopen(f"http://{cluster.http}/health", timeout=10)


def _cli(*args, env=None):
    from services.launcher import python_env
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=120,
                          env=python_env(**(env or {})))


def test_the_clients_send_the_key(cluster, certs):
    """Issue 25 item 1. Before: `betelgeuse generate --api-key` was an unrecognized argument and services/grpc/client.py
    sent no credentials, so the project's own clients could not talk to a server with keys."""
    gen = ["generate", "--server", cluster.address, "--tls-ca", str(certs / "cert.pem"), "--token-ids", "5,6,7,8",
           "--max-tokens", "4", "--ignore-eos"]
    r = _cli(*gen, "--api-key", KEY)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    want = r.stdout
    r = _cli(*gen, env={"BETELGEUSE_API_KEY": KEY})
    assert r.returncode == 0 and r.stdout == want, r.stderr
    r = _cli(*gen, "--api-key", "wrong")
    assert r.returncode == 2 and "UNAUTHENTICATED" in r.stderr and "Traceback" not in r.stderr, r.stderr
    chat = ["chat", "--url", f"https://{cluster.http}", "--max-tokens", "2", "--temperature", "0"]
    tls = {"SSL_CERT_FILE": str(certs / "cert.pem")}
    from services.launcher import python_env
    ok = subprocess.run([sys.executable, "-m", "services.cli", *chat, "--api-key", KEY], input="Hi\n",
                        capture_output=True, text=True, timeout=120, env=python_env(**tls))
    assert ok.returncode == 0 and ok.stdout.strip() and "error" not in ok.stderr, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "services.cli", *chat], input="Hi\n", capture_output=True,
                         text=True, timeout=120, env={k: v for k, v in python_env(**tls).items()
                                                      if k != "BETELGEUSE_API_KEY"})
    assert bad.returncode == 2 and "HTTP 401" in bad.stderr, bad.stderr


def test_sigterm_drains_then_cancels_cleanly(cluster, tls_channel):
    """Before: SIGTERM stopped the server with a hard-coded 5 s grace; longer streams ended UNAVAILABLE with no
    final message. Now (drain_grace = 3 s here): health NOT_SERVING and new work UNAVAILABLE at once, a short
    stream finishes, the long one gets its final message (CANCELLED) and OK, and the worker exits 0."""
    md = [("x-api-key", KEY)]
    out = {}

    def run(name, n):
        out[name] = _gen(tls_channel, md, n=n)
    long_t = threading.Thread(target=run, args=("long", 1900))
    long_t.start()
    time.sleep(1.5)
    short_t = threading.Thread(target=run, args=("short", 40))
    short_t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    cluster.worker.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    r = _gen(tls_channel, md)
    assert r.code == grpc.StatusCode.UNAVAILABLE, (r.code, r.details)
    long_t.join(30)
    short_t.join(30)
    assert out["short"].code is None and out["short"].final.finish_reason == pb.FINISH_REASON_LENGTH, out["short"]
    lg = out["long"]
    assert lg.code is None, (lg.code, lg.details)
    assert lg.final is not None and lg.final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert list(lg.final.token_ids) == lg.tokens and 0 < len(lg.tokens) < 1900
    assert cluster.worker.popen.wait(30) == 0
    assert 2.5 < time.monotonic() - t0 < 20
