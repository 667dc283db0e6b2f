"""schemathesis fuzzes the HTTP API from the server's own OpenAPI schema (/openapi.json): valid and invalid
bodies for every operation, a bounded number of examples each. Invariants: never a 5xx, every error is OpenAI's
JSON error body, the responses conform to the schema's status codes, and afterwards the server is healthy and
still gives the reference tokens. The worker runs with a 64-token context so that no example runs long."""

from __future__ import annotations

import json
import urllib.request

import pytest

try:
    from tests import service_helpers as h
except ImportError:  # tests/ itself is on sys.path
    import service_helpers as h
service_model = h.service_model

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

EXAMPLES = 15           # per operation and generation mode (12 operations x 2 modes): ~30 s on 2 cores


@pytest.fixture(scope="module")
def cluster(service_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    cfg = h.write_toml(d / "betelgeuse.toml", {"engine": {"max_context": 64, "max_queue": 64}})
    c = h.start_cluster(service_model, d, config=cfg, http="auto")
    yield c
    c.stop()


def _check(case, resp):
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance
    case.validate_response(resp, checks=[not_a_server_error, status_code_conformance])
    if resp.status_code >= 400:
        body = resp.json()
        if case.path.startswith("/v1/messages"):                 # Anthropic's shape there
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in resp.text


def test_fuzz_no_5xx_and_json_errors(cluster):
    """Every operation of /openapi.json, positive and negative bodies (schemathesis' strategies driven by hypothesis
    directly: its pytest plugin does not load under pytest 9)."""
    from hypothesis import given
    from hypothesis.errors import Unsatisfiable
    api = schemathesis.openapi.from_url(cluster.http_url + "/openapi.json")
    ops = [r.ok() for r in api.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in ops} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health", "POST /tokenize"}
    served = json.loads(urllib.request.urlopen(cluster.http_url + "/v1/models", timeout=10).read())["data"][0]["id"]
    calls = []
    for op in ops:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.explicit, Phase.generate], derandomize=True, database=None)
            def run(case):
                if mode == schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = served          # else nearly every valid body is a 404 for its model name
                resp = case.call(timeout=60)
                calls.append(resp.status_code)
                _check(case, resp)
            try:
                run()
            except Unsatisfiable:
                # no invalid input exists for an operation without parameters (GET /v1/models, /health)
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.path
    print("fuzz statuses:", {c: calls.count(c) for c in set(calls)})
    assert len(calls) >= len(ops) * 4 and any(c == 200 for c in calls) and any(c == 400 for c in calls)


@pytest.fixture
def queue1(service_model, tmp_path):
    cfg = h.write_toml(tmp_path / "betelgeuse.toml", {"engine": {"max_running": 1, "max_queue": 1}})
    c = h.start_cluster(service_model, tmp_path, config=cfg, http="auto")
    yield c
    c.stop()


def test_queue_full_is_429_and_a_disconnect_cancels(queue1):
    """One running + one waiting request fill this worker (max_running = max_queue = 1): the next gets 429 with
    OpenAI's rate-limit body. Closing the streams cancels both in the engine (the metrics say so)."""
    import http.client
    import time
    cluster = queue1
    served = json.loads(urllib.request.urlopen(cluster.http_url + "/v1/models", timeout=10).read())["data"][0]["id"]
    host, port = cluster.http.rsplit(":", 1)
    body = json.dumps({"model": served, "prompt": "Hi", "ignore_eos": True, "stream": True, "temperature": 0})
    before = h.scrape(cluster.worker_metrics_url)
    conns = []
    for _ in range(2):
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        conns.append(c)
        time.sleep(0.3)
    r0 = conns[0].getresponse()
    assert r0.status == 200 and r0.readline().startswith(b"data: ")      # the first is streaming
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    deadline = time.monotonic() + 20
    while True:                                                          # the second waits in the queue
        c.request("POST", "/v1/completions", body.replace('"stream": true', '"stream": false'),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status == 429 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status == 429, (r.status, data[:200])
    err = json.loads(data)["error"]
    assert err["type"] == "rate_limit_error" and "queue is full" in err["message"]
    for x in conns + [c]:
        x.close()
    after = h.wait_metric(cluster.worker_metrics_url, lambda s: h.delta(
        before, s, "betelgeuse_requests_finished_total", finish_reason="cancelled") >= 2, timeout=30)
    assert h.delta(before, after, "betelgeuse_requests_finished_total", finish_reason="cancelled") >= 2
    assert h.delta(before, after, "betelgeuse_requests_total", method="Completions", code="RESOURCE_EXHAUSTED") >= 1


def test_healthy_and_still_correct_afterwards(cluster, service_model):
    with urllib.request.urlopen(cluster.http_url + "/health", timeout=10) as r:
        assert r.status == 200
    tok = h.reference_tokenizer(service_model)
    ids = tok.encode("The river ran low")
    want, _, text = h.reference_greedy(service_model, ids, 8, ignore_eos=True)
    body = json.dumps({"model": "x", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    models = json.loads(urllib.request.urlopen(cluster.http_url + "/v1/models", timeout=10).read())
    body = body.replace('"x"', json.dumps(models["data"][0]["id"]))
    req = urllib.request.Request(cluster.http_url + "/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    assert out["choices"][0]["text"] == text
    assert "Traceback" not in cluster.worker.log()
