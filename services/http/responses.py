"""The OpenAI Responses API over the same engine: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

    input (a string, or items: messages with input_text / output_text parts, function_call,
    function_call_output, reasoning), instructions, function tools, tool_choice, temperature, top_p,
    max_output_tokens, text.format (text | json_object | json_schema), reasoning.effort ("none" turns the
    template's thinking off, any other effort on), stream (response.created, response.in_progress,
    response.output_item.added / .done, response.content_part.added / .done, response.output_text.delta / .done,
    response.reasoning_text.delta / .done, response.function_call_arguments.delta / .done, response.completed or
    response.incomplete), store and previous_response_id.

`previous_response_id`: responses created with store=true (the default) are kept in this worker's memory, at most
STORE_MAX of them and STORE_BYTES of conversation in all, each for STORE_TTL_S seconds (the oldest go first); a
continuation resends the stored conversation (its input and output items) before the new input, as OpenAI does
(the earlier instructions are not carried over). An id that is unknown, expired or from store=false is a 400
(code previous_response_not_found): the client resends the conversation itself. Nothing survives a restart.

Refused with a 400 naming them, as OpenAI's API does with unknown input: any field this module does not know, and
known features it cannot honour (built-in tools such as web_search / file_search / computer use, image / file /
audio input, item_reference, background, conversation, prompt templates, top_logprobs, truncation "auto").
Reasoning items come back with their text as `content` (reasoning_text) and no encrypted_content.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal, Union

import anyio
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from betelgeuse import api
from betelgeuse.errors import NotFoundError
from services.http import output
from services.http.errors import classify
from services.http.protocol import StructuredOutputs, UnsupportedParam, structured_grammar

STORE_MAX = 256                 # responses kept for previous_response_id
STORE_BYTES = 64 * 1024 * 1024  # their conversations' JSON, in all
STORE_TTL_S = 3600.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(_Strict):
    type: Literal["function"]
    name: str


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedChoice, None] = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None                   # accepted; nothing extra to include
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None                # accepted: the prefix cache needs no hint
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # ours / vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None


# ---- the store of earlier responses (previous_response_id) --------------------------------------------------------

class Store:
    """id -> (expiry, the conversation's messages up to and including that response, the response JSON)."""

    def __init__(self, max_items: int = STORE_MAX, max_bytes: int = STORE_BYTES, ttl_s: float = STORE_TTL_S):
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self.items: OrderedDict[str, tuple[float, list[dict], dict, int]] = OrderedDict()
        self.nbytes = 0
        self.lock = threading.Lock()

    def _expire(self, now: float):
        while self.items and (next(iter(self.items.values()))[0] < now or len(self.items) > self.max_items
                              or self.nbytes > self.max_bytes):
            _, (_, _, _, n) = self.items.popitem(last=False)
            self.nbytes -= n

    def put(self, rid: str, messages: list[dict], response: dict):
        n = len(json.dumps(messages)) + len(json.dumps(response))
        with self.lock:
            self.items[rid] = (time.monotonic() + self.ttl_s, messages, response, n)
            self.nbytes += n
            self._expire(time.monotonic())

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        with self.lock:
            self._expire(time.monotonic())
            hit = self.items.get(rid)
            return None if hit is None else (hit[1], hit[2])

    def delete(self, rid: str) -> bool:
        with self.lock:
            hit = self.items.pop(rid, None)
            if hit is not None:
                self.nbytes -= hit[3]
            return hit is not None


class NotFound(NotFoundError):
    """A stored response that is not there (HTTP 404)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- request -> api.GenerateRequest ------------------------------------------------------------------------------

TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise UnsupportedParam(where, f"{where} must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise UnsupportedParam(f"{where}.{j}", f"{where}.{j}: content type {kind!r} is not supported "
                                                   "(text only: input_text, output_text)")
        out.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(out)


def _items(items, start: list[dict]) -> list[dict]:
    """Input items -> chat messages appended to `start` (function calls join the assistant turn before them;
    a reasoning item's text goes to the assistant turn after it)."""
    msgs = list(start)
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    thought = None

    def assistant() -> dict:
        nonlocal thought
        if not (msgs and msgs[-1]["role"] == "assistant") or thought:
            msgs.append({"role": "assistant", "content": ""})
        if thought:
            msgs[-1]["reasoning_content"], thought = thought, None
        return msgs[-1]
    for i, it in enumerate(items):
        where = f"input.{i}"
        kind = it.get("type", "message" if "role" in it else None)
        if kind not in ITEMS:
            raise UnsupportedParam(where, f"{where}: item type {kind!r} is not supported ({', '.join(ITEMS)})")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise UnsupportedParam(f"{where}.role", f"{where}.role must be user, system, developer or assistant")
            text = _text(it.get("content"), f"{where}.content")
            if role == "assistant":
                m = {"role": "assistant", "content": text}
                if thought:
                    m["reasoning_content"], thought = thought, None
                msgs.append(m)
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise UnsupportedParam(where, f"{where}: function_call needs name and call_id")
            m = assistant()
            m.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": {
                "name": it["name"], "arguments": it.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise UnsupportedParam(where, f"{where}: function_call_output needs call_id")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": _text(it.get("output"), where)})
        else:
            parts = it.get("content") or []
            thought = _text(parts, f"{where}.content") or None
    return msgs


REFUSED = {"background": "background responses are not supported", "conversation": "conversation objects are not "
           "supported: send previous_response_id or the items", "prompt": "prompt templates are not supported"}


def to_request(r: ResponsesRequest, store: Store) -> tuple[api.GenerateRequest, list[dict]]:
    """(the engine request, the conversation's messages without this turn's instructions)."""
    for field, why in REFUSED.items():
        if getattr(r, field) not in (None, False):
            raise UnsupportedParam(field, f"{field}: {why}")
    if r.top_logprobs:
        raise UnsupportedParam("top_logprobs", "top_logprobs is not supported")
    if r.truncation == "auto":
        raise UnsupportedParam("truncation", 'truncation "auto" is not supported (a prompt over the context is a 400)')
    history: list[dict] = []
    if r.previous_response_id:
        hit = store.get(r.previous_response_id)
        if hit is None:
            e = UnsupportedParam("previous_response_id", f"previous response {r.previous_response_id!r} not found: it "
                                 "was not stored (store=false), has expired, or this server restarted; send the "
                                 "whole conversation instead")
            e.error_code = "previous_response_not_found"
            raise e
        history = hit[0]
    conv = _items(r.input, history)
    msgs = ([{"role": "system", "content": r.instructions}] if r.instructions else []) + conv
    tools = None
    if r.tools:
        tools = []
        for i, t in enumerate(r.tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise UnsupportedParam(f"tools.{i}", f"tools.{i}: tool type {kind!r} is not supported (function only)")
            try:
                f = FunctionTool.model_validate(t)
            except Exception as e:       # noqa: BLE001 (pydantic's ValidationError: one line naming the field)
                raise UnsupportedParam(f"tools.{i}", f"tools.{i}: {str(e).splitlines()[-1].strip()}") from None
            tools.append({"type": "function", "function": {"name": f.name, "description": f.description or "",
                                                            "parameters": f.parameters or {"type": "object"}}})
    tc = r.tool_choice
    choice = {"type": "function", "function": {"name": tc.name}} if isinstance(tc, NamedChoice) else tc
    grammar = structured_grammar(r.structured_outputs)
    fmt = r.text.format if r.text else None
    if fmt is not None and fmt.type != "text":
        if grammar is not None:
            raise UnsupportedParam("text.format", "give text.format or structured_outputs, not both")
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise UnsupportedParam("text.format", "text.format json_schema needs a schema")
        grammar = api.Grammar("json_object") if fmt.type == "json_object" else api.Grammar("json_schema", fmt.schema_)
    kw = dict(r.chat_template_kwargs or {})
    if r.reasoning is not None and r.reasoning.effort is not None:
        on = r.reasoning.effort != "none"
        kw.setdefault("enable_thinking", on)
        kw.setdefault("thinking", on)
    req = api.GenerateRequest(
        messages=msgs, max_tokens=r.max_output_tokens, tools=tools, tool_choice=choice, grammar=grammar,
        chat_template_kwargs=kw,
        sampling=api.SamplingParams(temperature=1.0 if r.temperature is None else r.temperature,
                                    top_p=1.0 if r.top_p is None else r.top_p))
    return req, conv


# ---- output items ------------------------------------------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"id": rid, "type": "reasoning", "summary": [], "status": status, "encrypted_content": None,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def call_item(fid: str, c: api.ToolCall, arguments: str | None = None, status: str = "completed") -> dict:
    return {"id": fid, "type": "function_call", "status": status, "call_id": c.id, "name": c.name,
            "arguments": c.arguments if arguments is None else arguments}


class Front:
    """The Responses routes' state: the shared HTTP front and the store."""

    def __init__(self, front):
        self.front, self.store = front, Store()

    def envelope(self, body: ResponsesRequest, rid: str, created: int, status: str, items: list[dict],
                 final: api.FinalEvent | None = None, reasoning_text: str = "") -> dict:
        usage = None
        if final is not None:
            u, n = final.usage, len(final.token_ids)
            n_reason = len(self.front.engine.tokenize(reasoning_text)) if reasoning_text else 0
            usage = {"input_tokens": u.prompt_n, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": n, "output_tokens_details": {"reasoning_tokens": min(n_reason, n)},
                     "total_tokens": u.prompt_n + n}
        tc = body.tool_choice
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
                "output": items, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                "store": body.store, "temperature": body.temperature if body.temperature is not None else 1.0,
                "text": {"format": {"type": body.text.format.type if body.text and body.text.format else "text"}},
                "tool_choice": tc.model_dump() if isinstance(tc, NamedChoice) else (tc or "auto"),
                "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
                "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
                "metadata": body.metadata or {}}

    def keep(self, body: ResponsesRequest, conv: list[dict], resp: dict, ans_reasoning: str, content: str,
             calls: list[api.ToolCall]):
        """store=true: the conversation so far (this turn's output as an assistant message) under the id."""
        if not body.store:
            return
        m: dict[str, Any] = {"role": "assistant", "content": content}
        if ans_reasoning:
            m["reasoning_content"] = ans_reasoning
        if calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in calls]
        self.store.put(resp["id"], conv + [m], resp)

    def full(self, body: ResponsesRequest, req: api.GenerateRequest, conv: list[dict], ans: output.Answer) -> dict:
        items = []
        if ans.reasoning:
            items.append(reasoning_item(_id("rs"), ans.reasoning))
        if ans.content or not (ans.calls or ans.reasoning):
            items.append(message_item(_id("msg"), ans.content))
        items += [call_item(_id("fc"), c) for c in ans.calls]
        status = "incomplete" if ans.finish_reason == "length" else "completed"
        resp = self.envelope(body, f"resp_{req.request_id}", int(time.time()), status, items, ans.final,
                             ans.reasoning)
        self.keep(body, conv, resp, ans.reasoning, ans.content, ans.calls)
        return resp

    async def stream(self, body: ResponsesRequest, req: api.GenerateRequest, conv: list[dict], handle):
        rid, created, seq = f"resp_{req.request_id}", int(time.time()), 0
        items: list[dict] = []                  # finished output items
        cur: dict | None = None                 # the open item: {"kind", "id", "text"}
        texts = {"reasoning": [], "content": []}
        calls: list[api.ToolCall] = []

        def ev(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data}, ensure_ascii=False)}\n\n"

        def close() -> list[str]:
            nonlocal cur
            if cur is None:
                return []
            i, text = len(items), "".join(cur["text"])
            if cur["kind"] == "reasoning":
                item, part = reasoning_item(cur["id"], text), {"type": "reasoning_text", "text": text}
                done = [ev("response.reasoning_text.done", item_id=cur["id"], output_index=i, content_index=0,
                           text=text)]
            else:
                item, part = message_item(cur["id"], text), {"type": "output_text", "text": text, "annotations": []}
                done = [ev("response.output_text.done", item_id=cur["id"], output_index=i, content_index=0,
                           text=text, logprobs=[])]
            done += [ev("response.content_part.done", item_id=cur["id"], output_index=i, content_index=0, part=part),
                     ev("response.output_item.done", output_index=i, item=item)]
            items.append(item)
            cur = None
            return done

        def open_(kind: str) -> list[str]:
            nonlocal cur
            cur = {"kind": kind, "id": _id("rs" if kind == "reasoning" else "msg"), "text": []}
            i = len(items)
            if kind == "reasoning":
                item, part = reasoning_item(cur["id"], "", "in_progress"), {"type": "reasoning_text", "text": ""}
            else:
                item, part = message_item(cur["id"], "", "in_progress"), {"type": "output_text", "text": "",
                                                                           "annotations": []}
            return [ev("response.output_item.added", output_index=i, item=item),
                    ev("response.content_part.added", item_id=cur["id"], output_index=i, content_index=0, part=part)]

        head = self.envelope(body, rid, created, "in_progress", [])
        yield ev("response.created", response=head)
        yield ev("response.in_progress", response=head)
        async for kind, x in output.parts(self.front.engine, req, handle):
            if kind == "error":
                status, err, code = classify(x)
                self.front.count("Responses", code)
                e = err["error"]
                yield ev("error", code=e.get("code") or e["type"], message=e["message"], param=e.get("param"))
                return
            if kind == "token":
                continue
            if kind in ("reasoning", "content"):
                if cur is None or cur["kind"] != kind:
                    for s in close() + open_(kind):
                        yield s
                cur["text"].append(x)
                texts[kind].append(x)
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                yield ev(name, item_id=cur["id"], output_index=len(items), content_index=0, delta=x, **extra)
            elif kind == "tool_call":
                for s in close():
                    yield s
                fid, i = _id("fc"), len(items)
                calls.append(x)
                yield ev("response.output_item.added", output_index=i, item=call_item(fid, x, "", "in_progress"))
                yield ev("response.function_call_arguments.delta", item_id=fid, output_index=i, delta=x.arguments)
                yield ev("response.function_call_arguments.done", item_id=fid, output_index=i, name=x.name,
                         arguments=x.arguments)
                items.append(call_item(fid, x))
                yield ev("response.output_item.done", output_index=i, item=items[-1])
            elif kind == "final":
                if cur is None and not items:               # an empty answer: one empty message, as non-streamed
                    for s in open_("content"):
                        yield s
                for s in close():
                    yield s
                status = "incomplete" if x.finish_reason == "length" else "completed"
                reasoning = "".join(texts["reasoning"])
                resp = self.envelope(body, rid, created, status, items, x, reasoning)
                self.keep(body, conv, resp, reasoning, "".join(texts["content"]), calls)
                yield ev("response.completed" if status == "completed" else "response.incomplete", response=resp)
                self.front.count("Responses", "OK")


def add_routes(app: FastAPI, front) -> None:
    rf = Front(front)
    app.state.responses = rf

    @app.post("/v1/responses", response_model=None)
    async def create(body: ResponsesRequest, request: Request):
        front.check_model(body.model)
        req, conv = to_request(body, rf.store)
        if body.stream:
            handle = await anyio.to_thread.run_sync(front.submit, req)
            return output.EventStream(rf.stream(body, req, conv, handle), handle)
        ans = await output.answer(front.engine, req, request)
        out = await anyio.to_thread.run_sync(rf.full, body, req, conv, ans)
        front.count("Responses", "CANCELLED" if ans.final.finish_reason == "cancelled" else "OK")
        return out

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def get(response_id: str):
        hit = rf.store.get(response_id)
        if hit is None:
            raise NotFound(f"no stored response {response_id!r} (not stored, expired, or deleted)", "response_id")
        return hit[1]

    @app.delete("/v1/responses/{response_id}", response_model=None)
    async def delete(response_id: str):
        if not rf.store.delete(response_id):
            raise NotFound(f"no stored response {response_id!r} (not stored, expired, or deleted)", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}
