"""Every agent can connect: the Anthropic Messages API (the official `anthropic` client), the OpenAI Responses API
(`client.responses.create`), reasoning kept apart from the answer, /metrics on the API port. One real store + worker
pair serves a tiny model whose GGUF carries Qwen3's chat template (gguf/templates.py).

Deterministic outputs come from a grammar that admits exactly one text (vLLM's `structured_outputs` regex, an
extension the three APIs accept): the engine really generates it token by token, so the reasoning / answer /
tool-call split is tested on the real stream. Free generations are checked against the same request through
Chat Completions (greedy: one answer), which the existing tests check against the reference model."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

try:
    from tests import service_helpers as h
except ImportError:  # tests/ itself is on sys.path
    import service_helpers as h

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]},
                                                             "unit": {"type": "string", "enum": ["C", "F"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
FN_WEATHER = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
              "parameters": WEATHER["input_schema"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
# Qwen3 thinks, considers a call inside its reasoning (never executed), answers, then calls the tool
SCRIPT = ("<think>\nThe user wants the weather. I could write " + CALL.replace("Oslo", "Lima") +
          " but not yet.\n</think>\n\nLet me check." + "\n" + CALL)
REASONING = "The user wants the weather. I could write " + CALL.replace("Oslo", "Lima") + " but not yet."


def regex_of(text: str) -> str:
    """A regex (llguidance's Rust syntax) that matches exactly `text`."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append(r"\n")
        elif ch in "\\.+*?()|[]{}^$#&-~":            # Rust regex escapes only its meta characters
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


T0 = {"temperature": 0}       # (the late-2026 anthropic client has no temperature argument: sent as extra body)


def scripted(text: str) -> dict:
    return {"structured_outputs": {"regex": regex_of(text)}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from betelgeuse.gguf.synth import PRESETS, write_model
    import dataclasses
    path = tmp_path_factory.mktemp("qwen3tpl") / "qwen3-template.gguf"
    write_model(path, dataclasses.replace(PRESETS["tiny"], chat_template="qwen3"), progress=False)
    return path


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = h.start_cluster(model, tmp_path_factory.mktemp("agents"), http="auto")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def oa(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(oa):
    return oa.models.list().data[0].id


def post(cluster, path: str, body: dict, headers=None) -> tuple[int, dict]:
    req = urllib.request.Request(cluster.http_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy_chat(oa, model_id, messages, n, **kw):
    return oa.chat.completions.create(model=model_id, messages=messages, max_tokens=n, temperature=0, **kw)


# ---- Chat Completions: reasoning_content, never parsed for tool calls -------------------------------------------

def test_chat_splits_reasoning_whole_and_streamed(oa, model_id):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]
    r = oa.chat.completions.create(model=model_id, messages=msgs, tools=tools, max_tokens=200, temperature=0,
                                   extra_body=scripted(SCRIPT))
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.model_extra["reasoning_content"] == REASONING and m.content == "Let me check."
    (call,) = m.tool_calls                       # the call inside the reasoning was not executed
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "unit": "C"}
    parts = list(oa.chat.completions.create(model=model_id, messages=msgs, tools=tools, max_tokens=200,
                                            temperature=0, stream=True, extra_body=scripted(SCRIPT)))
    deltas = [p.choices[0].delta for p in parts if p.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"] and parts[-1].choices[0].finish_reason == "tool_calls"
    # without tools the answer keeps its markup; the reasoning is still apart
    r = oa.chat.completions.create(model=model_id, messages=msgs, max_tokens=200, temperature=0,
                                   extra_body=scripted(SCRIPT))
    assert r.choices[0].message.content == "Let me check.\n" + CALL and r.choices[0].finish_reason == "stop"


def test_enable_thinking_false_renders_the_empty_think_block(cluster, oa, model_id):
    """chat_template_kwargs reach the template: Qwen3's enable_thinking=false adds `<think>\\n\\n</think>\\n\\n`."""
    tok = h.reference_tokenizer(cluster.model)
    msgs = [{"role": "user", "content": "Hi"}]
    on = greedy_chat(oa, model_id, msgs, 1)
    off = greedy_chat(oa, model_id, msgs, 1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens - on.usage.prompt_tokens == len(tok.encode("<think>\n\n</think>\n\n"))


# ---- Anthropic Messages ----------------------------------------------------------------------------------------

def test_messages_text_matches_chat_and_reports_cache(claude, oa, model_id):
    system = "You are a careful assistant for river geography. " * 12
    chat = greedy_chat(oa, model_id, [{"role": "system", "content": system}, {"role": "user", "content": "Name one."}],
                       12)
    r = claude.messages.create(model=model_id, max_tokens=12, system=system, extra_body=T0,
                               messages=[{"role": "user", "content": "Name one."}])
    assert r.type == "message" and r.role == "assistant" and r.model == model_id
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat.choices[0].message.content
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    u = r.usage
    # the same prompt was cached by the chat request: Anthropic counts it as cache reads, not input
    assert (u.input_tokens, u.cache_read_input_tokens) == (0, chat.usage.prompt_tokens)
    assert u.output_tokens == chat.usage.completion_tokens
    # the same streamed: the events in Anthropic's order, the same text
    with claude.messages.stream(model=model_id, max_tokens=12, system=system, extra_body=T0,
                                messages=[{"role": "user", "content": "Name one."}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.content[0].text == r.content[0].text and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == u.output_tokens


def test_messages_thinking_tools_and_the_agent_loop(claude, model_id):
    kw = dict(model=model_id, max_tokens=200, tools=[WEATHER],
              messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body={**T0, **scripted(SCRIPT)})
    r = claude.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking == REASONING and r.content[1].text == "Let me check."
    use = r.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Oslo", "unit": "C"} and use.id.startswith("toolu_")
    with claude.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == REASONING and final.content[2].input == use.input
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] and final.stop_reason == "tool_use"
    # the result goes back as a tool_result block; the whole conversation (thinking block included) is accepted
    r2 = claude.messages.create(model=model_id, max_tokens=5, extra_body=T0, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12 C, rain"},
                                     {"type": "text", "text": "Thanks."}]}])
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens > r.usage.input_tokens


def test_messages_forced_tool_choice(claude, model_id):
    r = claude.messages.create(model=model_id, max_tokens=80, extra_body={"temperature": 0.7}, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "Weather?"}],
                               thinking={"type": "disabled"})
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])


