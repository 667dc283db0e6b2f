"""Seeded random-weight `deepseek41` (DeepSeek-V4.1) GGUF files of any geometry, in llama.cpp's layout (dialect A,
gguf/ds41layout.py), Engram tables included.

The V4 generator (synth_ds4.py) supplies the random tensors and the streaming writer; this adds V4.1's CSA2 roles
(which layers carry a compressor, indexer keys, an indexer), the candidate filter keys and the Engram: its
constants derived as the release does (ds41layout.engram_constants: primes above `engram_vocab`, numpy-seeded
multipliers, the compressed token map of the file's own tokenizer) and random tables in `engram_qtype` (Q8_0 as
llama.cpp's converter writes them, or a K-quant / BF16 / F32). `engram_vocab` sets the table size: each table has
(max_ngram - 1) * heads buckets of a prime just above it, so the release's 16,000,000 gives 384M rows per layer.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter

from betelgeuse.errors import InvalidRequestError
from betelgeuse.gguf import ds41layout
from betelgeuse.gguf.ds41layout import Deepseek41Params, EngramParams
from betelgeuse.gguf.quants_synth import random_blocks
from betelgeuse.gguf.synth_common import add_tokenizer, matrix_chunks, nbytes, tensor_rng, tiled_chunks, write_gguf
from betelgeuse.gguf.synth_ds4 import DS4Spec, _random_chunks, _source_chunks, release_qtype
from betelgeuse.gguf.synth_ds4 import add_metadata as add_ds4_metadata

ARCH = ds41layout.ARCH
ENGRAM_QTYPES = ("Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "BF16", "F32")
_DERIVE = object()             # "derive the Engram constants from the spec" (the default of config / add_metadata)


@dataclass(slots=True, frozen=True)
class DS41Spec(DS4Spec):
    """A DS4Spec (the keys V4.1 shares) plus V4.1's roles and Engram; n_hash_layers is always 0."""
    kv_sources: tuple[int, ...] = ()           # layers with a compressor (and the indexer keys)
    index_sources: tuple[int, ...] = ()        # layers with an indexer (a superset of kv_sources)
    candidate_layer: int = -1                  # the two-level filter's source (-1: none)
    candidate_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layers: tuple[int, ...] = ()
    engram_heads: int = 8
    engram_key_length: int = 256
    engram_max_ngram: int = 4
    engram_vocab: int = 16_000_000             # bucket primes start above it (module doc)
    engram_pad_token: int = 2                  # raw token id whose compressed id pads the n-grams
    engram_qtype: str = "Q8_0"

    def ratios(self) -> tuple[int, ...]:
        return tuple(self.compress_ratios)[:self.n_layer]

    def hash_layers(self) -> int:
        return 0

    def _layers(self, ids) -> tuple[int, ...]:
        return tuple(i for i in ids if i < self.n_layer)

    def token_map(self) -> tuple[list[int], int]:
        """(token id -> compressed id, compressed size) of the tokenizer this spec writes."""
        return _token_map(self.n_vocab)

    def engram_params(self) -> EngramParams | None:
        layers = self._layers(self.engram_layers)
        if not layers:
            return None
        tmap, n_comp = self.token_map()
        mult, primes, offs = ds41layout.engram_constants(layers, self.engram_max_ngram, self.engram_heads,
                                                         self.engram_vocab, n_comp)
        rows = tuple(o[-1] + p[-1] for o, p in zip(offs, primes))
        return EngramParams(layer_ids=layers, n_heads=self.engram_heads, key_length=self.engram_key_length,
                            max_ngram=self.engram_max_ngram, pad_id=tmap[self.engram_pad_token],
                            multipliers=tuple(map(tuple, mult)), primes=tuple(map(tuple, primes)),
                            offsets=tuple(map(tuple, offs)), token_map=tuple(tmap), rows=rows)

    def config(self, engram=_DERIVE):
        """The ModelConfig a reader builds from the file this spec writes (`engram`: other Engram constants)."""
        base = DS4Spec.config(self)
        kv, idx = self._layers(self.kv_sources), self._layers(self.index_sources)
        names = {f"blk.{i}.attn_compressor_kv.weight" for i in kv} | {f"blk.{i}.indexer.attn_k.weight" for i in kv}
        names |= {f"blk.{i}.indexer.attn_q_b.weight" for i in idx}
        names |= {f"blk.{i}.attn_compressor_gate.weight" for i in kv if self.ratios()[i] > 1}
        src = ds41layout._roles(self.n_layer, self.ratios(), lambda i, t: f"blk.{i}.{t}.weight" in names,
                                "synth spec")
        cand = self.candidate_layer if self.candidate_layer < self.n_layer else -1
        p = Deepseek41Params(kv_source=src[3], key_source=src[4], topk_source=src[5], kv_sources=src[0],
                             key_owners=src[1], index_sources=src[2], candidate_layer=cand,
                             candidate_blocks=self.candidate_blocks, candidate_block_size=self.candidate_block_size,
                             engram=self.engram_params() if engram is _DERIVE else engram)
        return replace(base, arch=ARCH, name=f"betelgeuse-synth-ds41-{self.n_layer}L", ds41=p)


