"""The output side of a step: one token sampled from each sequence's logits and streamed, the stop rules, what each
pass cost each request, and what a request reports when it ends: usage, its final event (or error), the one log
line per request, the metrics (vLLM's output processor).

token() returns a finish decision (Finish) instead of ending the sequence itself: the engine frees what the
sequence held, then calls finish() with that decision.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from betelgeuse.api import TokenEvent
from betelgeuse.errors import BetelgeuseError, InternalError
from betelgeuse.logs import event
from betelgeuse.sampling import apply_allowed, apply_penalties, sample, token_logprobs
from betelgeuse.worker.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from betelgeuse.worker.stats import PassStats

log = logging.getLogger("betelgeuse.engine")


@dataclass(frozen=True, slots=True)
class Finish:
    """Why a sequence ends: reason "stop" | "length" | "cancelled" (its FinalEvent), or `error` (the handle raises it).
    stop_reason: "eos" | "stop_token" | "stop_string" | "grammar" (FinalEvent.stop_reason)."""
    reason: str
    stop_reason: str = ""
    stop_token_id: int | None = None
    error: BetelgeuseError | None = None

    @staticmethod
    def failed(err: BetelgeuseError) -> Finish:
        return Finish("error", error=err)


class OutputProcessor:
    def __init__(self, metrics=None, routing: str = "exact"):
        self.metrics = metrics
        self.routing = routing          # every request's usage names the routing mode (approximate ones differ)

    # ---- the prompt phase -------------------------------------------------------------------------
    def admitted(self, seq: Sequence):
        """Usage of the queue: arrival to admission (Scheduler.schedule stamped t_prefill_start)."""
        seq.usage.queue_ms = (seq.t_prefill_start - seq.arrival) * 1e3
        seq.usage.routing = self.routing
        if self.metrics:
            self.metrics.request_queue.observe(seq.t_prefill_start - seq.arrival)

    @staticmethod
    def prompt_done(seq: Sequence):
        """Usage of the prompt phase: admission to the first token's logits, tokens computed per second."""
        P = seq.prompt_ids
        seq.usage.prompt_n = len(P)
        seq.usage.prompt_ms = (time.monotonic() - seq.t_prefill_start) * 1e3
        computed = len(P) - seq.usage.cached_tokens
        seq.usage.prompt_per_second = computed / (seq.usage.prompt_ms / 1e3) if seq.usage.prompt_ms > 0 else 0.0

    # ---- one token ----------------------------------------------------------------------------------
    def token(self, seq: Sequence, logits: torch.Tensor) -> Finish | None:
        """Sample and emit one token from logits [n_vocab] -> how the sequence ends now, or None while it goes on.
        A failure here is this sequence's alone (invariant 7): a Finish carrying the error."""
        try:
            return self._sample_emit(seq, logits)
        except Exception as e:                       # noqa: BLE001
            return self.failure(seq, e)

    @staticmethod
    def failure(seq: Sequence, e: Exception) -> Finish:
        """Sampling or ending this sequence raised: logged, and it fails alone (a bug: InternalError)."""
        if isinstance(e, BetelgeuseError):
            log.warning("request %s failed: %s", seq.request.request_id or seq.seq_id, e)
            return Finish.failed(e)
        log.error("sampling for request %s failed", seq.request.request_id or seq.seq_id, exc_info=e)
        return Finish.failed(InternalError("internal error sampling this request; see the worker log"))

    def _sample_emit(self, seq: Sequence, logits: torch.Tensor) -> Finish | None:
        sp = seq.request.sampling
        x = apply_penalties(logits, sp, seq.prompt_ids, seq.out_ids)
        if seq.constraint is not None:
            x = apply_allowed(x, seq.constraint.allowed())
        tok = sample(x, sp, seq.generator)
        now = time.monotonic()
        if tok in seq.stop_ids:
            return Finish("stop", "stop_token" if tok in seq.request.stop_token_ids else "eos", tok)
        lp, top = token_logprobs(logits, tok, sp.top_logprobs) if sp.logprobs or sp.top_logprobs else (None, [])
        if seq.constraint is not None:
            seq.constraint.accept(tok)
        if not seq.out_ids:
            seq.t_first = now
            seq.usage.ttft_ms = (now - seq.arrival) * 1e3
            if self.metrics:
                self.metrics.ttft.observe(now - seq.arrival)
        elif self.metrics:
            self.metrics.inter_token.observe(now - seq.t_last)
        seq.t_last = now
        seq.out_ids.append(tok)
        text = seq.stream.push(tok)
        grammar_done = seq.constraint is not None and seq.constraint.done
        if not seq.stream.stopped and (grammar_done or len(seq.out_ids) >= seq.max_tokens):
            # the last token (length / complete grammar): its event carries the held-back text too, so a client
            # reading only TokenEvents has all of it; FinalEvent.tail is then "" (it stays for EOS / stop ids)
            text += seq.stream.flush()
        seq.emit(TokenEvent(token_id=tok, text=text, index=len(seq.out_ids) - 1, logprob=lp, top_logprobs=top))
        if seq.stream.stopped:
            return Finish("stop", "stop_string")
        if grammar_done:
            return Finish("stop", "grammar")
        if len(seq.out_ids) >= seq.max_tokens:
            return Finish("length")
        return None

    # ---- what a pass cost ---------------------------------------------------------------------------
    def account(self, seq: Sequence, st: PassStats, count_metrics: bool = True):
        """A pass the sequence was in: its expert reads and bytes (each request waited the whole pass), and the
        pass into the metrics once (count_metrics for the first of its sequences)."""
        u = seq.usage
        u.expert_reads_vram += st.reads["vram"]
        u.expert_reads_host += st.reads["host"]
        u.expert_reads_disk += st.reads["disk"]
        u.disk_bytes += st.disk_bytes
        u.disk_wait_ms += st.disk_wait_s * 1e3
        u.h2d_bytes += st.h2d_bytes
        g = st.engram                               # deepseek41's Engram rows of the pass
        if g is not None:
            u.engram_rows += g.rows
            u.engram_disk_bytes += g.disk_bytes
            u.engram_wait_ms += g.wait_s * 1e3
        phase = "prefill" if st.kind == "prefill" else "decode"
        m = self.metrics if count_metrics else None
        if m:
            (m.prompt_tokens if phase == "prefill" else m.generation_tokens).inc(st.n_tokens)
            m.busy_seconds.labels(phase=phase).inc(st.seconds)
            for tier, n in st.reads.items():
                m.expert_reads.labels(tier=tier, phase=phase).inc(n)
            m.disk_wait_seconds.labels(phase=phase).inc(st.disk_wait_s)
            if st.guessed:
                m.decode_guesses.labels(outcome="hit").inc(st.guess_hits)
                m.decode_guesses.labels(outcome="miss").inc(st.guessed - st.guess_hits)
                m.decode_guess_bytes.labels(outcome="used").inc(max(0, st.guess_bytes - st.guess_wasted_bytes))
                m.decode_guess_bytes.labels(outcome="wasted").inc(st.guess_wasted_bytes)
            m.flex_hits.inc(st.flex_hits)
            m.h2d_bytes.inc(st.h2d_bytes)
            m.h2d_seconds.inc(sum(l.copy_ms for l in st.layers) / 1e3)
            if g is not None:
                m.engram_rows.labels(phase=phase).inc(g.rows)
                m.engram_wait_seconds.labels(phase=phase).inc(g.wait_s)

    # ---- the end ------------------------------------------------------------------------------------
    def finish(self, seq: Sequence, fin: Finish):
        """The request's last word: its metrics, then its FinalEvent (or the error its handle raises), its log line."""
        if fin.error is not None:
            seq.fail(fin.error)
            self.log_request(seq, "error", error=" ".join(str(fin.error).split()), error_type=type(fin.error).__name__)
            return
        u = seq.usage
        u.predicted_n = len(seq.out_ids)
        # decode passes produce tokens 2..n; the first comes from the prefill pass
        if u.predicted_n > 1:
            u.predicted_ms = (seq.t_last - seq.t_first) * 1e3     # first to last token, as the client saw them
            u.predicted_per_second = (u.predicted_n - 1) / (u.predicted_ms / 1e3) if u.predicted_ms > 0 else 0.0
        if self.metrics:    # before the final event: whoever sees the request end (its servicer) sees these counted
            m = self.metrics
            m.requests_finished.labels(finish_reason=fin.reason).inc()
            m.request_duration.observe(time.monotonic() - seq.arrival)
            m.request_prompt_tokens.observe(len(seq.prompt_ids))
            m.request_generation_tokens.observe(len(seq.out_ids))
        seq.finish(fin.reason, fin.stop_reason, fin.stop_token_id)
        self.log_request(seq, "deadline_exceeded" if fin.reason == "cancelled" and seq.expired and not seq.cancelled
                         else fin.reason)

    @staticmethod
    def log_request(seq: Sequence, status: str, **extra):
        """The one line per request (docs/architecture.md, "Logs"): what an operator greps for."""
        u = seq.usage
        event(log, "request", logging.WARNING if status == "error" else logging.INFO,
              id=seq.request.request_id or str(seq.seq_id), status=status, prompt_tokens=len(seq.prompt_ids),
              cached_tokens=getattr(u, "cached_tokens", 0), completion_tokens=len(seq.out_ids),
              ttft_ms=u.ttft_ms if seq.out_ids else None, pp_tok_s=u.prompt_per_second,
              tg_tok_s=u.predicted_per_second, reads_vram=u.expert_reads_vram, reads_host=u.expert_reads_host,
              reads_disk=u.expert_reads_disk, disk_bytes=u.disk_bytes, disk_wait_ms=u.disk_wait_ms,
              duration_ms=(time.monotonic() - seq.arrival) * 1e3, **extra)
