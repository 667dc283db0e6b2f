"""What a GGUF file says about its vocabulary, in llama.cpp's terms: the token types, and the pre-tokenizer
split regexes by `tokenizer.ggml.pre`. Also `train_vocab`, the byte-level BPE trainer of the synthetic model
writer (synth_common.add_tokenizer). The tokenizer (betelgeuse/tokenizer.py) builds on these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

# Token types (llama.cpp's llama_token_type / gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes by `tokenizer.ggml.pre` (llama.cpp's names).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# DeepSeek-V3's three splits, applied in turn (each splits the pieces the one before left), as its tokenizer.json's
# pre_tokenizer Sequence and llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM: digits in groups of up to 3, runs of
# CJK ideographs / kana, then letters, punctuation and spaces. DeepSeek-V4 and V4.1 ship the same tokenizer.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",   # 一-龥 ぀-ゟ ゠-ヿ
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
# `tokenizer.ggml.pre` -> the split regexes, in order
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "qwen2": (QWEN2_SPLIT,), "deepseek-r1-qwen": (QWEN2_SPLIT,), "megrez": (QWEN2_SPLIT,),
    "llama3": (LLAMA3_SPLIT,), "llama-bpe": (LLAMA3_SPLIT,), "smaug-bpe": (LLAMA3_SPLIT,), "dbrx": (LLAMA3_SPLIT,),
    "default": (GPT2_SPLIT,), "gpt-2": (GPT2_SPLIT,), "gpt2": (GPT2_SPLIT,),
    "deepseek-v3": DEEPSEEK_V3_SPLITS,
}


def byte_level_pre_tokenizer(splits: tuple[str, ...]) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def bpe_tokenizer(tokens: list[str], types: list[int], merges: list[str], splits: tuple[str, ...]) -> HFTokenizer:
    """A `tokenizers` byte-level BPE from a GGUF vocabulary: tokens (id order), their types (CONTROL ones become
    special added tokens, USER_DEFINED ones plain added tokens), "a b" merges, the pre-tokenizer's split regexes
    (applied in turn)."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # first id wins on duplicate spellings
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False))
    tok.pre_tokenizer = byte_level_pre_tokenizer(splits)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok


@dataclass(slots=True)
class Vocab:
    tokens: list[str]            # byte-level spelling, id order
    token_types: list[int]
    merges: list[str]            # "a b", rank order
    endoftext_id: int
    im_start_id: int
    im_end_id: int


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_vocab(corpus: list[str], n_vocab: int, max_merges: int = 4000) -> Vocab:
    """Byte-level BPE trained on `corpus` (Qwen2 split) + ChatML specials + `<|extra_N|>` fill.

    Layout, like Qwen's GGUFs: 256 byte tokens and merges, then the specials (CONTROL), then
    unused padding (UNUSED) so that exactly `n_vocab` entries exist.
    """
    assert n_vocab >= 256 + len(SPECIALS), n_vocab
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = byte_level_pre_tokenizer((QWEN2_SPLIT,))
    trainer = trainers.BpeTrainer(vocab_size=min(n_vocab - len(SPECIALS), 256 + max_merges), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    tokens = [t for t, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(tokens)
    types = [NORMAL] * len(tokens)
    base = len(tokens)
    tokens += list(SPECIALS)
    types += [CONTROL] * len(SPECIALS)
    tokens += [f"<|extra_{k}|>" for k in range(n_vocab - len(tokens))]
    types += [UNUSED] * (n_vocab - len(types))
    return Vocab(tokens, types, merges, base, base + 1, base + 2)
