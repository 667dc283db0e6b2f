"""llama.cpp's `deepseek41` (DeepSeek-V4.1) file format, "dialect A" (PR #28696; research note §3.2): its
metadata keys, its tensor layout and the release checkpoint's names, in one table shared by the reader (a
missing tensor or a bad shape is named), the writers (synth, convert) and the model.

V4.1 keeps every `deepseek4.*` key of V4 under the `deepseek41.` prefix (llama.cpp's V4.1 converter subclasses
V4's) and adds the Engram keys. Its CSA2 layer roles are not keys: llama.cpp reads them from which optional
tensors a layer carries, and so do we:
  KV source    a layer with `attn_compressor_kv`: compresses its own KV stream (ratio 2 pools pairs of tokens
               with a softmax gate, ratio 1 projects each token), shared by the layers after it
  key owner    a layer with `indexer.attn_k` (+ `indexer.k_norm`): derives the indexer's keys from that latent
  index source a layer with `indexer.attn_q_b` (+ `indexer.proj`): scores the shared keys, picks its top-k
  reuse        any other compressed layer: attends to the top-k its last index source picked
The two-level candidate filter (NeMo `candidate_source_layer_id`, not in llama.cpp's keys) is read from
`deepseek41.attention.indexer.candidate_{layer,block_count,block_size}`; a file without them gets the
released model's values (layer 20 when it is a KV source, 2048 blocks of 8).

Engram (`deepseek41.engram.*`): layer_ids I32[], head_count, key_length, max_ngram_size, pad_id (already
mapped through token_map, as the converter writes it) U32, multipliers U64[layers x max_ngram],
primes/offsets U64[layers x (max_ngram-1) x heads], token_map I32[>= vocab]; tensors `engram_embd`
{key_length, rows} (read row by row from disk, never loaded), `engram_wkv`, `engram_q`, `engram_k`. The other
V4.1 dialect (ds4 / halo-box: `engram.encoding`, raw FP8 rows, `engram_kv`/`engram_q_norm`) is refused with a
message that says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf import ds4layout
from betelgeuse.gguf.modelconfig import _get, deepseek4_config

ARCH = "deepseek41"
RATIOS = (0, 1, 2)          # per-layer compress ratio: 0 sliding window only, 1 one entry per token, 2 per pair
TOKEN_EMBD, OUTPUT, OUTPUT_NORM = "token_embd.weight", "output.weight", "output_norm.weight"
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ENGRAM_TABLE = "engram_embd"
# the released model's candidate filter (NeMo DeepseekV41TextConfig defaults), for files without the keys
RELEASE_CANDIDATE = (20, 2048, 8)
INT64_MAX = (1 << 63) - 1
# tokens per Engram sub-batch: the unit of rows the store stages (a bank holds ENGRAM_TOKENS x n_cols rows) and of
# the wkv projection (the same split in the reference and the engine: a row's bits never depend on the fetching)
ENGRAM_TOKENS = 16
ENGRAM_BANKS = 4        # sub-batches of rows in flight per worker (store/engram.py; the plan's activation bytes)

# the release checkpoint's storage class of each GGUF tensor kind (what synth and convert key their types on):
# FP8 E4M3 with ue8m0 32x32 block scales; BF16; FP32 (norms, mHC, sinks, router bias, the compressor)
FP8 = ("attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b", "ffn_gate_shexp", "ffn_up_shexp",
       "ffn_down_shexp", "indexer.attn_q_b", "engram_wkv")
BF16 = ("token_embd", "output", "indexer.proj", "indexer.attn_k", "ffn_gate_inp", "engram_q", "engram_k")
F32_2D = ("hc_attn_fn", "hc_ffn_fn", "attn_compressor_kv", "attn_compressor_gate")
# the kinds the model loads in float32 whatever the compute dtype (NeMo's _keep_in_fp32_modules_strict, plus the
# norms): model.deepseek41 load_dense, and the slot plan's dense bytes (dense_elem_bytes)
FP32_KINDS = ("attn_norm", "ffn_norm", "output_norm", "attn_sinks", "attn_q_a_norm", "attn_kv_a_norm",
              "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
              "attn_compressor_kv", "attn_compressor_gate", "attn_compressor_norm", "indexer.k_norm", "exp_probs_b",
              "engram_q", "engram_k")


@dataclass(slots=True, frozen=True)
class EngramParams:
    """The hashed n-gram memory (research note §4.3); arrays as tuples of Python ints (64-bit exact)."""
    layer_ids: tuple[int, ...]          # decoder layers with an Engram (before their attention)
    n_heads: int                        # hash heads per n-gram order
    key_length: int                     # values per table row
    max_ngram: int                      # n-grams of 2..max_ngram tokens
    pad_id: int                         # compressed id standing for "before the sequence start"
    multipliers: tuple[tuple[int, ...], ...]   # [engram layer][lookback 0..max_ngram-1], odd, < 2^63 / max id
    primes: tuple[tuple[int, ...], ...]        # [engram layer][column (n-2)*heads + h]
    offsets: tuple[tuple[int, ...], ...]       # [engram layer][column]: first row of the column's bucket
    token_map: tuple[int, ...]                 # token id -> compressed id
    rows: tuple[int, ...]                      # table rows per engram layer (from the tensor shapes)

    @property
    def n_cols(self) -> int:
        """Rows read per token per Engram layer ((max_ngram - 1) x heads; 24 in V4.1-Flash)."""
        return (self.max_ngram - 1) * self.n_heads

    def index(self, layer: int) -> int:
        """Position of decoder `layer` in layer_ids (-1: no Engram there)."""
        return self.layer_ids.index(layer) if layer in self.layer_ids else -1


@dataclass(slots=True, frozen=True)
class Deepseek41Params:
    """V4.1's CSA2 roles per layer (-1 = none) and its Engram; the V4 keys are in ModelConfig.ds4."""
    kv_source: tuple[int, ...]          # the KV source a compressed layer reads (itself for a source)
    key_source: tuple[int, ...]         # the layer owning the indexer keys it scores (index sources)
    topk_source: tuple[int, ...]        # the index source whose top-k it attends to
    kv_sources: frozenset[int]
    key_owners: frozenset[int]
    index_sources: frozenset[int]
    candidate_layer: int                # -1: no candidate filter
    candidate_blocks: int
    candidate_block_size: int
    engram: EngramParams | None = None


