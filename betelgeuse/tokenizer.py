"""Tokenizer and chat template from GGUF metadata (llama.cpp's `tokenizer.*` keys).

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`, the Qwen/Llama-3/DeepSeek family) is
supported; the vocabulary, merges and special tokens come from the file and are handed to the
`tokenizers` library (token types and pre-tokenizer splits: gguf/vocab.py). Also here: `read_metadata` (a fast
GGUF key/value reader: the 150k-entry token arrays parse in well under a second).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from datetime import datetime
from typing import Any


from tokenizers import Tokenizer as HFTokenizer

from betelgeuse.errors import InvalidRequestError, ModelFormatError, UnsupportedError
from betelgeuse.gguf.header import read_header
from betelgeuse.gguf.vocab import CONTROL, NORMAL, PRE_SPLITS, UNUSED, USER_DEFINED, bpe_tokenizer

# ---- GGUF metadata -------------------------------------------------------------------------

def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """GGUF key -> python value (str, int, float, bool, or list of those); tensors are not read.
    One GGUF parser serves the whole package: this is betelgeuse.gguf.header's."""
    return read_header(os.fspath(path)).metadata


# ---- the tokenizer -------------------------------------------------------------------------

class Tokenizer:
    """Byte-level BPE tokenizer + chat template, built from GGUF metadata."""

    def __init__(self, tok: HFTokenizer, metadata: dict[str, Any], tokens: list[str], types: list[int]):
        self._tok = tok
        self._tokens = tokens
        self._types = types
        self._md = metadata
        self.n_vocab = len(tokens)
        self.bos_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        ids = {self.eos_id, metadata.get("tokenizer.ggml.eot_token_id"), metadata.get("tokenizer.ggml.eom_token_id")}
        ids |= {tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}
        self.eos_ids: frozenset[int] = frozenset(i for i in ids if i is not None and 0 <= i < self.n_vocab)
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and self.bos_id is not None
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
        self._skip = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNUSED))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        # the same tokenizer with special-token text treated as ordinary characters (HF's split_special_tokens):
        # user content goes through this one, so "<|im_end|>" typed by a user is 5 plain tokens, never a control token
        self._plain = HFTokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True
        specials = sorted({t for t, k in zip(tokens, types) if k == CONTROL and t}, key=len, reverse=True)
        self.special_texts: tuple[str, ...] = tuple(specials)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    @classmethod
    def from_metadata(cls, metadata: dict) -> "Tokenizer":
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedError(f"tokenizer model {kind!r} not supported (only 'gpt2' byte-level BPE)")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError("GGUF has no tokenizer.ggml.tokens")
        types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ModelFormatError(f"token_type has {len(types)} entries for {len(tokens)} tokens")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_SPLITS:
            raise UnsupportedError(f"tokenizer pre-tokenizer {pre!r} not supported (known: {', '.join(PRE_SPLITS)})")
        tok = bpe_tokenizer(list(tokens), types, list(metadata.get("tokenizer.ggml.merges", [])), PRE_SPLITS[pre])
        return cls(tok, metadata, list(tokens), types)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        return cls.from_metadata(read_metadata(path))

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. parse_special: special-token text written in it (`<|im_start|>`) becomes the
        control token (the library default, for trusted text); False encodes it as ordinary characters
        (what the public APIs do with user text unless the caller asks)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        ids = (self._tok if parse_special else self._plain).encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos:
            ids = ids + [self.eos_id]
        return ids

    def _check(self, ids: list[int]) -> None:
        for i in ids:
            if not 0 <= i < self.n_vocab:
                raise InvalidRequestError(f"token id {i} out of range [0, {self.n_vocab})")

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        self._check(ids)
        if skip_special:
            ids = [i for i in ids if i not in self._skip]
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        """The text of one token (bytes of an incomplete UTF-8 character become U+FFFD)."""
        self._check([i])
        if self._types[i] in (CONTROL, USER_DEFINED, UNUSED):
            return self._tokens[i]
        return self._tok.decode([i], skip_special_tokens=False)

    # names the template sees that chat_template_kwargs may not replace
    RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})

    def _render(self, messages, tools, add_generation_prompt: bool, template_kwargs: dict | None) -> str:
        if not self.chat_template:
            raise InvalidRequestError("the model has no chat template (tokenizer.chat_template missing); send text")
        check_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of objects")
        kwargs = dict(template_kwargs or {})
        bad = sorted(self.RESERVED_TEMPLATE_VARS & kwargs.keys())
        if bad:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(bad)}")
        from jinja2.exceptions import TemplateError

        def piece(i):
            return self._tokens[i] if i is not None and 0 <= i < self.n_vocab else ""
        try:
            return _compile(self.chat_template).render(
                **kwargs, messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                bos_token=piece(self.bos_id), eos_token=piece(self.eos_id))
        except TemplateError as e:
            raise InvalidRequestError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:   # a template choking on the request's shapes
            raise InvalidRequestError(f"chat template cannot render these messages: {e}") from None

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes of one token (byte-level BPE spelling undone; special tokens as their UTF-8 text)."""
        self._check([i])
        t = self._tokens[i]
        if self._types[i] in (CONTROL, USER_DEFINED, UNUSED):
            return t.encode()
        table = _byte_decoder()
        return bytes(table[c] for c in t) if all(c in table for c in t) else t.encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs) -> str:
        """The rendered prompt text (as transformers' apply_chat_template(tokenize=False)). Encoding it with
        encode() would let special-token text in the messages become control tokens: use encode_chat()."""
        return self._render(messages, tools, add_generation_prompt, template_kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the rendered chat, with control tokens coming only from the template.

        Every special-token text inside the request's strings (message contents, tool calls, tool definitions,
        template kwargs), and any beginning or end of one at a string's edges, is swapped for a marker carrying
        a per-call random nonce before rendering; the rendered text is split at the markers, template text is
        encoded with special tokens recognised, and the marked pieces as plain characters.
        """
        if self._special_re is None:
            return self.encode(self._render(messages, tools, add_generation_prompt, template_kwargs))
        nonce = secrets.token_hex(8)
        pieces: list[str] = []

        def mark(text: str) -> str:
            pieces.append(text)
            return f"\ue000{nonce}{len(pieces) - 1}\ue001"

        def walk(x):
            if isinstance(x, str):
                return self._mark_specials(x, mark)
            if isinstance(x, dict):
                return {walk(k) if isinstance(k, str) else k: walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [walk(v) for v in x]
            return x
        check_messages(messages)
        text = self._render(walk(messages), walk(tools) if tools is not None else None, add_generation_prompt,
                            walk(template_kwargs or {}))
        ids: list[int] = []
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", text)
        for k, part in enumerate(parts):
            if k % 2:
                ids += self._plain.encode(pieces[int(part)], add_special_tokens=False).ids
            elif part:
                ids += self._tok.encode(part, add_special_tokens=False).ids
        return ids

    def _mark_specials(self, text: str, mark) -> str:
        """Swap special-token texts in `text` (and a partial one of 2+ characters at either edge, which the
        template's own text could complete) for markers."""
        out = self._special_re.sub(lambda m: mark(m.group()), text)
        for s in self.special_texts:
            for n in range(len(s) - 1, 1, -1):
                if out.endswith(s[:n]):
                    out = out[:-n] + mark(s[:n])
                    break
            for n in range(len(s) - 1, 1, -1):
                if out.startswith(s[-n:]):
                    out = mark(s[-n:]) + out[n:]
                    break
        return out


def check_messages(messages) -> None:
    """Chat messages: a list of {"role": str, "content": str | None, ...} (tool_calls etc. pass to the template)."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or (m.get("content") is None and "content" in m)) for m in messages):
        raise InvalidRequestError("messages must be a list of {'role': str, 'content': str}")


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level BPE token uses for each byte."""
    if not _BYTE_DECODER:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER.update({chr(c): b for b, c in zip(bs, cs)})
    return _BYTE_DECODER


_TEMPLATES: dict[str, Any] = {}


def _compile(source: str):
    """Jinja2 sandboxed like transformers: trim/lstrip blocks, raise_exception, tojson, strftime_now (and from_json)."""
    if source in _TEMPLATES:
        return _TEMPLATES[source]
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.filters["from_json"] = json.loads          # DeepSeek-V4's template reads tool-call arguments given as JSON text
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        t = env.from_string(source)
    except TemplateError as e:
        raise InvalidRequestError(f"chat template does not compile: {e}") from None
    _TEMPLATES[source] = t
    return t


class IncrementalDecoder:
    """Streaming detokenization that never emits half a UTF-8 character (TGI's offsets scheme)."""

    def __init__(self, tok: Tokenizer, skip_special: bool = True):
        self.tok = tok
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0   # ids[prefix:read] is already emitted context, re-decoded for spacing
        self.read = 0

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip_special)
        now = self.tok.decode(self.ids[self.prefix:], self.skip_special)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end of a stream (an incomplete character becomes U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip_special)
        now = self.tok.decode(self.ids[self.prefix:], self.skip_special)
        self.prefix = self.read = len(self.ids)
        return now[len(before):]
