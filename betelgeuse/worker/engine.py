"""The worker's engine: a busy loop of numbered steps fed by a bounded queue (vLLM v1's engine core).

    submit() ─► waiting (bounded) ─► step(): 1. drop cancelled/expired
                                            2. admit waiting requests while fewer than max_running run
                                            3. one prefill pass over the prefilling sequences, oldest first:
                                               each prompt after its longest cached prefix (prefix cache), in
                                               whole chunks, at most max_batched_tokens in all while others
                                               decode (chunked prefill), prefill_pass_tokens while none do
                                            4. one decode token for every decoding sequence, in one batched pass
                                            5. finish: FinalEvent, free the KV cache, release prefix blocks, consolidate
The runner does the passes; this module only schedules them and turns tokens into events.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque

import torch

from betelgeuse import __version__
from betelgeuse.api import MAX_STOP, GenerateRequest, ModelInfo, ServerInfo, TokenEvent
from betelgeuse.config import EngineConfig
from betelgeuse.errors import (BetelgeuseError, CancelledError, InternalError, InvalidRequestError, QueueFullError,
                               ShuttingDownError, StoreUnavailableError)
from betelgeuse.gguf.qtypes import qtype_name
from betelgeuse.logs import event
from betelgeuse.sampling import (apply_allowed, apply_penalties, make_generator, sample, token_logprobs,
                                 validate)
from betelgeuse.store.client import StoreClient
from betelgeuse.textstream import TextStream
from betelgeuse.tokenizer import Tokenizer
from betelgeuse.worker.prefix_cache import PrefixCache, PrefixStats
from betelgeuse.worker.runner import ModelRunner, PassStats
from betelgeuse.worker.sequence import RequestHandle, Sequence, check_alive

log = logging.getLogger("betelgeuse.engine")
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


class LLMEngine:
    def __init__(self, cfg: EngineConfig, store: StoreClient, metrics=None, on_tick=None, on_state=None):
        self.cfg = cfg
        self.on_state = on_state                    # on_state(ready: bool) when the store goes away / comes back
        self.draining = False                       # set by drain(): new work is refused
        self.last_tick = time.monotonic()           # the loop's heartbeat (watchdog: is the engine stuck?)
        # tokenizing runs on the caller's (RPC) thread; at most this many at once, so a flood of big prompts
        # cannot take every core from the engine thread
        self._tokenize_slots = threading.BoundedSemaphore(max(1, cfg.tokenize_threads))
        self.runner = ModelRunner(cfg, store)
        self.tokenizer = Tokenizer.from_metadata(self.runner.file.metadata)
        from betelgeuse.grammar import Grammars
        from betelgeuse.reasoning import dialect_for
        self.grammars = Grammars(self.tokenizer)
        # how this model family writes reasoning and tool calls (its chat template says; the arch if it has none)
        self.dialect = dialect_for(self.tokenizer.chat_template, self.runner.mcfg.arch)
        self.metrics = metrics
        self.prefix_cache = self._make_prefix_cache()   # None: off, or not possible for this model/schedule
        self._exported = PrefixStats()                  # prefix-cache counters already added to the metrics
        self.on_tick = on_tick                      # called every loop turn (watchdog ping)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cv = threading.Condition()
        self.store_ok = True
        self.store_why = ""                          # why the store is unavailable (its last error), for refusals
        self.started = time.monotonic()
        self._stop = False
        self._store_lost: StoreUnavailableError | None = None   # set by a health probe on another thread
        self._gauges()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ---- requests in --------------------------------------------------------------------------
    def check_text_bytes(self, n: int, what: str = "the prompt"):
        """Refuse text over max_prompt_bytes before any tokenizing work is spent on it."""
        if n > self.cfg.max_prompt_bytes:
            raise InvalidRequestError(f"{what} is {n} bytes, over the limit of {self.cfg.max_prompt_bytes} bytes "
                                      "(max_prompt_bytes)")

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        forms = [req.prompt_text is not None, req.prompt_ids is not None, req.messages is not None]
        if sum(forms) != 1:
            raise InvalidRequestError("give exactly one of prompt text, prompt token ids or chat messages")
        ctx = min(self.cfg.max_context, self.runner.mcfg.context_length or self.cfg.max_context)
        if req.prompt_ids is not None and len(req.prompt_ids) >= ctx:
            raise InvalidRequestError(f"prompt of {len(req.prompt_ids)} tokens does not fit the context of {ctx} tokens")
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
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
        elif req.messages is not None:
            if not req.messages:
                raise InvalidRequestError("messages is empty")
            # control tokens come only from the template (encode_chat), never from the messages' text
            ids = self.tokenizer.encode_chat(req.messages, add_generation_prompt=True, tools=req.tools,
                                             template_kwargs=req.chat_template_kwargs)
        else:
            ids = self.tokenizer.encode(req.prompt_text, add_special=False, parse_special=req.parse_special)
        return ids

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        n_vocab = self.runner.mcfg.n_vocab
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of range [0, {n_vocab})")
        return ids

    def submit(self, req: GenerateRequest, deadline: float | None = None) -> RequestHandle:
        try:
            return self._submit(req, deadline)
        except BetelgeuseError as e:            # refused before it was queued: still one line
            event(log, "request", logging.WARNING, id=req.request_id or None, status="rejected",
                  error=" ".join(str(e).split()), error_type=type(e).__name__)
            raise

    def _submit(self, req: GenerateRequest, deadline: float | None) -> RequestHandle:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        validate(req.sampling)
        if req.max_tokens is not None and (isinstance(req.max_tokens, bool) or req.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be >= 1 (or unset: until EOS or the context), got {req.max_tokens}")
        bad = next((t for t in req.stop_token_ids if not 0 <= t < self.runner.mcfg.n_vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"stop token id {bad} is out of range [0, {self.runner.mcfg.n_vocab})")
        if len(req.stop) > MAX_STOP:
            raise InvalidRequestError(f"stop has {len(req.stop)} strings, over the limit of {MAX_STOP}")
        check_text(list(req.stop), "stop")
        if req.grammar is not None:
            check_text(req.grammar.value, "the output format (response_format / structured_outputs)")
        if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise InvalidRequestError(f"cache_salt is {len(req.cache_salt.encode())} bytes, over the limit of "
                                      f"{MAX_CACHE_SALT_BYTES}")
        if len(self.waiting) >= self.cfg.max_queue:      # cheap, before the tokenizing work
            raise QueueFullError(f"the request queue is full ({self.cfg.max_queue} waiting); retry later")
        ids = self.prompt_ids(req)
        ctx = min(self.cfg.max_context, self.runner.mcfg.context_length or self.cfg.max_context)
        if len(ids) >= ctx:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens does not fit the context of {ctx} tokens")
        if req.max_tokens is not None and len(ids) + req.max_tokens > ctx:
            # OpenAI's (and vLLM's) answer: a 400 naming the numbers, never a silent cut at the context
            e = InvalidRequestError(
                f"max_tokens {req.max_tokens} does not fit the context: the prompt is {len(ids)} tokens of the "
                f"context's {ctx}, so at most {ctx - len(ids)} new tokens (or leave max_tokens unset: until EOS or "
                "the end of the context)")
            e.param = "max_tokens"
            raise e
        if not self.store_ok:
            raise StoreUnavailableError(f"the expert store is unavailable ({self.store_why or 'restarting'}); retry "
                                        "when health is SERVING")
        stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.tokenizer.eos_ids))
        # a chat whose rendered prompt leaves a think block open: the output starts as reasoning
        reasoning = req.messages is not None and self.dialect.opens_reasoning(
            self.tokenizer.decode(ids[-16:], skip_special=False))
        constraint, parse_tools = self._constraint(req, reasoning)
        room = ctx - len(ids)
        seq = Sequence(req, ids, room if req.max_tokens is None else min(req.max_tokens, room), frozenset(stop_ids),
                       TextStream(self.tokenizer, req.stop), deadline=deadline,
                       generator=make_generator(req.sampling), constraint=constraint, parse_tools=parse_tools,
                       dialect=self.dialect, reasoning=reasoning)
        with self.cv:
            if len(self.waiting) >= self.cfg.max_queue:
                raise QueueFullError(f"the request queue is full ({self.cfg.max_queue} waiting); retry later")
            self.waiting.append(seq)
            self.cv.notify_all()
        self._gauges()
        return RequestHandle(seq, self._wake)

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
        return (self.grammars.constraint(g) if g is not None else None), bool(tools) and choice != "none"

    def _wake(self):
        with self.cv:
            self.cv.notify_all()

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self):
        while not self._stop:
            self.last_tick = time.monotonic()
            if self.on_tick:
                self.on_tick()
            if self._store_lost is not None:
                err, self._store_lost = self._store_lost, None
                if self.store_ok:
                    self._store_down(err)
            with self.cv:
                if not self.waiting and not self.running:
                    self.cv.wait(0.5)
                    continue
            try:
                self.step()
            except Exception:                        # noqa: BLE001
                # a bug that no sequence's own boundary caught (invariant 7): fail the sequences of the
                # pass in flight, keep the waiting ones, keep serving
                log.exception("engine step failed")
                for seq in list(self.running):
                    self._drop(seq, InternalError("internal error in the engine; see the worker log"))

    def step(self):
        # 1. drop cancelled and expired sequences (the engine stops working on them now)
        for seq in [s for s in self.running if s.cancelled or s.expired]:
            self._finish(seq, "cancelled")
        with self.cv:
            for seq in [s for s in self.waiting if s.cancelled or s.expired]:
                self.waiting.remove(seq)
                self._finish(seq, "cancelled")
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.cfg.max_running:
                admitted.append(self.waiting.popleft())
        # 2. admit while there is room (each gets its KV cache; the plan reserved max_running of them)
        for seq in admitted:
            self._admit(seq)
        decoding = [s for s in self.running if not s.finished and not s.prefilling]
        # 3. one prefill pass over the prefilling sequences (several prompts share it: each expert loaded once for
        # all), 4. one decode token for each decoding sequence (their outputs never depend on the batch:
        # runner.decode_batch), so a long prompt arriving never stalls the running decodes for long
        pre = [s for s in self.running if s.prefilling and not s.finished]
        if pre:
            self._prefill(pre, decoding=bool(decoding))
        decoding = [s for s in decoding if not s.finished]
        # in the static form (CUDA) a lone sequence decodes through the batched lanes too: the same bits as batched
        if len(decoding) > 1 or (decoding and self.runner.decodes_in_lanes):
            self._decode_batch(decoding)
        elif decoding:
            self._decode(decoding[0])
        self._gauges()

    def _beat(self, seq: Sequence):
        """Between layers: the engine is alive (watchdog), and the sequence still wanted (may raise)."""
        self.last_tick = time.monotonic()
        check_alive(seq)

    def _pass(self, seqs: list[Sequence], run, what: str) -> tuple[list[torch.Tensor], PassStats] | None:
        """run(should_stop) -> (logits per sequence, the pass's stats): one pass for `seqs`. A cancelled or expired
        sequence stops it between layers and is finished; the others lose only the pass (nothing was committed:
        the next step redoes it). Any other failure cannot be pinned on one of several sequences: it fails all of
        them (invariant 7); the engine and the waiting ones go on. Returns None when the pass did not complete."""
        def should_stop():
            for seq in seqs:
                self._beat(seq)
        try:
            logits, st = run(should_stop)
        except CancelledError:
            for seq in [s for s in seqs if s.cancelled or s.expired] or seqs:
                self._finish(seq, "cancelled")
            return None
        except StoreUnavailableError as e:
            self._store_down(e)
            return None
        except BetelgeuseError as e:
            for seq in seqs:
                self._drop(seq, e)
            return None
        except Exception:                            # noqa: BLE001 (a bug or a bad value in this pass)
            log.exception("%s of %s failed", what, ", ".join(str(s.request.request_id or s.seq_id) for s in seqs))
            for seq in seqs:
                self._drop(seq, InternalError(f"internal error in {what}; see the worker log"))
            return None
        for i, seq in enumerate(seqs):
            self._account(seq, st, count_metrics=i == 0)    # each request waited the whole pass; metrics once
        return logits, st

    def _admit(self, seq: Sequence):
        seq.t_prefill_start = time.monotonic()
        seq.usage.queue_ms = (seq.t_prefill_start - seq.arrival) * 1e3
        if self.metrics:
            self.metrics.request_queue.observe(seq.t_prefill_start - seq.arrival)
        seq.kv = self.runner.new_cache(len(seq.prompt_ids) + seq.max_tokens)
        self.running.append(seq)

    def _prefill(self, seqs: list[Sequence], decoding: bool):
        """One prefill pass over prefilling sequences, oldest first. At a sequence's first, the longest cached
        prefix is copied in instead of computed (a whole cached prompt needs no pass). Then a piece of whole chunks
        of each (so the pieces give the bits of one pass): the first takes its rest, or at most max_batched_tokens
        of it while others decode (chunked prefill); the next join while the pass holds at most max_batched_tokens
        prompt tokens (prefill_pass_tokens while nothing decodes). The standard schedule prefills one at a time."""
        cap = self.cfg.max_batched_tokens if decoding else self.cfg.prefill_pass_tokens
        c = self.runner.chunk or 1
        pieces: list[tuple[Sequence, int]] = []
        for seq in seqs:
            if not self._lookup_prefix(seq):
                continue                                # the whole prompt was cached: its first token is out
            rest = len(seq.prompt_ids) - seq.n_done
            room = cap - sum(t for _, t in pieces)
            if not pieces:
                take = rest if not decoding or rest <= cap else max(c, cap // c * c)
            elif rest <= room:
                take = rest
            else:
                take = room // c * c
                if take <= 0:
                    continue
            pieces.append((seq, take))
            if self.cfg.schedule == "standard":
                break
        if not pieces:
            return
        seqs = [s for s, _ in pieces]
        parts = [(s.prompt_ids[s.n_done:s.n_done + t], s.kv) for s, t in pieces]
        out = self._pass(seqs, lambda stop: self._prefill_run(parts, stop), "a prefill pass")
        if out is None:
            return
        pc = self.prefix_cache
        for (seq, take), logits in zip(pieces, out[0]):
            seq.n_done += take
            last = seq.n_done == len(seq.prompt_ids)
            if pc is not None:
                salt, P = seq.request.cache_salt, seq.prompt_ids
                seq.blocks = pc.insert(seq.kv, P, seq.n_done, seq.blocks, salt)
                if last:
                    seq.blocks = pc.insert_tail(seq.kv, P, seq.blocks, logits, salt)
                self._prefix_metrics()
            if last:
                self._prompt_done(seq)
                self._emit_token(seq, logits)

    def _prefill_run(self, parts, stop):
        """The prefill pass itself: runner.prefill_batch (forward() for the standard schedule) -> (last-row logits
        [n_vocab] per piece, stats)."""
        if len(parts) == 1:
            lg, st = self.runner.forward(*parts[0], consolidate=True, should_stop=stop)
            return [lg[-1]], st
        lgs, st = self.runner.prefill_batch(parts, consolidate=True, should_stop=stop)
        return [lg[-1] for lg in lgs], st

    def _lookup_prefix(self, seq: Sequence) -> bool:
        """At a sequence's first prefill: the longest cached prefix is copied into its KV cache (prefix cache).
        -> False when that was the whole prompt: its first token is emitted from the cached logits, no pass."""
        pc, P = self.prefix_cache, seq.prompt_ids
        if seq.looked_up or pc is None:
            seq.looked_up = True
            return True
        seq.looked_up = True
        blocks = pc.lookup(P, seq.request.cache_salt)
        pc.acquire(blocks)
        seq.blocks = blocks
        seq.n_done = seq.usage.cached_tokens = pc.load(seq.kv, blocks)
        self._prefix_metrics()
        if seq.n_done < len(P):
            return True
        self._prompt_done(seq)
        self._emit_token(seq, pc.logits(blocks))
        return False

    def _prompt_done(self, seq: Sequence):
        """Usage of the prompt phase: admission to the first token's logits, tokens computed per second."""
        P = seq.prompt_ids
        seq.usage.prompt_n = len(P)
        seq.usage.prompt_ms = (time.monotonic() - seq.t_prefill_start) * 1e3
        computed = len(P) - seq.usage.cached_tokens
        seq.usage.prompt_per_second = computed / (seq.usage.prompt_ms / 1e3) if seq.usage.prompt_ms > 0 else 0.0

    def _make_prefix_cache(self) -> PrefixCache | None:
        from betelgeuse.store.plan import prefix_cache_bytes
        r, c = self.runner, self.runner.mcfg
        elt = torch.empty((), dtype=r.dtype).element_size()
        nbytes = prefix_cache_bytes(self.cfg, c, elt)
        if nbytes == 0:
            return None
        if r.chunk is None or self.cfg.schedule != "layer_major":
            log.info("prefix cache off: %s", "the standard schedule prefills in micro-batches"
                     if r.chunk is not None else f"{c.arch} state is not cut into position-aligned blocks")
            return None
        pc = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, r.chunk, nbytes, r.device, r.dtype, c.n_vocab)
        if not pc.enabled:
            log.warning("prefix cache off: %d bytes hold no block of %d tokens (%d bytes)", nbytes, r.chunk,
                        pc.block_bytes)
            return None
        event(log, "prefix_cache", logging.INFO, blocks=pc.n_blocks, block_tokens=pc.block,
              bytes=pc.capacity_bytes, device=str(r.device))
        if self.metrics:
            self.metrics.prefix_cache_capacity.set(pc.capacity_bytes)
        return pc

    def _prefix_metrics(self):
        """The prefix cache's own counters (PrefixStats) into the metrics: what grew since the last export."""
        m, pc = self.metrics, self.prefix_cache
        if not m or pc is None:
            return
        st, old = pc.stats, self._exported
        m.prefix_cache_queries.inc(st.queries - old.queries)
        m.prefix_cache_hits.inc(st.hits - old.hits)
        m.prefix_cache_tokens.inc(st.tokens_reused - old.tokens_reused)
        m.prefix_cache_evictions.inc(st.evictions - old.evictions)
        m.prefix_cache_bytes.set(pc.bytes_used)
        m.prefix_cache_usage.set(pc.bytes_used / pc.capacity_bytes if pc.capacity_bytes else 0.0)
        self._exported = dataclasses.replace(st)

    def _decode(self, seq: Sequence):
        """One decode token of a lone sequence through forward()'s one-row decode (not the static form)."""
        def run(stop):
            lg, st = self.runner.forward([seq.out_ids[-1]], seq.kv, consolidate=False, should_stop=stop)
            return [lg[-1]], st
        out = self._pass([seq], run, "a decode pass")
        if out is not None:
            self._emit_token(seq, out[0][0])

    def _decode_batch(self, seqs: list[Sequence]):
        """One decode token for each sequence in one pass (runner.decode_batch: each expert loaded once per layer
        for all of them; a sequence's logits do not depend on its batch)."""
        out = self._pass(seqs, lambda stop: self.runner.decode_batch([s.out_ids[-1] for s in seqs],
                                                                     [s.kv for s in seqs]),
                         f"a batched decode pass of {len(seqs)} requests")
        if out is not None:
            for seq, logits in zip(seqs, out[0]):
                self._emit_token(seq, logits)

    def _emit_token(self, seq: Sequence, logits: torch.Tensor):
        """Sample and emit one token; a failure here is this sequence's alone (invariant 7)."""
        try:
            self._sample_emit(seq, logits)
        except BetelgeuseError as e:
            log.warning("request %s failed: %s", seq.request.request_id or seq.seq_id, e)
            self._drop(seq, e)
        except Exception:                            # noqa: BLE001
            log.exception("sampling for request %s failed", seq.request.request_id or seq.seq_id)
            self._drop(seq, InternalError("internal error sampling this request; see the worker log"))

    def _sample_emit(self, seq: Sequence, logits: torch.Tensor):
        sp = seq.request.sampling
        x = apply_penalties(logits, sp, seq.prompt_ids, seq.out_ids)
        if seq.constraint is not None:
            x = apply_allowed(x, seq.constraint.allowed())
        tok = sample(x, sp, seq.generator)
        now = time.monotonic()
        if tok in seq.stop_ids:
            kind = "stop_token" if tok in seq.request.stop_token_ids else "eos"
            self._finish(seq, "stop", kind, tok)
            return
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
            self._finish(seq, "stop", "stop_string")
        elif grammar_done:
            self._finish(seq, "stop", "grammar")
        elif len(seq.out_ids) >= seq.max_tokens:
            self._finish(seq, "length")

    def _account(self, seq: Sequence, st: PassStats, count_metrics: bool = True):
        u = seq.usage
        u.expert_reads_vram += st.reads["vram"]
        u.expert_reads_host += st.reads["host"]
        u.expert_reads_disk += st.reads["disk"]
        u.disk_bytes += st.disk_bytes
        u.disk_wait_ms += st.disk_wait_s * 1e3
        u.h2d_bytes += st.h2d_bytes
        phase = "prefill" if st.kind == "prefill" else "decode"
        m = self.metrics if count_metrics else None
        if m:
            (m.prompt_tokens if phase == "prefill" else m.generation_tokens).inc(st.n_tokens)
            m.busy_seconds.labels(phase=phase).inc(st.seconds)
            for tier, n in st.reads.items():
                m.expert_reads.labels(tier=tier, phase=phase).inc(n)
            m.disk_wait_seconds.labels(phase=phase).inc(st.disk_wait_s)
            m.h2d_bytes.inc(st.h2d_bytes)
            m.h2d_seconds.inc(sum(l.copy_ms for l in st.layers) / 1e3)

    def _free(self, seq: Sequence):
        """The sequence leaves the running set: its KV cache goes, its prefix blocks become evictable."""
        if seq in self.running:
            self.running.remove(seq)
        kv, blocks = seq.kv, seq.blocks
        seq.kv, seq.blocks = None, []
        try:                        # a failure here must not keep the request from its final event
            if kv is not None:
                self.runner.release(kv)          # its captured decode graphs
            if blocks and self.prefix_cache is not None:
                self.prefix_cache.release(blocks)
        except Exception:                        # noqa: BLE001
            log.exception("releasing the resources of request %s failed", seq.request.request_id or seq.seq_id)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str = "", stop_token_id: int | None = None):
        self._free(seq)
        u = seq.usage
        u.predicted_n = len(seq.out_ids)
        # decode passes produce tokens 2..n; the first comes from the prefill pass
        if u.predicted_n > 1:
            u.predicted_ms = (seq.t_last - seq.t_first) * 1e3     # first to last token, as the client saw them
            u.predicted_per_second = (u.predicted_n - 1) / (u.predicted_ms / 1e3) if u.predicted_ms > 0 else 0.0
        seq.finish(reason, stop_reason, stop_token_id)
        self._log_request(seq, "deadline_exceeded" if reason == "cancelled" and seq.expired and not seq.cancelled
                          else reason)
        if self.metrics:
            m = self.metrics
            m.requests_finished.labels(finish_reason=reason).inc()
            m.request_duration.observe(time.monotonic() - seq.arrival)
            m.request_prompt_tokens.observe(len(seq.prompt_ids))
            m.request_generation_tokens.observe(len(seq.out_ids))
        # the finished request's working set moves into the resident tiers; while others still run, their batch's
        # periodic decode consolidation (decode_consolidate_every) counts its usage instead: one consolidation per
        # request end stalled the batch's next pass on its disk reads, over and over as requests came and went
        if reason != "cancelled" and self.store_ok and len(seq.out_ids) > 1 and not self.running:
            try:
                self.runner.consolidate()
            except StoreUnavailableError as e:
                self._store_down(e)

    def _drop(self, seq: Sequence, err: BetelgeuseError):
        self._free(seq)
        seq.fail(err)
        self._log_request(seq, "error", error=" ".join(str(err).split()), error_type=type(err).__name__)

    @staticmethod
    def _log_request(seq: Sequence, status: str, **extra):
        """The one line per request (docs/architecture.md, "Logs"): what an operator greps for."""
        u = seq.usage
        event(log, "request", logging.WARNING if status == "error" else logging.INFO,
              id=seq.request.request_id or str(seq.seq_id), status=status, prompt_tokens=len(seq.prompt_ids),
              cached_tokens=getattr(u, "cached_tokens", 0), completion_tokens=len(seq.out_ids),
              ttft_ms=u.ttft_ms if seq.out_ids else None, pp_tok_s=u.prompt_per_second,
              tg_tok_s=u.predicted_per_second, reads_vram=u.expert_reads_vram, reads_host=u.expert_reads_host,
              reads_disk=u.expert_reads_disk, disk_bytes=u.disk_bytes, disk_wait_ms=u.disk_wait_ms,
              duration_ms=(time.monotonic() - seq.arrival) * 1e3, **extra)

    # ---- the store going away and coming back ------------------------------------------------------
    def _store_down(self, err: StoreUnavailableError):
        log.warning("store unavailable: %s", err)
        self.store_why = str(err)
        self.store_ok = False
        if self.on_state:
            self.on_state(False)
        for seq in list(self.running):
            self._drop(seq, err)
        with self.cv:
            for seq in list(self.waiting):
                seq.fail(err)
            self.waiting.clear()
        threading.Thread(target=self._reattach, name="reattach", daemon=True).start()

    def report_store_down(self, err: StoreUnavailableError):
        """From another thread (the worker's health probe): the store stopped answering. The caller also aborts
        the client's calls in flight, so a pass blocked in one fails now instead of at its deadline."""
        self._store_lost = err
        if self.on_state:
            self.on_state(False)
        self._wake()

    def _reattach(self):
        while not self._stop and not self.store_ok:
            try:
                self.runner.attach()
                self.store_ok = True
                log.info("re-attached to the expert store")
                if self.on_state:
                    self.on_state(True)
            except BetelgeuseError as e:             # gone, or (briefly) still holding our old lease
                log.debug("re-attach failed: %s", e)
                self.store_why = str(e)
                time.sleep(0.5)

    # ---- info ---------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        self.check_text_bytes(len(text.encode("utf-8", "surrogatepass")), "the text")
        check_text(text, "the text")
        with self._tokenize_slots:
            return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        n = self.runner.mcfg.n_vocab
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of range [0, {n})")
        return self.tokenizer.decode(ids)

    def is_ready(self) -> bool:
        return self.store_ok and self._thread.is_alive() and not self.draining and self._store_lost is None

    def stalled(self, seconds: float) -> bool:
        """The engine thread is dead, or has not turned its loop for `seconds` (stuck in a call)."""
        return not self._thread.is_alive() or time.monotonic() - self.last_tick > seconds

    # ---- drain (SIGTERM) --------------------------------------------------------------------------------
    def drain(self, grace: float) -> int:
        """Refuse new work, let running and waiting requests finish for up to `grace` seconds, then end the
        rest with a final event (finish_reason "cancelled"). Returns how many were cancelled."""
        self.draining = True
        t_end = time.monotonic() + grace
        while (self.running or self.waiting) and time.monotonic() < t_end and self._thread.is_alive():
            time.sleep(0.05)
        left = list(self.running) + list(self.waiting)
        for seq in left:
            seq.cancelled = True                       # step() 1. finishes them with a final "cancelled" event
        self._wake()
        t_end = time.monotonic() + 5.0
        while (self.running or self.waiting) and time.monotonic() < t_end and self._thread.is_alive():
            time.sleep(0.02)
        return len(left)

    def model_info(self) -> ModelInfo:
        c, f, p = self.runner.mcfg, self.runner.file, self.runner.plan
        qt = f.expert_parts(0, 0)[0].qtype
        return ModelInfo(name=c.name, arch=c.arch, path=f.path, n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head,
                         n_head_kv=c.n_head_kv, head_dim=c.head_dim, n_expert=c.n_expert, n_expert_used=c.n_expert_used,
                         n_ff_exp=c.n_ff_exp, n_vocab=c.n_vocab, context_length=c.context_length,
                         quant=qtype_name(qt), expert_bytes=f.expert_nbytes(0),
                         vram_slots_per_layer=p.n_vram, host_slots_per_layer=p.n_host,
                         schedule=self.cfg.schedule, sub_batch=self.cfg.sub_batch, routing=self.cfg.routing,
                         vram_backing=p.vram_backing)

    def server_info(self) -> ServerInfo:
        cache = self.runner.cache
        slots = {"vram": int((cache.vram_owner[:, :, 0] >= 0).sum()) if self.runner.plan.n_vram else 0}
        try:
            st = self.runner.store.status() if self.store_ok else None
        except StoreUnavailableError:
            st = None
        if st:
            slots["host"] = st["slots"]["host"] + st["slots"]["vram"]
            slots["staging"] = st["slots"]["staging"]
        mem = {"arena": cache.arena.nbytes}
        if cache.is_cuda:
            mem["vram_in_use"] = torch.cuda.memory_reserved(self.runner.device)
        from betelgeuse.store.cgroup import CgroupMemory
        cg = CgroupMemory.of_process()
        if cg:
            mem["cgroup_current"] = cg.current()
            mem["cgroup_max"] = cg.limit() or 0
        return ServerInfo(version=__version__, device=str(self.runner.device), queue_depth=len(self.waiting),
                          active_requests=len(self.running), store_attached=self.store_ok, slots_used=slots,
                          memory=mem, uptime_s=time.monotonic() - self.started)

    def _gauges(self):
        m = self.metrics
        if m:
            m.requests_running.set(len(self.running))
            m.requests_waiting.set(len(self.waiting))
            kvs = [s.kv for s in self.running if s.kv is not None]
            used, reserved = sum(kv.length for kv in kvs), sum(kv.max_len for kv in kvs)
            cap = self.cfg.max_running * min(self.cfg.max_context,
                                             self.runner.mcfg.context_length or self.cfg.max_context)
            m.kv_cache_tokens.labels(state="used").set(used)
            m.kv_cache_tokens.labels(state="reserved").set(reserved)
            m.kv_cache_capacity.set(cap)
            m.kv_cache_usage.set(min(1.0, reserved / cap) if cap else 0.0)

    def close(self):
        self._stop = True
        self._wake()
        self._thread.join(timeout=5)
        self.runner.close()