def kind(name: str) -> str:
    """'blk.3.attn_q_a.weight' -> 'attn_q_a'; 'blk.3.exp_probs_b.bias' -> 'exp_probs_b'."""
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    return ".".join(parts[:-1])


# ---- metadata -> config ----------------------------------------------------------------------------

def _roles(n_layer: int, ratios: tuple[int, ...], has, where: str):
    kv = frozenset(i for i in range(n_layer) if has(i, "attn_compressor_kv"))
    owners = frozenset(i for i in range(n_layer) if has(i, "indexer.attn_k"))
    index = frozenset(i for i in range(n_layer) if has(i, "indexer.attn_q_b"))
    src, key, top = [-1] * n_layer, [-1] * n_layer, [-1] * n_layer
    last = [-1, -1, -1]
    for i in range(n_layer):
        for j, s in enumerate((kv, owners, index)):
            if i in s:
                last[j] = i
        if (i in kv or i in owners or i in index) and ratios[i] == 0:
            raise ModelFormatError(f"{where}: layer {i} is sliding-window only (compress ratio 0) but carries "
                                   "compressor or indexer tensors")
        if ratios[i] == 0:
            continue
        if min(last) < 0:
            raise ModelFormatError(f"{where}: layer {i} reads a compressed stream (ratio {ratios[i]}) before any "
                                   "layer publishes one (no earlier attn_compressor_kv, indexer.attn_k and "
                                   "indexer.attn_q_b)")
        if ratios[i] != ratios[last[0]]:
            raise ModelFormatError(f"{where}: layer {i} compresses at ratio {ratios[i]} but reads layer {last[0]}, "
                                   f"compressed at ratio {ratios[last[0]]}")
        src[i], key[i], top[i] = last
        if i in kv and ratios[i] > 1 and not has(i, "attn_compressor_gate"):
            raise ModelFormatError(f"{where}: layer {i} compresses {ratios[i]} tokens per entry but has no "
                                   f"blk.{i}.attn_compressor_gate.weight")
    return kv, owners, index, tuple(src), tuple(key), tuple(top)


