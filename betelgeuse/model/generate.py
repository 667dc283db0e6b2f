"""The in-process generation loop (prefill once, then one token per forward) and stop-string
handling. The CLI uses it; the worker's engine has its own scheduler but the same semantics:
a stop id ends generation and is not part of the completion; a stop string ends it and neither it
nor anything after it appears in the text."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from betelgeuse.errors import InvalidRequestError
from betelgeuse.model.sampler import make_generator, sample, validate
from betelgeuse.worker.api import SamplingParams


class TextStream:
    """Token ids -> newly completed text, holding back any tail that may start a stop string."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        from betelgeuse.tokenizer import IncrementalDecoder
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = [s for s in stop_strings if s]
        self.pending = ""       # decoded text not yet emitted (a possible stop-string prefix)
        self.text = ""          # everything emitted so far
        self.stopped = False
        self.matched = ""       # the stop string that fired (the earliest in the text)

    def push(self, token_id: int) -> str:
        """Returns the text that is now safe to emit; sets `stopped` when a stop string appeared."""
        assert not self.stopped
        self.pending += self.decoder.push(token_id)
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            out, self.pending, self.stopped = self.pending[:at], "", True
        else:
            keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                        if self.pending.endswith(s[:n])), default=0)
            cut = len(self.pending) - keep
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return out

    def flush(self) -> str:
        """End of stream: release the held-back tail (and any incomplete character as U+FFFD)."""
        out, self.pending = self.pending + self.decoder.flush(), ""
        self.text += out
        return out


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
