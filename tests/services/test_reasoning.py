"""Reasoning and tool calls per model family (betelgeuse/reasoning.py, toolcalls.py, grammar.py, gguf/templates.py).

In-process: the split of known outputs (Qwen3's `<think>` + Hermes, DeepSeek-V4's `<think>` + DSML) whole and
streamed at every split point; the templates against renderings written out from the families' published formats;
forced tool calls in DSML under random logits. End to end: a real serve of a tiny model carrying DeepSeek-V4's
template, whose output a grammar scripts, through the official `openai` client, streamed and not."""

from __future__ import annotations

import dataclasses
import json

import pytest

from betelgeuse.reasoning import DEEPSEEK_V4, HERMES_ONLY, QWEN3, OutputParser, collect, dialect_for, parse_output

DS = "｜DSML｜"
ONE_CALL = (f'Need the weather.</think>\n\n<{DS}tool_calls>\n<{DS}invoke name="get_weather">\n'
            f'<{DS}parameter name="days" string="false">3</{DS}parameter>\n'
            f'<{DS}parameter name="location" string="true">Seoul</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>')
TWO_CALLS = (f'Checking both.\n\n<{DS}tool_calls>\n<{DS}invoke name="get_weather">\n'
             f'<{DS}parameter name="location" string="true">Seoul</{DS}parameter>\n</{DS}invoke>\n'
             f'<{DS}invoke name="get_time">\n\n</{DS}invoke>\n</{DS}tool_calls>')
DSML_IN_REASONING = (f"I could answer with\n\n<{DS}tool_calls>\n<{DS}invoke name=\"get_time\">\n\n</{DS}invoke>\n"
                     f"</{DS}tool_calls> but no.</think>Done.")
QWEN_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

# (dialect, the prompt opened a think block, tools, raw output, reasoning, content, [(name, arguments)])
CASES = [
    (DEEPSEEK_V4, True, False, "The user greets me.</think>Hello!", "The user greets me.", "Hello!", []),
    (DEEPSEEK_V4, False, False, "Hello! a</think>b", "", "Hello! a</think>b", []),
    (DEEPSEEK_V4, True, True, ONE_CALL, "Need the weather.", "", [("get_weather", {"days": 3, "location": "Seoul"})]),
    (DEEPSEEK_V4, False, True, TWO_CALLS, "", "Checking both.",
     [("get_weather", {"location": "Seoul"}), ("get_time", {})]),
    (DEEPSEEK_V4, True, True, DSML_IN_REASONING, DSML_IN_REASONING.split("</think>")[0], "Done.", []),
    (DEEPSEEK_V4, True, True, f"Still thinking about <{DS}tool_calls>\n<{DS}inv", f"Still thinking about <{DS}tool_calls>\n<{DS}inv", "", []),
    (DEEPSEEK_V4, False, True, f"x\n\n<{DS}tool_calls>\n<{DS}call get_time/>\n</{DS}tool_calls> y", "",
     f"x\n\n<{DS}tool_calls>\n<{DS}call get_time/>\n</{DS}tool_calls> y", []),
    (DEEPSEEK_V4, False, False, TWO_CALLS, "", TWO_CALLS, []),                      # tools off: markup is content
    (QWEN3, False, True, "<think>\nPlan: " + QWEN_CALL + "\n</think>\n\nOn it.\n" + QWEN_CALL,
     "Plan: " + QWEN_CALL, "On it.", [("get_time", {})]),
    (QWEN3, True, False, "\nshort\n</think>\n\n  Answer  ", "short", "Answer  ", []),   # 2507: prompt opened it
    (QWEN3, False, False, " Plain <thinking> text", "", " Plain <thinking> text", []),
    (QWEN3, False, False, "<think>\nnever closed", "never closed", "", []),
    (HERMES_ONLY, False, True, "<think>x</think>" + QWEN_CALL, "", "<think>x</think>", [("get_time", {})]),
]