@functools.lru_cache(maxsize=4)
def _token_map(n_vocab: int) -> tuple[list[int], int]:
    return ds41layout.compressed_token_map(synth_tokenizer(n_vocab))


def synth_tokenizer(n_vocab: int):
    """The `tokenizers` BPE of the vocabulary synth files carry (synth_common.add_tokenizer)."""
    from betelgeuse.gguf.synth_common import CORPUS
    from betelgeuse.gguf.vocab import QWEN2_SPLIT, bpe_tokenizer, train_vocab
    v = train_vocab(CORPUS, n_vocab)
    return bpe_tokenizer(v.tokens, v.token_types, v.merges, (QWEN2_SPLIT,))


_FLASH = dict(n_embd=5120, n_head=64, head_dim=512, rope_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
              n_expert=384, n_expert_used=6, n_ff_exp=2304, n_vocab=129280, index_n_heads=32, index_head_dim=128,
              index_topk=512, rms_eps=1e-20, routed_scale=1.5, n_hash_layers=0)

DS41_PRESETS: dict[str, DS41Spec] = {
    # ~1 MB: unit tests. Sliding-only layers 0-1; a ratio-2 stream from layer 2 (reused by 3); a ratio-1 stream
    # from layer 4, the candidate layer, re-indexed by 5; Engram before layers 1 and 4; windows a 150-token
    # prompt crosses (sliding 16, 4 candidate blocks of 4 entries)
    "ds41-tiny": DS41Spec(n_layer=6, n_embd=64, n_head=4, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2,
                          o_lora_rank=32, n_expert=8, n_expert_used=2, n_ff_exp=32, n_vocab=512,
                          compress_ratios=(0, 0, 2, 2, 1, 1), n_hash_layers=0, sliding_window=16, index_n_heads=32,
                          index_head_dim=32, index_topk=4, context_length=4096, rope_factor=4.0, rope_orig_ctx=64,
                          rms_eps=1e-20, kv_sources=(2, 4), index_sources=(2, 4, 5), candidate_layer=4,
                          candidate_blocks=4, candidate_block_size=4, engram_layers=(1, 4), engram_heads=2,
                          engram_key_length=32, engram_max_ngram=3, engram_vocab=97),
    # DeepSeek-V4.1-Flash's per-layer shapes (hidden 5120, 64 heads x 512, 384 experts of 18,800,640 B at MXFP4,
    # top-6 + shared, Engram rows of 256 in 24 buckets per layer) on 4 of its 40 layers: sliding-only 0-1, a
    # ratio-2 KV source 2 and a ratio-1 KV source 3 (the candidate layer), Engram before layers 1 and 2. The Engram
    # tables are scaled down 64x (bucket primes above 250,000 instead of 16,000,000: 6.0M rows, 1.63 GB per table at
    # Q8_0 instead of 104.4 GB), so the file (~36 GB: 28.9 GB of experts) fits the GPU machine's 64 GB disk
    "ds41-flash": DS41Spec(n_layer=4, compress_ratios=(0, 0, 2, 1), kv_sources=(2, 3), index_sources=(2, 3),
                           candidate_layer=3, engram_layers=(1, 2), engram_vocab=250_000, **_FLASH),
}