def _engram(meta: dict, a: str, n_layer: int, n_vocab: int, shapes: dict, where: str) -> EngramParams | None:
    enc = meta.get(f"{a}.engram.encoding")
    if enc is not None:
        raise UnsupportedError(f"{where}: unknown {a}.engram.encoding {enc!r}: this file is in the ds4 dialect "
                               "(raw FP8 Engram rows, engram_kv/engram_q_norm tensors), which is not supported; "
                               "convert the checkpoint with `betelgeuse convert` (llama.cpp's layout)")
    if any(n.endswith(("engram_kv.weight", "engram_q_norm.weight")) for n in shapes):
        raise UnsupportedError(f"{where}: engram_kv / engram_q_norm tensors are the ds4 dialect's names, which is "
                               "not supported; convert the checkpoint with `betelgeuse convert`")
    ids = meta.get(f"{a}.engram.layer_ids")
    if ids is None:
        if any(kind(n) == ENGRAM_TABLE for n in shapes):
            raise ModelFormatError(f"{where}: the file has Engram tables but no metadata key '{a}.engram.layer_ids'")
        return None
    if not isinstance(ids, list) or not ids:
        raise ModelFormatError(f"{where}: metadata '{a}.engram.layer_ids' should be a non-empty array, got {ids!r}")
    ids_t = tuple(int(x) for x in ids)
    if list(ids_t) != sorted(set(ids_t)) or not all(0 <= i < n_layer for i in ids_t):
        raise ModelFormatError(f"{where}: metadata '{a}.engram.layer_ids' {list(ids_t)} must be distinct increasing "
                               f"layers in 0..{n_layer - 1}")
    heads = _get(meta, f"{a}.engram.head_count", int, where)
    klen = _get(meta, f"{a}.engram.key_length", int, where)
    ngram = _get(meta, f"{a}.engram.max_ngram_size", int, where)
    pad = _get(meta, f"{a}.engram.pad_id", int, where)
    if heads <= 0 or klen <= 0 or ngram < 2:
        raise ModelFormatError(f"{where}: Engram needs head_count > 0, key_length > 0 and max_ngram_size >= 2 "
                               f"(got {heads}, {klen}, {ngram})")
    n_eng, n_cols = len(ids_t), (ngram - 1) * heads

    def arr(key: str, n: int) -> np.ndarray:
        v = meta.get(f"{a}.engram.{key}")
        if v is None:
            raise ModelFormatError(f"{where}: missing metadata key '{a}.engram.{key}'")
        if not isinstance(v, list) or len(v) != n:
            raise ModelFormatError(f"{where}: metadata '{a}.engram.{key}' should hold {n} integers, got "
                                   f"{len(v) if isinstance(v, list) else type(v).__name__}")
        x = [int(e) for e in v]
        if min(x) < 0:
            raise ModelFormatError(f"{where}: metadata '{a}.engram.{key}' holds a negative value {min(x)}")
        return np.array(x, dtype=object).reshape(n_eng, -1)

    mult, primes, offs = arr("multipliers", n_eng * ngram), arr("primes", n_eng * n_cols), arr("offsets", n_eng * n_cols)
    tmap = meta.get(f"{a}.engram.token_map")
    if tmap is None:
        raise ModelFormatError(f"{where}: missing metadata key '{a}.engram.token_map'")
    if not isinstance(tmap, list) or len(tmap) < n_vocab:
        raise ModelFormatError(f"{where}: metadata '{a}.engram.token_map' has "
                               f"{len(tmap) if isinstance(tmap, list) else 0} entries, fewer than the {n_vocab} tokens")
    tmap_t = tuple(int(x) for x in tmap[:n_vocab])
    if min(tmap_t) < 0:
        raise ModelFormatError(f"{where}: metadata '{a}.engram.token_map' holds a negative id {min(tmap_t)}")
    if min(int(p) for p in primes.ravel()) <= 0:
        raise ModelFormatError(f"{where}: metadata '{a}.engram.primes' holds a zero (the hash divides by it)")
    # the hash multiplies compressed ids by the multipliers in 64 bits: no product may overflow
    top_id = max(max(tmap_t), pad)
    if top_id * max(int(m) for m in mult.ravel()) > INT64_MAX:
        raise ModelFormatError(f"{where}: Engram multipliers up to {max(int(m) for m in mult.ravel())} times "
                               f"compressed ids up to {top_id} overflow 64 bits")
    rows = []
    for e, layer in enumerate(ids_t):
        name = f"blk.{layer}.{ENGRAM_TABLE}.weight"
        if name not in shapes:
            raise ModelFormatError(f"{where}: required tensor {name!r} is missing")
        shp = tuple(shapes[name])
        if len(shp) != 2 or shp[1] != klen:
            raise ModelFormatError(f"{where}: tensor {name!r} has shape {list(shp)}, expected [rows, {klen}] "
                                   "(torch order)")
        need = max(int(o) + int(p) for o, p in zip(offs[e], primes[e]))
        if need > shp[0]:
            raise ModelFormatError(f"{where}: tensor {name!r} has {shp[0]} rows, too few for the Engram buckets "
                                   f"({need})")
        rows.append(shp[0])
    return EngramParams(layer_ids=ids_t, n_heads=heads, key_length=klen, max_ngram=ngram, pad_id=pad,
                        multipliers=tuple(tuple(int(x) for x in r) for r in mult),
                        primes=tuple(tuple(int(x) for x in r) for r in primes),
                        offsets=tuple(tuple(int(x) for x in r) for r in offs), token_map=tmap_t, rows=tuple(rows))