def test_messages_stop_sequence_and_count_tokens(cluster, claude, oa, model_id):
    msgs = [{"role": "user", "content": "Once upon a time"}]
    full = greedy_chat(oa, model_id, msgs, 20).choices[0].message.content
    word = full.split()[1] if len(full.split()) > 1 else full[:2]
    r = claude.messages.create(model=model_id, max_tokens=20, extra_body=T0, messages=msgs, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == full[:full.index(word)]
    n = claude.messages.count_tokens(model=model_id, messages=msgs)
    assert n.input_tokens == greedy_chat(oa, model_id, msgs, 1).usage.prompt_tokens


@pytest.mark.parametrize("body, status, kind, words", [
    (dict(max_tokens=5, messages=[{"role": "user", "content": "Hi"}], top_logprobs=3), 400, "invalid_request_error",
     "unknown parameter: top_logprobs"),
    (dict(messages=[{"role": "user", "content": "Hi"}]), 400, "invalid_request_error", "max_tokens"),
    (dict(max_tokens=5, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
     400, "invalid_request_error", "content block type 'image' is not supported"),
    (dict(max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
          tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error",
     "tool type 'web_search_20250305' is not supported"),
    (dict(max_tokens=5, messages=[{"role": "user", "content": "Hi"}], temperature=1.5), 400,
     "invalid_request_error", "temperature"),
    (dict(max_tokens=5, messages=[{"role": "user", "content": "word " * 3000}]), 400, "invalid_request_error",
     "does not fit the context"),
    (dict(max_tokens=5, model="no-such-model", messages=[{"role": "user", "content": "Hi"}]), 404,
     "not_found_error", "does not exist"),
])
def test_messages_errors_are_anthropic_shaped(cluster, claude, model_id, body, status, kind, words):
    b = {"model": model_id, **body}
    st, got = post(cluster, "/v1/messages", b, {"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert (st, got["type"], set(got["error"])) == (status, "error", {"type", "message"}), got
    assert got["error"]["type"] == kind and words in got["error"]["message"], got
    if "max_tokens" in b:                                          # the client raises its own typed error
        args = {k: v for k, v in b.items() if k not in ("top_logprobs", "temperature")}
        extra = {k: v for k, v in b.items() if k not in args}
        with pytest.raises(anthropic.APIStatusError) as ei:
            claude.messages.create(**args, extra_body=extra)
        assert ei.value.status_code == status and ei.value.body["error"]["type"] == kind
    if status == 400 and "stream" not in b:                        # streamed: refused before the stream starts
        st, got = post(cluster, "/v1/messages", {**b, "stream": True})
        assert st == status and got["error"]["type"] == kind


# ---- OpenAI Responses ------------------------------------------------------------------------------------------

def test_responses_text_matches_chat(oa, model_id):
    chat = greedy_chat(oa, model_id, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a river."}], 10)
    r = oa.responses.create(model=model_id, instructions="Be brief.", input="Name a river.", max_output_tokens=10,
                            temperature=0)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    events = list(oa.responses.create(model=model_id, instructions="Be brief.", input="Name a river.",
                                      max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response." + (
        "incomplete" if r.status == "incomplete" else "completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_responses_reasoning_function_calls_and_previous_response(oa, model_id):
    kw = dict(model=model_id, input="Weather in Oslo?", tools=[FN_WEATHER], max_output_tokens=200, temperature=0,
              extra_body=scripted(SCRIPT))
    r = oa.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == REASONING and r.output_text == "Let me check."
    fc = r.output[2]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Oslo", "unit": "C"}
    events = list(oa.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    for k in ("response.reasoning_text.delta", "response.output_text.delta", "response.function_call_arguments.delta",
              "response.function_call_arguments.done", "response.output_item.done", "response.completed"):
        assert k in kinds, k
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    # the tool's output continues the stored conversation
    r2 = oa.responses.create(model=model_id, previous_response_id=r.id, tools=[FN_WEATHER], max_output_tokens=4,
                             temperature=0, input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                    "output": "12 C, rain"}])
    assert r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens
    # ... which is the same conversation sent whole (items in, as an agent that does not store)
    r3 = oa.responses.create(model=model_id, tools=[FN_WEATHER], max_output_tokens=4, temperature=0, store=False,
                             input=[{"role": "user", "content": "Weather in Oslo?"},
                                    *[o.model_dump(exclude_none=True) for o in r.output],
                                    {"type": "function_call_output", "call_id": fc.call_id, "output": "12 C, rain"}])
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.output_text == r2.output_text
    assert oa.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.BadRequestError) as ei:           # store=false: nothing to continue from
        oa.responses.create(model=model_id, previous_response_id=r3.id, input="more")
    assert ei.value.body["code"] == "previous_response_not_found" and ei.value.body["param"] == "previous_response_id"
    oa.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r.id)


@pytest.mark.parametrize("kw, param, words", [
    (dict(tools=[{"type": "web_search"}]), "tools.0", "tool type 'web_search' is not supported"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]), "input.0.content.0",
     "content type 'input_image' is not supported"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate", "unknown parameter: frobnicate"),
    (dict(background=True), "background", "not supported"),
    (dict(temperature=3), "temperature", "less than or equal to 2"),
])
def test_responses_errors_name_the_field(oa, model_id, kw, param, words):
    args = dict(model=model_id, input="Hi", max_output_tokens=2)
    args.update(kw)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            out = oa.responses.create(**args, stream=stream)
            list(out) if stream else None
        e = ei.value.body
        assert e["param"] == param and words in e["message"], e


# ---- operators: /metrics on the API port, counters by endpoint, KV usage ------------------------------------------

def test_metrics_on_the_api_port(cluster, claude, oa, model_id):
    before = h.scrape(cluster.http_url + "/metrics")
    claude.messages.create(model=model_id, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    oa.responses.create(model=model_id, input="Hi", max_output_tokens=1)
    after = h.wait_metric(cluster.http_url + "/metrics", lambda s: h.delta(
        before, s, "betelgeuse_requests_total", method="Responses", code="OK") >= 1)
    assert h.delta(before, after, "betelgeuse_requests_total", method="Messages", code="OK") == 1
    assert h.delta(before, after, "betelgeuse_requests_total", method="Responses", code="OK") == 1
    worker = h.scrape(cluster.worker_metrics_url)                # the same registry as the metrics port
    assert h.value(worker, "betelgeuse_requests_total", method="Messages", code="OK") >= 1
    assert h.value(after, "betelgeuse_kv_cache_capacity_tokens") > 0
    assert 0 <= h.value(after, "betelgeuse_kv_cache_usage_ratio") <= 1
    assert ("betelgeuse_prefix_cache_usage_ratio", frozenset()) in after


def test_readme_agent_examples_run(cluster):
    """The README's Anthropic and Responses examples, as printed there."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    for marker in ("import anthropic", "client.responses.create"):
        block = next(b for b in blocks if marker in b)
        code = block.replace("http://127.0.0.1:8000", cluster.http_url)
        exec(compile(code, "README.md", "exec"), {})


def test_messages_max_tokens_is_an_upper_bound(claude, oa, model_id):
    """Claude Code sends max_tokens=32000 whatever the model: /v1/messages answers (the output also ends at the end of
    the context) instead of the 400 the OpenAI edge gives for a max_tokens beyond the context. Before: a 400."""
    r = claude.messages.create(model=model_id, max_tokens=32000, extra_body={**T0, **scripted("Hi there")},
                               messages=[{"role": "user", "content": "hello"}])
    assert r.content[0].text == "Hi there" and r.stop_reason == "end_turn"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oa.chat.completions.create(model=model_id, max_tokens=32000, messages=[{"role": "user", "content": "hello"}])
