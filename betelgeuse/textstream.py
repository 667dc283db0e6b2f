"""Token ids -> text for one completion, with stop strings: a stop string ends the text, and neither it nor
anything after it is emitted. Used by the worker's engine (one per sequence) and the in-process loop
(model/generate.py)."""

from __future__ import annotations

from typing import Sequence

from betelgeuse.tokenizer import IncrementalDecoder


class TextStream:
    """Token ids -> newly completed text, holding back any tail that may start a stop string."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
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