def deepseek41_config(meta: dict, *, where: str, stem: str, n_vocab: int, n_expert: int, n_ff_exp: int | None,
                      shapes: dict):
    """ModelConfig for a `deepseek41` file (gguf/layouts.py Layout.config): V4's keys (prefix deepseek41.), the
    CSA2 roles from the tensors `shapes` has, the candidate filter, the Engram."""
    a = ARCH
    cfg = deepseek4_config(meta, where=where, stem=stem, n_vocab=n_vocab, n_expert=n_expert, n_ff_exp=n_ff_exp,
                            arch=a, ratios_known=RATIOS, hash_default=0)
    if cfg.ds4.n_hash_layers:
        raise UnsupportedError(f"{where}: {a}.hash_layer_count is {cfg.ds4.n_hash_layers}; DeepSeek-V4.1 has no "
                               "hash-routed layers")
    L, ratios = cfg.n_layer, cfg.ds4.compress_ratios
    kv, owners, index, src, key, top = _roles(L, ratios, lambda i, t: f"blk.{i}.{t}.weight" in shapes, where)
    default = RELEASE_CANDIDATE[0] if RELEASE_CANDIDATE[0] in kv else -1
    cand = _get(meta, f"{a}.attention.indexer.candidate_layer", int, where, default)
    blocks = _get(meta, f"{a}.attention.indexer.candidate_block_count", int, where, RELEASE_CANDIDATE[1])
    bsize = _get(meta, f"{a}.attention.indexer.candidate_block_size", int, where, RELEASE_CANDIDATE[2])
    if cand >= 0 and (cand not in kv or cand not in index):
        raise ModelFormatError(f"{where}: metadata '{a}.attention.indexer.candidate_layer' = {cand} must be a layer "
                               "that compresses KV and indexes it (attn_compressor_kv and indexer.attn_q_b)")
    if cand >= 0 and (blocks <= 0 or bsize <= 0):
        raise ModelFormatError(f"{where}: candidate_block_count and candidate_block_size must be positive "
                               f"(got {blocks}, {bsize})")
    p = Deepseek41Params(kv_source=src, key_source=key, topk_source=top, kv_sources=kv, key_owners=owners,
                         index_sources=index, candidate_layer=cand, candidate_blocks=blocks,
                         candidate_block_size=bsize,
                         engram=_engram(meta, a, L, n_vocab, shapes, where))
    return replace(cfg, ds41=p)


# ---- tensor layout -----------------------------------------------------------------------------------

def layer_tensors(cfg, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, torch shape) of layer i's tensors: V4's attention and experts, V4.1's optional CSA2 and Engram ones."""
    p4, p, D, hd = cfg.ds4, cfg.ds41, cfg.n_embd, cfg.head_dim
    ihd, nh = p4.index_head_dim, p4.index_n_heads
    b = f"blk.{i}."
    yield from ds4layout.attention_tensors(cfg, i)
    if i in p.kv_sources:
        yield b + "attn_compressor_kv.weight", (hd, D)
        if p4.compress_ratios[i] > 1:
            yield b + "attn_compressor_gate.weight", (hd, D)
        yield b + "attn_compressor_norm.weight", (hd,)
    if i in p.index_sources:
        yield b + "indexer.attn_q_b.weight", (nh * ihd, p4.q_lora_rank)
        yield b + "indexer.proj.weight", (nh, D)
    if i in p.key_owners:
        yield b + "indexer.attn_k.weight", (ihd, hd)
        yield b + "indexer.k_norm.weight", (ihd,)
    yield b + "ffn_gate_inp.weight", (cfg.n_expert, D)
    yield b + "exp_probs_b.bias", (cfg.n_expert,)
    yield from ds4layout.expert_tensors(cfg, i)
    g = p.engram
    if g is not None and i in g.layer_ids:
        e = g.index(i)
        yield b + "engram_embd.weight", (g.rows[e], g.key_length)
        yield b + "engram_wkv.weight", (D * (p4.hc_mult + 1), g.n_cols * g.key_length)
        yield b + "engram_q.weight", (p4.hc_mult, D)
        yield b + "engram_k.weight", (p4.hc_mult, D)


