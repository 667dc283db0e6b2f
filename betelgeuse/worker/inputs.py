"""The input side: a GenerateRequest checked, tokenized and turned into a Sequence (vLLM's input processor).

It runs on the caller's (RPC) thread, before the request is queued, so a bad request costs the engine thread
nothing and is refused with an error naming the problem. Tokenizing is bounded twice: text over max_prompt_bytes
is refused before any tokenizing work, and at most tokenize_threads callers tokenize at once, so a flood of big
prompts cannot take every core from the engine thread.
"""

from __future__ import annotations

import threading

from betelgeuse.api import MAX_STOP, GenerateRequest
from betelgeuse.config import EngineConfig
from betelgeuse.errors import InvalidRequestError
from betelgeuse.gguf.modelconfig import ModelConfig
from betelgeuse.sampling import make_generator, validate
from betelgeuse.textstream import TextStream
from betelgeuse.tokenizer import Tokenizer
from betelgeuse.worker.sequence import Sequence

MAX_CACHE_SALT_BYTES = 256             # GenerateRequest.cache_salt
MAX_NESTING = 64                       # levels of lists / objects in chat_template_kwargs, tools, schemas


def check_text(x, field: str) -> None:
    """Refuse what the tokenizer and the template renderer cannot take, naming where it is: a lone surrogate
    (JSON's "\\udc80" parses to one; it is no Unicode character and has no UTF-8), or objects nested deeper than
    MAX_NESTING (the renderer would recurse past Python's limit). Iterative, so any depth is safe to walk."""
    todo = [(x, field, 0)]
    while todo:
        v, where, depth = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"{where} holds a lone surrogate (U+{ord(v[e.start]):04X}) at character "
                                          f"{e.start}: text must be valid Unicode") from None
            continue
        if isinstance(v, (dict, list, tuple)):
            if depth >= MAX_NESTING:
                raise InvalidRequestError(f"{where} is nested deeper than {MAX_NESTING} levels")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    todo.append((k, f"{where} (a key)", depth + 1))
                todo.append((item, f"{where}.{k}", depth + 1))


