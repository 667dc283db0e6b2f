"""What the architecture oracle tests (deepseek4 vs transformers, deepseek41 vs NeMo) check the same way: logits
within float32 noise of the reference's, the top-k margins of a prefill, and the two other ways to feed a prompt
(token-by-token decode, odd-sized chunks), which must give the whole-prompt logits."""

from __future__ import annotations

import torch


def check_logits(ours: torch.Tensor, ref: torch.Tensor, what: str, tag: str, rel_tol: float) -> float:
    """max |ours - ref| <= rel_tol x max |ref| (printed, with the tag and what was compared)."""
    diff = float((ours - ref).abs().max())
    scale = float(ref.abs().max())
    print(f"\n[{tag}] {what}: max-abs logit difference = {diff:.3e} (max |logit| {scale:.2f})")
    assert scale > 0.5 and float(ref.std()) > 0.1
    assert diff <= rel_tol * scale, (what, diff, scale)
    return diff


def prefill_margins(model, prompt: torch.Tensor) -> tuple[torch.Tensor, list]:
    """A whole-prompt prefill's logits and its selection margins [(layer, kind, min gap between k-th and k+1-th)]."""
    model.margins = []
    try:
        return model.forward(prompt, model.new_cache(len(prompt))), model.margins
    finally:
        model.margins = None


def check_margins(margins: list, kinds: set[str], what: str, tag: str) -> None:
    """Every kind of top-k selection happened, and no choice can flip: the smallest gap is 10x above float32 noise
    (~1e-6 on O(1) scores)."""
    assert {k for _, k, _ in margins} == kinds, margins
    worst = min(m for _, _, m in margins)
    print(f"[{tag}] {what}: smallest top-k selection margin {worst:.2e}")
    assert worst > 1e-5, margins


def decode_logits(model, prompt: torch.Tensor, start: int, max_len: int | None = None) -> torch.Tensor:
    """A prefill of prompt[:start], then one token at a time (a state sized for max_len, default the prompt's):
    every position's logits."""
    cache = model.new_cache(max_len or len(prompt))
    return torch.cat([model.forward(prompt[:start], cache)]
                     + [model.forward(prompt[i:i + 1], cache) for i in range(start, len(prompt))])


def chunked_logits(model, prompt: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The prompt in pieces of `sizes` (which must add up to it): every position's logits."""
    cache, out, i = model.new_cache(len(prompt)), [], 0
    for n in sizes:
        out.append(model.forward(prompt[i:i + n], cache))
        i += n
    assert i == len(prompt), (i, len(prompt))
    return torch.cat(out)


def prefill_and_resume(model, prompt: torch.Tensor, at: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    """One unbroken prefill of `prompt` that keeps its state at `at` (state.mark: the snapshot cache's checkpoint),
    then that state restored into a fresh one and the rest prefilled from it. Returns (the whole pass's logits
    [T, vocab], its selection margins, the resumed pass's logits [T - at, vocab])."""
    with torch.no_grad():
        kv = model.new_cache(len(prompt))
        kv.mark(at)
        model.margins = []
        whole = model.forward(prompt, kv)
        margins, model.margins = model.margins, None
        snap = kv.take_mark()
        assert snap is not None and snap.length == at
        kv2 = model.new_cache(len(prompt))
        model.restore(kv2, snap)
        rest = model.forward(prompt[at:], kv2)
    return whole, margins, rest
