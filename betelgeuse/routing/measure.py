"""The routing a model file produces, measured through the in-process reference model: a prompt prefilled, then
greedy decode; its trace and statistics (routing_stats.py). Routing of token t depends only on tokens <= t, so a prefill
routes a prompt as decoding it token by token would."""

from __future__ import annotations

import numpy as np
import torch

from betelgeuse.routing_stats import trace_stats
from betelgeuse.routing.trace import Recorder


class ArraySink:
    """A Recorder sink kept in memory: ids [T, L, k] and weights once closed."""

    def __init__(self, n_layer: int):
        self.header = {"n_layer": n_layer, "weights": True}
        self.ids, self.w = [], []

    def append(self, ids, weights=None):
        self.ids.append(ids)
        self.w.append(weights)

    def close(self):
        pass

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.ids), np.concatenate(self.w)


@torch.inference_mode()
def reference_trace(model_path, prompt: list[int], decode: int = 0, device: str = "cpu"):
    """-> (ids [T, L, k], weights [T, L, k], the greedy tokens) for the prompt plus `decode` greedy tokens."""
    from betelgeuse.model import reference_model
    model = reference_model(model_path, device=device)
    sink = ArraySink(model.cfg.n_layer)
    rec = Recorder(sink)
    model.route = rec.wrap(model.route)
    cache = model.new_cache(len(prompt) + decode + 1)
    logits = model.forward(torch.tensor(prompt), cache)
    out = []
    for _ in range(decode):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = model.forward(torch.tensor([tok]), cache)
    rec.close()
    ids, w = sink.arrays()
    model.file.close()
    return ids, w, out


def random_prompt(n_vocab: int, n: int, seed: int = 0) -> list[int]:
    """The bench's prompt: n token ids uniform over the vocabulary."""
    return np.random.default_rng([seed, n]).integers(0, n_vocab, n).tolist()


def measure(model_path, n_prompt: int = 256, decode: int = 0, seed: int = 0, device: str = "cpu") -> dict:
    """Statistics of a random prompt of n_prompt tokens (+ greedy decode) through the reference model."""
    from betelgeuse.gguf.header import read_header
    md = read_header(model_path).metadata
    arch = md["general.architecture"]
    n_vocab, n_expert = len(md["tokenizer.ggml.tokens"]), int(md[f"{arch}.expert_count"])
    ids, w, _ = reference_trace(model_path, random_prompt(n_vocab, n_prompt, seed), decode, device)
    return trace_stats(ids, n_expert, weights=w)
