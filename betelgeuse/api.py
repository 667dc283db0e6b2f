"""What the GPU worker offers the service layer: requests in, events out.

`services/grpc/server.py` converts protobuf to these dataclasses (from_pb) and back (to_pb); nothing
here knows about protobuf. Tests may drive an `Engine` in-process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol


MAX_TEMPERATURE = 2.0              # OpenAI's limit; the engine refuses more, so every edge (gRPC, HTTP) does
MAX_STOP = 16                      # stop strings per request (OpenAI allows 4; vLLM any)
MAX_TOP_LOGPROBS = 20              # OpenAI's limit


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    seed: int | None = None         # None = nondeterministic
    min_p: float = 0.0              # 0 = off; drop tokens with p < min_p * p_max (after temperature)
    presence_penalty: float = 0.0   # [-2, 2], OpenAI: logit -= p for every token already generated
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI: logit -= f * count in the completion
    repetition_penalty: float = 1.0 # (0, inf), HF/CTRL: over prompt + completion; 1 = off
    logprobs: bool = False          # return the chosen token's log-probability
    top_logprobs: int = 0           # and the n most likely alternatives (0..20)


@dataclass(slots=True)
class Grammar:
    """Constrained decoding (llguidance): exactly one of json_schema / lark / regex, or json_object."""
    kind: str                       # "json_object" | "json_schema" | "lark" | "regex"
    value: Any = None               # the schema (dict) / grammar text / regex


@dataclass(slots=True)
class ToolCall:
    id: str                         # "call_<hex>" (OpenAI's shape)
    name: str
    arguments: str                  # JSON text of the arguments object


@dataclass(slots=True)
class GenerateRequest:
    # exactly one of the three prompt forms
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # [{"role": ..., "content": ..., "tool_calls": [...], "tool_call_id": ...}], rendered with the GGUF chat template;
    # special-token text inside any message or tool field is encoded as plain text, never as control tokens
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None   # None = until EOS / a stop, or the end of the context
    fit_context: bool = False       # True: max_tokens is only an upper bound, the output also ends at the end of
                                    # the context (Anthropic clients send 32000 whatever the model); False: a
                                    # max_tokens beyond the context is refused (OpenAI's and vLLM's answer)
    stop: list[str] = field(default_factory=list)            # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    ignore_eos: bool = False
    request_id: str = ""
    # prompt_text is plain text: "<|im_start|>" written in it is ordinary characters. True (a trusted caller
    # that formats its own prompt) lets special-token text in prompt_text become control tokens.
    parse_special: bool = False
    tools: list[dict[str, Any]] | None = None         # OpenAI tool definitions, passed to the chat template
    tool_choice: str | dict | None = None             # "none" | "auto" | "required" | {"type":"function","function":{"name":..}}
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)   # extra template variables (enable_thinking)
    grammar: Grammar | None = None                    # constrained output (response_format)
    # prompts with different salts never share prefix-cache entries (vLLM's cache_salt): one tenant cannot learn
    # from its time to first token what another has sent; "" = the shared cache
    cache_salt: str = ""


@dataclass(slots=True)
class TokenEvent:
    token_id: int
    text: str                       # newly completed text (UTF-8 safe; may be "")
    index: int                      # 0-based position in the completion
    logprob: float | None = None    # log-probability of token_id under the model (raw logits), when asked
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), most likely first


@dataclass(slots=True)
class Usage:
    # llama.cpp's vocabulary for timings
    prompt_n: int = 0
    prompt_ms: float = 0.0          # wall from the start of its prefill to its first token (pieces and the decode
                                    # steps of others in between included: the request's own clock)
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0       # wall from its first token to its last, as the client sees them
    predicted_per_second: float = 0.0
    ttft_ms: float = 0.0
    # expert reads by tier for this request (expert matrices applied, counted per (layer, expert) load)
    expert_reads_vram: int = 0
    expert_reads_host: int = 0
    expert_reads_disk: int = 0
    disk_bytes: int = 0
    disk_wait_ms: float = 0.0
    h2d_bytes: int = 0
    cached_tokens: int = 0          # prompt tokens served from the prefix cache (llama.cpp: cache_n)
    queue_ms: float = 0.0           # arrival to the start of its prefill (waiting for a running slot)
    # deepseek41's Engram rows for this request: rows its tokens read, bytes the store read from disk for them,
    # time compute waited for them
    engram_rows: int = 0
    engram_disk_bytes: int = 0
    engram_wait_ms: float = 0.0
    routing: str = "exact"          # the engine's routing mode: "exact", or APPROXIMATE "resident" | "pool"


@dataclass(slots=True)
class FinalEvent:
    finish_reason: str              # "stop" | "length" | "cancelled" | "tool_calls"
    text: str                       # the whole completion text
    token_ids: list[int]
    usage: Usage
    tail: str = ""                  # text held back as a possible stop-string prefix, never streamed in a TokenEvent
    # why "stop" (or "tool_calls") fired: "eos" (a model EOS id), "stop_token" (one of stop_token_ids),
    # "stop_string", "grammar" (the constrained output is complete); "" for length / cancelled
    stop_reason: str = ""
    stop_string: str = ""           # the stop string that fired
    stop_token_id: int | None = None  # the EOS / stop id that fired (not part of token_ids)
    tool_calls: list[ToolCall] = field(default_factory=list)   # parsed from the text when the request had tools


Event = TokenEvent | FinalEvent


class RequestHandle(Protocol):
    reasoning: bool                                # the output starts inside a think block (the prompt opened it)
    prompt_tokens: int                             # the prompt's length in tokens
    def __iter__(self) -> Iterator[Event]: ...    # ends with exactly one FinalEvent, or raises a BetelgeuseError
    def cancel(self) -> None: ...                  # the engine stops work on it promptly
    # optional (the engine's own handle has them; an event-loop reader uses them where present, else iterates
    # on worker threads): listen(notify) has notify() called after each queued event, ready() drains without
    # blocking (betelgeuse/worker/sequence.py RequestHandle)


@dataclass(slots=True)
class ModelInfo:
    name: str
    arch: str
    path: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    context_length: int
    quant: str                      # dominant expert quant type name, e.g. "Q8_0"
    expert_bytes: int               # bytes of one expert (gate+up+down)
    vram_slots_per_layer: int
    host_slots_per_layer: int
    schedule: str                   # "layer_major" | "standard"
    sub_batch: int
    routing: str = "exact"          # "exact" | "resident" | "pool" (approximate: outputs depend on residency)
    vram_backing: bool = True       # VRAM experts keep host copies
    plan: dict | None = None        # the slot plan: what was chosen and the budgets it came from (SlotPlan.describe)
    prefill_chunk: int = 0          # tokens per position-aligned prefill chunk the runner uses (prefill_chunk auto: the
                                    # architecture's); 0: the architecture prefills a prompt in one piece


@dataclass(slots=True)
class ServerInfo:
    version: str
    device: str
    queue_depth: int
    active_requests: int
    store_attached: bool
    slots_used: dict[str, int]      # tier -> occupied expert slots ("vram", "host", "staging")
    memory: dict[str, int]          # pool -> bytes ("vram_in_use", "arena", "cgroup_current", "cgroup_max", ...)
    uptime_s: float


class Engine(Protocol):
    def submit(self, request: GenerateRequest, deadline: float | None = None) -> RequestHandle: ...
    # raises InvalidRequestError (bad params / prompt too long), QueueFullError, StoreUnavailableError
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]: ...
    def detokenize(self, ids: list[int]) -> str: ...
    def model_info(self) -> ModelInfo: ...
    def server_info(self) -> ServerInfo: ...
    def is_ready(self) -> bool: ...                # model loaded and store attached