def validate(spec: DS41Spec) -> None:
    from betelgeuse.gguf.synth_ds4 import validate as validate_ds4
    if spec.router_drift or spec.router_skew:     # synth_ds4's wiring assumes V4's mHC and hash layers
        raise InvalidRequestError("a calibrated router (--router calibrated, router_skew) is not implemented for "
                                  "deepseek41 synth models (use the preset's or --router uniform)")
    validate_ds4(replace(spec, compress_ratios=tuple(0 for _ in spec.ratios())))
    if len(spec.ratios()) != spec.n_layer or any(r not in ds41layout.RATIOS for r in spec.ratios()):
        raise InvalidRequestError(f"compress_ratios {spec.ratios()} must list {spec.n_layer} values in "
                                  f"{ds41layout.RATIOS}")
    if spec.engram_qtype not in ENGRAM_QTYPES:
        raise InvalidRequestError(f"engram_qtype {spec.engram_qtype!r} not supported ({', '.join(ENGRAM_QTYPES)})")
    if not set(spec.kv_sources) <= set(spec.index_sources):
        raise InvalidRequestError(f"every KV source {spec.kv_sources} must also index ({spec.index_sources})")
    if spec.engram_layers and (spec.engram_max_ngram < 2 or spec.engram_heads < 1
                               or spec.engram_key_length % 256 and spec.engram_qtype.endswith("_K")
                               or spec.engram_key_length % 32):
        raise InvalidRequestError("Engram needs max_ngram >= 2, heads >= 1 and a key length that is a multiple of "
                                  "the table type's block (32; 256 for K-quants)")
    try:
        spec.config()
    except Exception as e:                       # a role layout the reader would refuse
        raise InvalidRequestError(f"invalid deepseek41 layer roles: {e}") from None


def qtype_of(spec: DS41Spec, name: str, shape: tuple[int, ...]) -> GT:
    """The type a tensor is stored in: Engram tables `engram_qtype`; the rest as deepseek4's (synth_ds4.release_qtype:
    experts `expert_qtype`, the checkpoint's FP8 matrices Q8_0 and BF16 ones BF16, 1-D, mHC, compressor F32)."""
    k = ds41layout.kind(name)
    if k == ds41layout.ENGRAM_TABLE:
        return GT[spec.engram_qtype]
    return release_qtype(spec, k, shape, ds41layout.FP8, ds41layout.BF16, ds41layout.F32_2D)


_TABLE_PER = 1 << 16            # blocks per chunk of a Q8_0 table
_TABLE_STD = 0.6               # the tables' values ~N(0, 0.6)-sized: Q8_0 int8 x 0.008, K-quants calibrated