def tensors(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a `deepseek41` file for `cfg` (a ModelConfig with .ds4 and .ds41). No output_hc_*: the last
    FFN sublayer's mix collapses the streams."""
    D, V = cfg.n_embd, cfg.n_vocab
    out = [(TOKEN_EMBD, (V, D)), (OUTPUT_NORM, (D,)), (OUTPUT, (V, D))]
    for i in range(cfg.n_layer):
        out += list(layer_tensors(cfg, i))
    return out


# ---- the release checkpoint (safetensors) <-> GGUF names ---------------------------------------------

_GLOBAL = {"embed.weight": TOKEN_EMBD, "head.weight": OUTPUT, "norm.weight": OUTPUT_NORM}
_LAYER = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight", "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.wk.weight": "indexer.attn_k.weight", "attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.bias_vl": "exp_probs_b_vl.bias",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight", "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "engram.embed.weight": "engram_embd.weight", "engram.wkv.weight": "engram_wkv.weight",
    "engram.q_weight": "engram_q.weight", "engram.k_weight": "engram_k.weight",
}
EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
SKIPPED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")     # DSpark draft, vision tower: not text inference


def released_to_gguf(name: str) -> tuple[str, int | None] | None:
    """A release-checkpoint tensor name -> (GGUF name, expert index or None); None for tensors the text model does
    not use (DSpark draft, vision). KeyError for a name this layout does not know."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name in _GLOBAL:
        return _GLOBAL[name], None
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 3:
        raise KeyError(name)
    i, rest = int(parts[1]), ".".join(parts[2:])
    if rest in _LAYER:
        return f"blk.{i}.{_LAYER[rest]}", None
    if len(parts) == 7 and parts[2:4] == ["ffn", "experts"] and parts[5] in EXPERT_PARTS and parts[6] == "weight":
        return f"blk.{i}.{EXPERT_PARTS[parts[5]]}.weight", int(parts[4])
    raise KeyError(name)


# ---- Engram constants (writers: synth and convert; the engine reads them from the file) --------------------

def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def engram_constants(layer_ids, max_ngram: int, n_heads: int, vocab_size: int, compressed_vocab: int):
    """(multipliers [layers][max_ngram], primes [layers][(max_ngram-1)*heads], offsets) as the released
    `inference/engram.py` derives them (vLLM `EngramLayout`, NeMo `DeepseekV41NgramHash`): per layer and n-gram
    order, `heads` primes above vocab_size-1, never one twice across the model; offsets the exclusive cumsum;
    multipliers = 2 * numpy default_rng(10007 * layer).integers(0, bound) + 1, bound = (2^63-1) // compressed // 2."""
    seen: set[int] = set()
    primes, offsets, mults = [], [], []
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    for layer in layer_ids:
        ps = []
        for _ in range(max_ngram - 1):
            cur = vocab_size - 1
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                ps.append(cur)
        primes.append(ps)
        offsets.append([int(x) for x in np.cumsum([0] + ps[:-1])])
        rng = np.random.default_rng(10007 * int(layer))
        mults.append([int(x) * 2 + 1 for x in rng.integers(0, bound, size=(max_ngram,), dtype=np.int64)])
    return mults, primes, offsets


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """A `tokenizers.Tokenizer` -> (token id -> compressed id, compressed vocabulary size): each token's decoded
    text through NFKC, NFD, strip accents, lowercase and whitespace collapsing (a lone space survives); tokens that
    decode to U+FFFD keep their raw token string (the released `inference/engram.py`)."""
    from tokenizers import Regex, normalizers
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    key_to_id: dict[str, int] = {}
    out = []
    for tid in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out.append(key_to_id.setdefault(key, len(key_to_id)))
    return out, len(key_to_id)