@pytest.mark.parametrize("dialect, opened, tools, raw, reasoning, content, calls", CASES)
def test_split_whole_and_streamed(dialect, opened, tools, raw, reasoning, content, calls):
    got = parse_output(dialect, raw, opened, tools)
    assert (got.reasoning, got.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    # streamed at every split point and one character at a time: the same split
    for pieces in [[raw[:i], raw[i:]] for i in range(len(raw) + 1)] + [list(raw)]:
        p = OutputParser(dialect, opened, tools)
        s = collect([x for piece in pieces for x in p.push(piece)] + p.flush())
        assert (s.reasoning, s.content, [c.name for c in s.calls]) == (reasoning, content, [n for n, _ in calls])


def test_dialect_from_the_template():
    from betelgeuse.gguf.templates import DEEPSEEK_V4 as DS_T, DEFAULT, QWEN3 as Q_T
    assert dialect_for(Q_T) is QWEN3 and dialect_for(DS_T) is DEEPSEEK_V4
    assert dialect_for(DEFAULT) is QWEN3                        # it knows enable_thinking's empty think block
    assert dialect_for("{{ messages }}<tool_call>") is HERMES_ONLY     # Qwen2.5-style: tools, no thinking
    assert dialect_for(None, "deepseek4") is DEEPSEEK_V4
    assert QWEN3.opens_reasoning("<|im_start|>assistant\n<think>\n") and not QWEN3.opens_reasoning("</think>\n\n")
    assert DEEPSEEK_V4.opens_reasoning("<｜Assistant｜><think>") and not DEEPSEEK_V4.opens_reasoning("<｜Assistant｜></think>")


def _render(template: str, messages, **kw) -> str:
    from betelgeuse.tokenizer import _compile
    return _compile(template).render(messages=messages, **kw)


def test_deepseek_v4_template_renders_the_published_format():
    """DeepSeek-V4's encoding (encoding_dsv4 of the release), written out by hand for a tool conversation in
    thinking mode: tools appended to the system text, DSML calls, tool results inside a user turn, reasoning kept
    in a conversation with tools; and the generation prompts of both modes."""
    from betelgeuse.gguf.templates import DEEPSEEK_V4 as T
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "n": 2}'}}]},
            {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "12 C.", "reasoning_content": "Done."}]
    out = _render(T, msgs, tools=tools, bos_token="<B>", thinking=True)
    head = out[:out.index("<｜User｜>")]
    assert head.startswith("<B>Be brief.\n\n## Tools\n\nYou have access to a set of tools")
    assert head.endswith('### Available Tool Schemas\n\n{"name": "get_weather", "description": "Weather", "parameters": '
                         '{"type": "object", "properties": {"city": {"type": "string"}}}}\n\nYou MUST strictly follow '
                         'the above defined tool name and parameter schemas to invoke tool calls.\n')
    assert out[len(head):] == (
        "<｜User｜>Weather in Oslo?<｜Assistant｜><think>Use the tool.</think>\n\n"
        f'<{DS}tool_calls>\n<{DS}invoke name="get_weather">\n'
        f'<{DS}parameter name="city" string="true">Oslo</{DS}parameter>\n'
        f'<{DS}parameter name="n" string="false">2</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls><｜end▁of▁sentence｜>'
        "<｜User｜><tool_result>12 C</tool_result><｜Assistant｜><think>Done.</think>12 C.<｜end▁of▁sentence｜>")
    chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, {"role": "user", "content": "q2"},
            {"role": "user", "content": "q3"}]
    assert _render(T, chat, bos_token="<B>", add_generation_prompt=True) == \
        "<B>sys<｜User｜>q1<｜Assistant｜></think>a1<｜end▁of▁sentence｜><｜User｜>q2\n\nq3<｜Assistant｜></think>"
    # thinking on: earlier reasoning is dropped before the last user turn, the prompt opens a think block
    assert _render(T, chat, bos_token="<B>", add_generation_prompt=True, enable_thinking=True) == \
        "<B>sys<｜User｜>q1<｜Assistant｜></think>a1<｜end▁of▁sentence｜><｜User｜>q2\n\nq3<｜Assistant｜><think>"


