"""Engram's n-gram hash and its per-sequence history (model/engram.py).

The golden values are NeMo AutoModel's fixture "frozen from the downloaded DeepSeek-V4.1-Flash inference/engram.py"
(`tests/.../test_deepseek_v41_engram.py`, test_hash_matches_official_fixture_with_compressed_tokens_and_image_barriers):
a tiny config (Engram layers 1 and 14, n-grams up to 4, 2 heads, bucket primes above 10, a 6-id compressed vocabulary)
and two sequences, one with an image span that the n-grams may not cross. Our hasher takes the constants the writers
derive (ds41layout.engram_constants) and the fixture's token map, and must reproduce every row id exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from betelgeuse.gguf import ds41layout
from betelgeuse.model.engram import NgramHasher

TOKEN_MAP = [0, 1, 1, 1, 2, 2, 3, 4, 5]       # the fixture's tokenizer through the released normalizer
IDS = [[7, 1, 4, 3, 8, 7], [2, 3, 1, 7, 5, 6]]
MASK = [[True, True, False, False, True, True], [True] * 6]
EXPECTED = [
    [[[10, 13, 39, 43, 71, 100], [3, 34, 100, 141, 191, 245]],
     [[9, 11, 32, 43, 72, 88], [11, 65, 95, 111, 164, 244]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[1, 19, 37, 51, 80, 83], [25, 60, 102, 116, 153, 214]],
     [[6, 12, 32, 56, 61, 93], [25, 58, 85, 135, 163, 214]]],
    [[[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[6, 13, 35, 57, 80, 103], [22, 42, 98, 150, 171, 200]],
     [[10, 13, 39, 43, 71, 100], [3, 34, 100, 141, 191, 245]],
     [[3, 22, 34, 48, 78, 97], [28, 64, 84, 121, 184, 200]],
     [[4, 19, 31, 55, 76, 94], [5, 42, 106, 115, 181, 220]]],
]


def _params(token_map=TOKEN_MAP):
    mult, primes, offs = ds41layout.engram_constants((1, 14), 4, 2, 11, 6)
    return ds41layout.EngramParams(layer_ids=(1, 14), n_heads=2, key_length=4, max_ngram=4, pad_id=token_map[2],
                                   multipliers=tuple(map(tuple, mult)), primes=tuple(map(tuple, primes)),
                                   offsets=tuple(map(tuple, offs)), token_map=tuple(token_map), rows=(113, 253))


def test_compressed_token_map_matches_the_fixture():
    """The fixture's tokenizer (WordLevel: cased, accented and spaced variants) through our normalizer chain."""
    from tokenizers import Tokenizer, models
    vocab = {"[UNK]": 0, " The": 1, "the": 2, "THE": 3, "é": 4, "E": 5, " ": 6, "x": 7, "\ufffd": 8}
    tmap, n = ds41layout.compressed_token_map(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))
    assert (tmap, n) == (TOKEN_MAP, 6)


@pytest.mark.parametrize("seq", [0, 1])
def test_hash_reproduces_the_official_fixture(seq):
    h = NgramHasher(_params())
    rows = h.rows(np.zeros(0, np.int64), np.array(IDS[seq]), np.array(MASK[seq]))
    assert rows.tolist() == EXPECTED[seq]


def test_history_crosses_pieces_exactly():
    """A sequence hashed in pieces (prefill chunks, then decode steps) with its carried history gives the rows of one
    pass; without the history the first rows of a piece differ (they would look back into padding)."""
    h = NgramHasher(_params())
    ids = np.random.default_rng(0).integers(0, len(TOKEN_MAP), 40)
    whole = h.rows(np.zeros(0, np.int64), ids)
    hist, parts = np.zeros(0, np.int64), []
    for a, b in ((0, 1), (1, 8), (8, 9), (9, 23), (23, 40)):
        parts.append(h.rows(hist, ids[a:b]))
        hist = np.concatenate([hist, h.compress(ids[a:b])])[-3:]
    assert np.array_equal(np.concatenate(parts), whole)
    assert not np.array_equal(h.rows(np.zeros(0, np.int64), ids[9:23]), whole[9:23])


def test_64_bit_products():
    """Multipliers near 2^46 times compressed ids near 2^17: the products exceed 2^53 (a float would round them)."""
    mult, primes, offs = ds41layout.engram_constants((1, 14), 4, 8, 16_000_000, 99_092)
    tmap = list(range(99_092))
    g = ds41layout.EngramParams(layer_ids=(1, 14), n_heads=8, key_length=256, max_ngram=4, pad_id=2,
                                multipliers=tuple(map(tuple, mult)), primes=tuple(map(tuple, primes)),
                                offsets=tuple(map(tuple, offs)), token_map=tuple(tmap), rows=(384_006_168, 384_016_682))
    ids = np.array([99_091, 98_765, 12_345, 99_000])
    rows = NgramHasher(g).rows(np.zeros(0, np.int64), ids)
    v = [2, 2, 2] + [int(x) for x in ids]                  # padded look-back, then the ids (token_map = identity)
    for t in range(4):
        roll = 0
        for s in range(4):
            roll ^= v[3 + t - s] * mult[0][s]
            if s:
                for hh in range(8):
                    c = (s - 1) * 8 + hh
                    assert rows[t, 0, c] == roll % primes[0][c] + offs[0][c]
    assert max(v) * max(mult[0]) > 2 ** 53