def describe(f) -> list[str]:
    """`betelgeuse inspect`'s lines for a deepseek41 file: the CSA2 roles and the Engram tables."""
    from betelgeuse.gguf.qtypes import qtype_name
    c, p = f.config, f.config.ds41
    r = c.ds4.compress_ratios
    out = [f"compression:   ratios {list(r)}; KV sources {sorted(p.kv_sources)}, index sources "
           f"{sorted(p.index_sources)}, candidate layer {p.candidate_layer} ({p.candidate_blocks} blocks of "
           f"{p.candidate_block_size})"]
    g = p.engram
    if g is None:
        return out + ["engram:        none"]
    out.append(f"engram:        layers {list(g.layer_ids)}, n-grams 2..{g.max_ngram} x {g.n_heads} heads = {g.n_cols} "
               f"rows of {g.key_length} per token and layer (read from disk by the store)")
    total = 0
    for l, rows in zip(g.layer_ids, g.rows):
        t = f.tensors[f"blk.{l}.{ENGRAM_TABLE}.weight"]
        total += t.nbytes
        out.append(f"engram {l:3d}:    {rows} rows x {t.nbytes // rows} B ({qtype_name(t.qtype)}), {t.nbytes} B")
    out.append(f"engram bytes:  {total} ({total / 2**30:.3f} GiB)")
    return out


# ---- memory (the store's slot plan) ------------------------------------------------------------------

QUERY_CHUNK = 128        # = model.deepseek41.QUERY_CHUNK (attention queries per block); no torch import here


def state_bytes(cfg, max_len: int, dtype_bytes: int) -> int:
    """One sequence's cache state for `max_len` tokens (model.deepseek41.DS41Cache, fixed shapes allocated whole): per
    layer the window ring [window, hd]; per KV source its open window's rows (float32 kv + gate, `ratio` rows when
    ratio > 1) and its entries [ceil(max_len / ratio) + 1, hd], per key owner its indexer keys at that count; the
    Engram rows of a static decode step [n_eng, 1, n_cols * key_length]."""
    p4, p, hd = cfg.ds4, cfg.ds41, cfg.head_dim
    n = cfg.n_layer * p4.sliding_window * hd * dtype_bytes
    for i in p.kv_sources:
        r = p4.compress_ratios[i]
        rows = -(-max_len // r) + 1
        n += rows * hd * dtype_bytes + (2 * r * hd * 4 if r > 1 else 0)
        if i in p.key_owners:
            n += rows * p4.index_head_dim * dtype_bytes
    g = p.engram
    if g is not None:
        n += len(g.layer_ids) * g.n_cols * g.key_length * dtype_bytes
    return n


def attention_scratch_bytes(cfg, max_len: int) -> int:
    """Peak float32 scratch of one attention block of Q queries: scores, their copy with the sinks and the
    probabilities [H, Q, Q + window - 1 + N], the indexer's [Q, heads, N] scores and the candidate masks."""
    p4 = cfg.ds4
    r = min((x for x in p4.compress_ratios if x), default=0)
    n_comp = -(-max_len // r) if r else 0
    q = min(QUERY_CHUNK, max_len)
    keys = q + p4.sliding_window - 1 + n_comp
    return 4 * (3 * cfg.n_head * q * keys + 3 * q * p4.index_n_heads * n_comp) + 2 * q * n_comp


def dense_elem_bytes(name: str, dtype_bytes: int) -> int:
    """Bytes per element of a non-expert tensor once loaded (model.deepseek41 load_dense): the FP32_KINDS in
    float32, the rest in the compute dtype (the Engram tables are never loaded: the plan skips them)."""
    return 4 if kind(name) in FP32_KINDS else dtype_bytes


def activation_bytes(cfg, n_tokens: int, dtype_bytes: int) -> int:
    """Peak activations of a prefill pass of n_tokens: deepseek4's (gguf/ds4layout.py activation_bytes: the same
    sublayer shapes), plus the carried pre-mix row of the residual ([hc + 1, D] per token instead of [hc, D]) and,
    with Engram, the worker's feed: its VRAM staging buffer (one bank: ENGRAM_TOKENS x n_cols rows, at most a
    float32 row each) and the dequantized rows of the banks in flight (ENGRAM_BANKS) in the compute dtype, and one
    sub-batch's Engram residual (the wkv projection [ENGRAM_TOKENS, (hc + 1) D] in float32)."""
    n = ds4layout.activation_bytes(cfg, n_tokens, dtype_bytes) + n_tokens * cfg.n_embd * dtype_bytes
    g = cfg.ds41.engram
    if g is not None:
        rows = max(ENGRAM_TOKENS * g.n_cols, len(g.layer_ids) * g.n_cols)      # = store/plan.py engram_plan's bank
        n += rows * g.key_length * (4 + ENGRAM_BANKS * dtype_bytes)
        n += ENGRAM_TOKENS * (cfg.ds4.hc_mult + 1) * cfg.n_embd * 4
    return n