def _text_bytes(x) -> int:
    """UTF-8 bytes of every string inside x (messages, tool definitions): what tokenizing would have to read."""
    if isinstance(x, str):
        return len(x.encode("utf-8", "surrogatepass"))
    if isinstance(x, dict):
        return sum(_text_bytes(k) + _text_bytes(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return sum(_text_bytes(v) for v in x)
    return 0


class RequestProcessor:
    def __init__(self, cfg: EngineConfig, mcfg: ModelConfig, tokenizer: Tokenizer, dialect):
        from betelgeuse.grammar import Grammars
        self.cfg, self.tokenizer, self.dialect = cfg, tokenizer, dialect
        self.n_vocab = mcfg.n_vocab
        self.ctx = min(cfg.max_context, mcfg.context_length or cfg.max_context)   # a prompt and its output
        self.grammars = Grammars(tokenizer)
        self._tokenize_slots = threading.BoundedSemaphore(max(1, cfg.tokenize_threads))

    # ---- checks that cost nothing --------------------------------------------------------------------
    def check(self, req: GenerateRequest):
        """The request's own parameters: sampling, max_tokens, stops, the output format's text, cache_salt."""
        validate(req.sampling)
        if req.max_tokens is not None and (isinstance(req.max_tokens, bool) or req.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be >= 1 (or unset: until EOS or the context), got {req.max_tokens}")
        self._check_vocab(req.stop_token_ids, "stop token id")
        if len(req.stop) > MAX_STOP:
            raise InvalidRequestError(f"stop has {len(req.stop)} strings, over the limit of {MAX_STOP}")
        check_text(list(req.stop), "stop")
        if req.grammar is not None:
            check_text(req.grammar.value, "the output format (response_format / structured_outputs)")
        if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise InvalidRequestError(f"cache_salt is {len(req.cache_salt.encode())} bytes, over the limit of "
                                      f"{MAX_CACHE_SALT_BYTES}")

    def check_text_bytes(self, n: int, what: str = "the prompt"):
        """Refuse text over max_prompt_bytes before any tokenizing work is spent on it."""
        if n > self.cfg.max_prompt_bytes:
            raise InvalidRequestError(f"{what} is {n} bytes, over the limit of {self.cfg.max_prompt_bytes} bytes "
                                      "(max_prompt_bytes)")

    def _check_vocab(self, ids, what: str = "token id"):
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} {bad} is out of range [0, {self.n_vocab})")

    # ---- tokens ------------------------------------------------------------------------------------
    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        forms = [req.prompt_text is not None, req.prompt_ids is not None, req.messages is not None]
        if sum(forms) != 1:
            raise InvalidRequestError("give exactly one of prompt text, prompt token ids or chat messages")
        if req.prompt_ids is not None and len(req.prompt_ids) >= self.ctx:
            raise InvalidRequestError(f"prompt of {len(req.prompt_ids)} tokens does not fit the context of "
                                      f"{self.ctx} tokens")
        if req.prompt_text is not None:
            self.check_text_bytes(len(req.prompt_text.encode("utf-8", "surrogatepass")))
            check_text(req.prompt_text, "prompt")
        if req.messages is not None:
            self.check_text_bytes(_text_bytes(req.messages) + _text_bytes(getattr(req, "tools", None)),
                                  "the chat messages' text")
            for name in ("messages", "tools", "chat_template_kwargs"):
                check_text(getattr(req, name, None), name)
        if req.prompt_ids is None:
            with self._tokenize_slots:
                return self._check_ids(self._encode(req))
        return self._check_ids(list(req.prompt_ids))

    def _encode(self, req: GenerateRequest) -> list[int]:
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequestError("messages is empty")
            # control tokens come only from the template (encode_chat), never from the messages' text
            return self.tokenizer.encode_chat(req.messages, add_generation_prompt=True, tools=req.tools,
                                              template_kwargs=req.chat_template_kwargs)
        return self.tokenizer.encode(req.prompt_text, add_special=False, parse_special=req.parse_special)

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        self._check_vocab(ids)
        return ids

    def room(self, req: GenerateRequest, ids: list[int]) -> int:
        """Tokens of output the context leaves after the prompt; refused when the prompt fills it, or when max_tokens
        asks for more (OpenAI's and vLLM's answer: a 400 naming the numbers, never a silent cut at the context) unless
        the request says max_tokens is only an upper bound (fit_context: the Anthropic edge)."""
        ctx = self.ctx
        if len(ids) >= ctx:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens does not fit the context of {ctx} tokens")
        if req.max_tokens is not None and len(ids) + req.max_tokens > ctx and not req.fit_context:
            e = InvalidRequestError(
                f"max_tokens {req.max_tokens} does not fit the context: the prompt is {len(ids)} tokens of the "
                f"context's {ctx}, so at most {ctx - len(ids)} new tokens (or leave max_tokens unset: until EOS or "
                "the end of the context)")
            e.param = "max_tokens"
            raise e
        return ctx - len(ids)

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        self.check_text_bytes(len(text.encode("utf-8", "surrogatepass")), "the text")
        check_text(text, "the text")
        with self._tokenize_slots:
            return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        self._check_vocab(ids)
        return self.tokenizer.decode(ids)

    # ---- the sequence --------------------------------------------------------------------------------
    def sequence(self, req: GenerateRequest, ids: list[int], room: int, deadline: float | None) -> Sequence:
        """The checked request as a Sequence: its stop ids, text stream, sampler, grammar constraint and whether
        its output starts inside a think block. room: tokens of output its context leaves (room())."""
        stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.tokenizer.eos_ids))
        # a chat whose rendered prompt leaves a think block open: the output starts as reasoning
        reasoning = req.messages is not None and self.dialect.opens_reasoning(
            self.tokenizer.decode(ids[-16:], skip_special=False))
        constraint, parse_tools = self._constraint(req, reasoning)
        return Sequence(req, ids, room if req.max_tokens is None else min(req.max_tokens, room), frozenset(stop_ids),
                        TextStream(self.tokenizer, req.stop), deadline=deadline,
                        generator=make_generator(req.sampling), constraint=constraint, parse_tools=parse_tools,
                        dialect=self.dialect, reasoning=reasoning)

    def _constraint(self, req: GenerateRequest, reasoning: bool = False):
        """(grammar constraint or None, parse tool calls?) from response_format and tools / tool_choice, in the
        model's dialect; `reasoning`: the output starts inside a think block, which it closes first."""
        from betelgeuse.grammar import after_reasoning, tool_call_grammar
        choice, tools = req.tool_choice, req.tools or []
        if req.tools is not None and not isinstance(req.tools, list):
            raise InvalidRequestError("tools must be a list")
        if choice not in (None, "none", "auto", "required") and not (
                isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str)):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}')
        if choice not in (None, "none", "auto") and not tools:
            raise InvalidRequestError("tool_choice needs tools")
        forced = None
        if choice == "required":
            forced = tool_call_grammar(tools, None, self.dialect, reasoning)
        elif isinstance(choice, dict):
            forced = tool_call_grammar(tools, choice["function"]["name"], self.dialect, reasoning)
        if forced is not None and req.grammar is not None:
            raise InvalidRequestError("response_format cannot be combined with a forced tool_choice")
        g = forced or (after_reasoning(req.grammar, self.dialect, reasoning) if req.grammar is not None else None)
        try:
            return (self.grammars.constraint(g) if g is not None else None), bool(tools) and choice != "none"
        except InvalidRequestError as e:     # a forced call's error names the generated Lark: name the tool instead
            bad = self.grammars.bad_tool(tools, choice["function"]["name"] if isinstance(choice, dict) else None) \
                if forced is not None else None
            raise (bad or e) from None