def test_qwen3_template_renders_qwen3s_format():
    """Qwen3's published rendering: the last turn's reasoning shown after the last query, earlier ones dropped,
    tool results in a user turn, enable_thinking=false's empty think block."""
    from betelgeuse.gguf.templates import QWEN3 as T
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nold\n</think>\n\na1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "reasoning_content": "r2",
             "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "ok"}]
    assert _render(T, msgs, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def tok(tiny_model):
    from betelgeuse.tokenizer import Tokenizer
    return Tokenizer.from_file(tiny_model)


def test_forced_dsml_calls_are_valid_under_random_logits(tok):
    """A forced tool choice compiles to DSML in the schema's types; whatever the logits, the output parses to a
    valid call (and, with the prompt's think block open, the reasoning closes first)."""
    jsonschema = pytest.importorskip("jsonschema")
    from betelgeuse.grammar import tool_call_grammar
    from test_chat_features import _constrained
    params = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "note": {"type": "string", "maxLength": 6}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    close = tok.encode("</think>")

    def nudge(ids, logits):          # a random model never spells </think>: after 8 tokens of reasoning, make it
        if 8 <= len(ids) < 8 + len(close):
            logits[close[len(ids) - 8]] += 100
    for seed, (name, opened) in enumerate([("get_weather", False), (None, False), ("get_weather", True)]):
        text, _ = _constrained(tok, tool_call_grammar(tools, name, DEEPSEEK_V4, opened), seed, 400,
                               nudge if opened else None)
        got = parse_output(DEEPSEEK_V4, text, opened, tools=True)
        assert got.calls and not got.content, text
        for call in got.calls:
            assert call.name in ("get_weather", "get_time") and (name is None or call.name == name)
            if call.name == "get_weather":
                jsonschema.validate(json.loads(call.arguments), params)


# ---- end to end: a served model with DeepSeek-V4's template ---------------------------------------------------------

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def ds_cluster(tmp_path_factory):
    try:
        from tests import service_helpers as h
    except ImportError:
        import service_helpers as h
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = tmp_path_factory.mktemp("dstpl") / "ds-template.gguf"
    write_model(path, dataclasses.replace(PRESETS["tiny"], chat_template="deepseek-v4"), progress=False)
    c = h.start_cluster(path, tmp_path_factory.mktemp("ds"), http="auto")
    yield c
    c.stop()


def test_deepseek_v4_reasoning_and_dsml_calls_served(ds_cluster):
    from test_agent_apis import regex_of
    oa = openai.OpenAI(base_url=ds_cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = oa.models.list().data[0].id
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "Weather and time?"}]
    for kwargs, script, reasoning, content, names in [
            ({"enable_thinking": True}, ONE_CALL, "Need the weather.", None, ["get_weather"]),
            ({}, TWO_CALLS, None, "Checking both.", ["get_weather", "get_time"]),
            ({"thinking": True}, DSML_IN_REASONING, DSML_IN_REASONING.split("</think>")[0], "Done.", [])]:
        kw = dict(model=model, messages=msgs, tools=tools, max_tokens=300, temperature=0,
                  extra_body={"chat_template_kwargs": kwargs, "structured_outputs": {"regex": regex_of(script)}})
        r = oa.chat.completions.create(**kw)
        m = r.choices[0].message
        assert m.model_extra.get("reasoning_content") == reasoning and m.content == content, m
        assert [c.function.name for c in m.tool_calls or []] == names
        assert r.choices[0].finish_reason == ("tool_calls" if names else "stop")
        parts = [p.choices[0].delta for p in oa.chat.completions.create(**kw, stream=True) if p.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in parts) == (reasoning or "")
        assert "".join(d.content or "" for d in parts) == (content or "")
        assert [tc.function.name for d in parts for tc in (d.tool_calls or [])] == names
        assert [json.loads(tc.function.arguments) for d in parts for tc in (d.tool_calls or [])] == \
            [json.loads(c.function.arguments) for c in m.tool_calls or []]
    # a forced call is written in DSML (the grammar) and comes back as a call; thinking off: the prompt ends </think>
    r = oa.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=120, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "get_time"
