"""The in-process generation loop (prefill once, then one token per forward); stop strings through
textstream.TextStream. The CLI uses it; the worker's engine has its own scheduler but the same semantics:
a stop id ends generation and is not part of the completion; a stop string ends it and neither it
nor anything after it appears in the text."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from betelgeuse.api import SamplingParams
from betelgeuse.errors import InvalidRequestError
from betelgeuse.sampling import make_generator, sample, validate
from betelgeuse.textstream import TextStream


class Generation:
    """Iterating yields completion token ids; `new_text` is the text each one completed; when
    iteration ends, `tail` holds the last held-back text and `finish_reason` is "stop" | "length"."""

    def __init__(self, model, prompt_ids, max_tokens: int, sampling: SamplingParams,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None):
        validate(sampling)
        if max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {max_tokens}")
        if stop_strings and tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        self.model = model
        self.prompt = model.check_ids(prompt_ids)
        ctx = model.cfg.context_length
        if ctx and self.prompt.numel() >= ctx:
            raise InvalidRequestError(
                f"prompt of {self.prompt.numel()} tokens does not fit the context of {ctx} tokens")
        n_ctx = self.prompt.numel() + max_tokens
        self.max_tokens = min(max_tokens, ctx - self.prompt.numel()) if ctx else max_tokens
        self.sampling = sampling
        self.stop_ids = set(stop_ids)
        self.stream = TextStream(tokenizer, stop_strings) if tokenizer is not None else None
        self.cache = model.new_cache(min(n_ctx, ctx) if ctx else n_ctx)
        self.token_ids: list[int] = []
        self.new_text = ""                  # text completed by the last yielded token
        self.tail = ""                      # text released when iteration ends
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return self.stream.text if self.stream else ""

    def __iter__(self) -> Iterator[int]:
        gen = make_generator(self.sampling)
        logits = self.model.forward(self.prompt, self.cache)[-1]
        while True:
            if len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
                break
            tok = sample(logits, self.sampling, gen)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            self.token_ids.append(tok)
            self.new_text = self.stream.push(tok) if self.stream else ""
            yield tok
            if self.stream and self.stream.stopped:
                self.finish_reason = "stop"
                break
            if len(self.token_ids) < self.max_tokens:
                logits = self.model.forward(torch.tensor([tok]), self.cache)[-1]
        # text held back as a possible stop-string prefix that never completed
        self.tail = self.stream.flush() if self.stream and not self.stream.stopped else ""


def generate(model, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None,
             stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None) -> Generation:
    """Iterate the result for completion token ids (see Generation)."""
    return Generation(model, prompt_ids, max_tokens, sampling or SamplingParams(), stop_ids,
                      stop_strings, tokenizer)
