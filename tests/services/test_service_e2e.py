"""The service end to end: a real store process and a real worker process (one pair for this module),
real gRPC over loopback TCP, the worker's real /metrics. Tokens are checked against the in-process
reference model (`betelgeuse generate --engine reference`), metrics against the final message's usage,
model info against gguf's own reader."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

try:
    from tests import service_helpers as h
except ImportError:  # tests/ itself is on sys.path
    import service_helpers as h
service_model = h.service_model  # the session fixture, under its name in this module

from betelgeuse import __version__
from services.pb.betelgeuse.v1 import inference_pb2 as pb

LONG = 1500          # max_tokens of the cancelled and expiring calls: ~15 s of decode on 2 cores, never reached
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "cancelled"}


@pytest.fixture(scope="module")
def cluster(service_model, tmp_path_factory):
    c = h.start_cluster(service_model, tmp_path_factory.mktemp("e2e"))
    yield c
    c.stop()


channel = h.channel


def encode(model, text):
    return h.reference_tokenizer(model).encode(text, add_special=False)


def test_health_and_reflection(channel):
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    assert h.health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert h.health_status(channel, h.SERVICE) == health_pb2.HealthCheckResponse.SERVING
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {h.SERVICE, "grpc.health.v1.Health"} <= services, services
    # the served descriptor (not our local copy) names every RPC
    from google.protobuf.descriptor_pool import DescriptorPool
    sd = DescriptorPool(db).FindServiceByName(h.SERVICE)
    assert {m.name for m in sd.methods} == {"Generate", "Tokenize", "Detokenize", "GetModelInfo", "GetServerInfo"}
    assert sd.methods_by_name["Generate"].output_type.full_name == "betelgeuse.v1.GenerateResponse"


def test_greedy_generate_matches_reference_and_metrics(cluster, channel, service_model):
    text, n = "The river ran low that summer", 12
    ids = encode(service_model, text)
    want, _, want_text = h.reference_greedy(service_model, ids, n, ignore_eos=True)
    before = h.scrape(cluster.worker_metrics_url)
    got = h.run_stream(h.stub(channel).Generate(h.request(text=text, max_tokens=n, ignore_eos=True), timeout=60))
    assert got.code is None, got.details
    assert got.tokens == want
    f = got.final
    assert list(f.token_ids) == want and FINISH[f.finish_reason] == "length"
    assert "".join(got.texts) + f.tail == f.text == want_text
    u = f.usage
    assert u.prompt_n == len(ids) and u.predicted_n == n
    assert u.prompt_ms > 0 and u.predicted_ms > 0 and u.ttft_ms >= u.prompt_ms
    # the request's own clock over gRPC: queue (arrival -> admission) + prefill (admission -> first token) = TTFT
    assert 0 <= u.queue_ms and u.queue_ms + u.prompt_ms == pytest.approx(u.ttft_ms, abs=50.0) and u.cached_tokens == 0
    assert u.prompt_per_second == pytest.approx(u.prompt_n / (u.prompt_ms / 1e3), rel=1e-6)
    # decode passes produce tokens 2..n: the first comes out of the prefill pass
    assert u.predicted_per_second == pytest.approx((n - 1) / (u.predicted_ms / 1e3), rel=1e-6)

    after = h.wait_metric(cluster.worker_metrics_url, lambda s: h.delta(
        before, s, "betelgeuse_requests_total", method="Generate", code="OK") >= 1)
    d = lambda name, **kw: h.delta(before, after, name, **kw)  # noqa: E731
    assert d("betelgeuse_requests_total", method="Generate", code="OK") == 1
    assert d("betelgeuse_requests_finished_total", finish_reason="length") == 1
    assert d("betelgeuse_prompt_tokens_total") == u.prompt_n
    # the generation-token counter counts decode-pass tokens: n - 1 for a request that ends by length
    assert d("betelgeuse_generation_tokens_total") == u.predicted_n - 1
    for tier in ("vram", "host", "disk"):
        assert d("betelgeuse_expert_reads_total", tier=tier) == getattr(u, f"expert_reads_{tier}"), tier
    assert u.expert_reads_vram + u.expert_reads_host + u.expert_reads_disk > 0
    # usage times are the request's own clock (admission -> first token, first -> last token, as the client saw
    # them); the busy counters are the passes alone: never more, and most of it for a request running alone
    # (tokens are sampled and streamed between the passes)
    for phase, ms in (("prefill", u.prompt_ms), ("decode", u.predicted_ms)):
        busy = d("betelgeuse_engine_busy_seconds_total", phase=phase)
        assert 0.3 * ms / 1e3 < busy <= ms / 1e3 + 1e-6, (phase, busy, ms)
    assert d("betelgeuse_disk_wait_seconds_total") == pytest.approx(u.disk_wait_ms / 1e3, rel=1e-6, abs=1e-9)
    assert d("betelgeuse_host_to_device_bytes_total") == u.h2d_bytes
    assert d("betelgeuse_request_prompt_tokens_sum") == u.prompt_n
    assert d("betelgeuse_request_generation_tokens_sum") == u.predicted_n
    assert d("betelgeuse_time_to_first_token_seconds_count") == 1
    assert d("betelgeuse_inter_token_latency_seconds_count") == n - 1
    # the freeze once ready collected in full first, and the worker's own hook timed it (betelgeuse/gc_pauses.py)
    assert h.value(after, "betelgeuse_gc_pause_seconds_count", generation="2") >= 1
    assert h.value(after, "betelgeuse_gc_pause_seconds_sum", generation="2") > 0
    assert "gc_frozen" in h.cluster_logs(cluster)


def test_token_id_prompt_matches_reference(channel, service_model):
    ids = [5, 77, 300, 12, 999, 41]
    want, reason, _ = h.reference_greedy(service_model, ids, 10)
    got = h.run_stream(h.stub(channel).Generate(h.request(ids=ids, max_tokens=10), timeout=60))
    assert got.code is None, got.details
    assert got.tokens == want and FINISH[got.final.finish_reason] == reason
    assert got.final.usage.prompt_n == len(ids)


def test_chat_messages_use_the_gguf_template(channel, service_model):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."}]
    # render with jinja2 straight from the file's tokenizer.chat_template (read by gguf's reader)
    template = h.gguf_metadata(service_model)["tokenizer.chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(template).render(messages=msgs, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and rendered.endswith("assistant\n")
    ids = encode(service_model, rendered)
    want, reason, _ = h.reference_greedy(service_model, ids, 10)
    got = h.run_stream(h.stub(channel).Generate(h.request(messages=msgs, max_tokens=10), timeout=60))
    assert got.code is None, got.details
    assert got.final.usage.prompt_n == len(ids)
    assert got.tokens == want and FINISH[got.final.finish_reason] == reason


def test_tokenize_detokenize_round_trip(channel, service_model):
    s = h.stub(channel)
    text = "A mixture of experts chooses, for every token, a few experts. Ünïcödé ✓"
    ids = list(s.Tokenize(pb.TokenizeRequest(text=text), timeout=10).token_ids)
    assert ids == encode(service_model, text) and len(ids) > 5
    assert s.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text == text
    # special tokens written in the text are single tokens only when asked (parse_special); by default text is
    # plain text (tests/services/test_http_api.py::test_user_text_cannot_forge_control_tokens)
    sp = list(s.Tokenize(pb.TokenizeRequest(text="<|im_start|>user", parse_special=True), timeout=10).token_ids)
    assert len(sp) >= 2 and s.Detokenize(pb.DetokenizeRequest(token_ids=sp[1:]), timeout=10).text == "user"


def test_model_info_matches_the_file(channel, service_model):
    mi = h.stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model
    md = h.gguf_metadata(service_model)
    arch = md["general.architecture"]
    assert mi.arch == arch == "qwen3moe"
    assert mi.path == str(service_model)
    assert mi.n_layer == md[f"{arch}.block_count"]
    assert mi.n_embd == md[f"{arch}.embedding_length"]
    assert mi.n_head == md[f"{arch}.attention.head_count"]
    assert mi.n_head_kv == md[f"{arch}.attention.head_count_kv"]
    assert mi.n_expert == md[f"{arch}.expert_count"]
    assert mi.n_expert_used == md[f"{arch}.expert_used_count"]
    assert mi.n_ff_exp == md[f"{arch}.expert_feed_forward_length"]
    assert mi.context_length == md[f"{arch}.context_length"]
    assert mi.n_vocab == md["tokenizer.ggml.tokens"]
    tensors = md["__tensors__"]
    exps = [tensors[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")]
    assert mi.expert_bytes * mi.n_expert == sum(nb for nb, _ in exps)
    assert mi.quant == exps[0][1] == "Q8_0"
    assert mi.vram_slots_per_layer + mi.host_slots_per_layer > 0
    assert mi.schedule in ("layer_major", "standard") and mi.sub_batch > 0


def test_server_info(channel):
    s = h.stub(channel)
    a = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server
    time.sleep(0.2)
    b = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server
    assert a.version == __version__ and a.device == "cpu" and a.store_attached
    assert a.queue_depth == 0 and a.active_requests == 0
    assert a.memory["arena"] > 0 and a.slots_used["host"] > 0   # earlier passes left experts in host slots
    assert b.uptime_s >= a.uptime_s + 0.15


def test_concurrent_clients_with_cancel_and_deadline(cluster, channel, service_model):
    """Three normal clients, one cancelled after 2 tokens and one whose deadline expires mid-stream,
    all at once: the normal ones get exactly the tokens they get alone (the reference), and the engine
    stops working on the other two (finished as cancelled; the token counter stops)."""
    s = h.stub(channel)
    prompts = ["The old iron bell", "Each expert is a feed-forward network", "They found coins"]
    n = 10
    wants = [h.reference_greedy(service_model, encode(service_model, p), n, ignore_eos=True)[0] for p in prompts]
    before = h.scrape(cluster.worker_metrics_url)
    results: dict[str, h.Streamed] = {}

    def normal(i):
        results[f"n{i}"] = h.run_stream(s.Generate(h.request(text=prompts[i], max_tokens=n, ignore_eos=True),
                                                   timeout=120))

    def cancelled():
        call = s.Generate(h.request(text="A blue bottle", max_tokens=LONG, ignore_eos=True), timeout=120)
        results["cancel"] = h.run_stream(call, on_token=lambda st: len(st.tokens) >= 2 and call.cancel())

    def deadline():
        results["deadline"] = h.run_stream(s.Generate(h.request(text="The hard part is memory", max_tokens=LONG,
                                                                ignore_eos=True), timeout=2.0))

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=cancelled), threading.Thread(target=deadline)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, want in enumerate(wants):
        r = results[f"n{i}"]
        assert r.code is None, r.details
        assert r.tokens == want == list(r.final.token_ids), i
    assert results["cancel"].code == grpc.StatusCode.CANCELLED and len(results["cancel"].tokens) >= 2
    assert results["deadline"].code == grpc.StatusCode.DEADLINE_EXCEEDED, results["deadline"].details
    assert len(results["deadline"].tokens) >= 1                     # it expired mid-stream, not in the queue

    after = h.wait_metric(cluster.worker_metrics_url, lambda x: h.delta(
        before, x, "betelgeuse_requests_finished_total", finish_reason="cancelled") >= 2)
    assert h.delta(before, after, "betelgeuse_requests_finished_total", finish_reason="cancelled") == 2
    assert h.delta(before, after, "betelgeuse_requests_finished_total", finish_reason="length") == 3
    time.sleep(1.0)
    later = h.scrape(cluster.worker_metrics_url)
    assert h.value(later, "betelgeuse_requests_running") == 0 and h.value(later, "betelgeuse_requests_waiting") == 0
    # nothing is generated once the calls are gone, and only about what the clients saw was generated
    assert h.delta(after, later, "betelgeuse_generation_tokens_total") == 0
    seen = len(results["cancel"].tokens) + len(results["deadline"].tokens)
    grown = h.delta(before, later, "betelgeuse_generation_tokens_total")
    assert grown <= 3 * (n - 1) + seen + 20, (grown, seen)
    assert grown < 3 * (n - 1) + LONG
    # still serving
    again = h.run_stream(s.Generate(h.request(text=prompts[0], max_tokens=n, ignore_eos=True), timeout=60))
    assert again.tokens == wants[0]