@functools.lru_cache(maxsize=4)
def _q8_tile(seed: int) -> np.ndarray:
    """2 x _TABLE_PER random Q8_0 blocks uint8 [n, 34], d = 0.008 (read-only; the tables are views of it)."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, int(GT.Q8_0), 41])))
    raw = random_blocks(int(GT.Q8_0), 2 * _TABLE_PER, rng, d=0.008)
    raw.flags.writeable = False
    return raw


def _table_chunks(spec: DS41Spec, name: str, shape: tuple[int, ...], gt: GT) -> Iterator[np.ndarray]:
    """A random Engram table: views of a tile of random blocks at random offsets (a 1.6 GB table costs only its
    write; K-quants through synth_common.matrix_chunks' tiles); BF16/F32 tables as N(0, 1) rows."""
    rng = tensor_rng(spec, name)
    rows, cols = shape
    if gt in (GT.F32, GT.BF16):
        yield from _float_rows(rng, rows, cols, 0.0, 1.0, gt)
    elif gt == GT.Q8_0:
        yield from tiled_chunks(rng, _q8_tile(spec.seed), rows * cols // 32, _TABLE_PER)
    else:
        yield from matrix_chunks(rng, rows, cols, _TABLE_STD, gt.name, seed=spec.seed)


def _float_rows(rng: np.random.Generator, rows: int, cols: int, mean: float, std: float, gt: GT) -> Iterator[np.ndarray]:
    """Rows of mean + N(0, std) in F32 or BF16, ~4 MiB at a time."""
    from gguf import quants
    step = max(1, (1 << 20) // cols)
    for r0 in range(0, rows, step):
        x = (mean + std * rng.standard_normal((min(step, rows - r0), cols))).astype(np.float32)
        yield x if gt == GT.F32 else quants.quantize(x, gt)


def tensor_plan(spec: DS41Spec, source: Callable[[str], np.ndarray] | None = None):
    """(name, torch shape, type, chunk generator) for every tensor."""
    cfg = spec.config()
    plan = []
    for name, shape in ds41layout.tensors(cfg):
        gt = qtype_of(spec, name, shape)
        if source is not None:
            gen = (lambda n=name, g=gt: _source_chunks(source(n), g))
        elif ds41layout.kind(name) == ds41layout.ENGRAM_TABLE:
            gen = (lambda n=name, s=shape, g=gt: _table_chunks(spec, n, s, g))
        elif ds41layout.kind(name) in ("engram_q", "engram_k"):      # branch norm weights: 1 + noise
            gen = (lambda n=name, s=shape, g=gt: _float_rows(tensor_rng(spec, n), s[0], s[1], 1.0, 0.1, g))
        else:
            gen = (lambda n=name, s=shape, g=gt: _random_chunks(spec, n, s, g, cfg))
        plan.append((name, shape, gt, gen))
    return plan


def add_metadata(w: GGUFWriter, spec: DS41Spec, tokenizer: bool = True, engram=_DERIVE,
                 name: str | None = None) -> None:
    """V4's keys under `deepseek41.` (what llama.cpp's V4.1 converter writes) plus the candidate filter and Engram
    (`engram`: the constants to write; by default derived from the spec and its synth tokenizer)."""
    a = ARCH
    add_ds4_metadata(w, spec, tokenizer=False, name=name)
    cand = spec.candidate_layer if spec.candidate_layer < spec.n_layer else -1
    w.add_int32(f"{a}.attention.indexer.candidate_layer", cand)
    w.add_uint32(f"{a}.attention.indexer.candidate_block_count", spec.candidate_blocks)
    w.add_uint32(f"{a}.attention.indexer.candidate_block_size", spec.candidate_block_size)
    add_engram_metadata(w, spec.engram_params() if engram is _DERIVE else engram)
    if tokenizer:
        add_tokenizer(w, spec.n_vocab, spec.chat_template)


def add_engram_metadata(w: GGUFWriter, g: EngramParams | None) -> None:
    """The `deepseek41.engram.*` keys with llama.cpp's value types (I32 layer ids and token map, U32 scalars, U64
    multipliers / primes / offsets)."""
    from gguf import GGUFValueType as VT
    if g is None:
        return
    a = ARCH
    w.add_key_value(f"{a}.engram.layer_ids", list(g.layer_ids), VT.ARRAY, VT.INT32)
    w.add_uint32(f"{a}.engram.head_count", g.n_heads)
    w.add_uint32(f"{a}.engram.key_length", g.key_length)
    w.add_uint32(f"{a}.engram.max_ngram_size", g.max_ngram)
    w.add_uint32(f"{a}.engram.pad_id", g.pad_id)
    for key, arr in (("multipliers", g.multipliers), ("primes", g.primes), ("offsets", g.offsets)):
        w.add_key_value(f"{a}.engram.{key}", [int(x) for row in arr for x in row], VT.ARRAY, VT.UINT64)
    w.add_key_value(f"{a}.engram.token_map", [int(x) for x in g.token_map], VT.ARRAY, VT.INT32)


def write_deepseek41(path: str | os.PathLike, spec: DS41Spec, source: Callable[[str], np.ndarray] | None = None,
                     progress: bool = True) -> None:
    """Write `spec` at `path`; `source(gguf_name)` -> float32 array (torch shape) supplies the weights instead of
    the random generator (the oracle test passes NeMo's, already rounded through the quantizer)."""
    validate(spec)
    write_gguf(path, ARCH, tensor_plan(spec, source), lambda w: add_metadata(w, spec), progress)


def model_nbytes(spec: DS41Spec) -> int:
    return sum(nbytes(shape, gt) for _, shape, gt, _ in tensor_plan(spec))


def engram_table_bytes(spec: DS41Spec) -> int:
    return sum(nbytes(shape, gt) for name, shape, gt, _ in tensor_plan(spec)
               if ds41layout.kind(name) == ds41layout.ENGRAM_TABLE)


