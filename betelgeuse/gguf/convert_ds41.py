"""`betelgeuse convert`: the official DeepSeek-V4.1 checkpoint (Hugging Face layout) -> a `deepseek41` GGUF in
llama.cpp's layout (dialect A, gguf/ds41layout.py), tensor by tensor.

The checkpoint (`config.json` with `text_config` and `quantization_config`, `model.safetensors.index.json` and its
shards, `tokenizer.json`) stores
  - FP8 E4M3 matrices with one ue8m0 scale per weight_block_size block (32 x 32 in V4.1): attention, shared
    experts, indexer queries, Engram wkv            -> Q8_0 (llama.cpp's converter), or BF16 / F32 (`--outtype`;
                                                        exact: e4m3 x 2^k is a bfloat16)
  - routed experts as FP4 E2M1 (two per byte, even column in the low nibble) with a ue8m0 scale per 32 values
                                                     -> MXFP4, repacked bit for bit (ggml's nibble order)
  - the Engram tables as FP8 E4M3 rows with a ue8m0 scale per 32 values of a row -> Q8_0 (as llama.cpp's
    converter writes them), or BF16 / F32
  - BF16 / F32 for the rest: 2-D BF16 stays BF16 (F32 with --outtype f32), 1-D and F32 become F32
DSpark draft (`mtp.*`) and vision tensors are skipped, as llama.cpp's text conversion does. Metadata: V4's keys
under `deepseek41.`, the candidate filter, and the Engram constants derived as the release does (the compressed
token map from tokenizer.json, primes, offsets, numpy-seeded multipliers); the tokenizer as a GGUF byte-level BPE.

Streaming: the header is planned from the shards' headers alone; each tensor is then read from its shard in row
chunks (~16M values), converted and written, so a 500 GB checkpoint converts in a few GB of RAM, with a progress
bar. The writer is gguf-py's GGUFWriter (through synth.write_gguf, the project's one streaming writer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GT, quants

from betelgeuse.errors import InvalidRequestError, ModelFormatError, UnsupportedError
from betelgeuse.gguf import ds41layout
from betelgeuse.gguf.synth_ds41 import DS41Spec

OUTTYPES = {"q8_0": GT.Q8_0, "bf16": GT.BF16, "f32": GT.F32}
_CHUNK = 16 << 20             # values converted at a time
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


# ---- the checkpoint ------------------------------------------------------------------------------

class Checkpoint:
    """A safetensors checkpoint directory: tensor name -> (shard, shape, dtype), read lazily by row ranges."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open
        self.dir = Path(path)
        if not (self.dir / "config.json").is_file():
            raise InvalidRequestError(f"{self.dir}: not a checkpoint directory (no config.json)")
        self.config = json.loads((self.dir / "config.json").read_text())
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not shards:
            raise InvalidRequestError(f"{self.dir}: no .safetensors shards")
        self._open = safe_open
        self.where: dict[str, str] = {}
        self.meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for s in shards:
            with safe_open(str(self.dir / s), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    self.where[name] = s
                    self.meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
        self._handles: dict[str, object] = {}

    def slice(self, name: str):
        s = self.where[name]
        if s not in self._handles:
            self._handles[s] = self._open(str(self.dir / s), framework="pt").__enter__()
        return self._handles[s].get_slice(name)

    def rows(self, name: str, a: int, b: int):
        """Rows [a, b) of tensor `name` as a torch tensor in its stored dtype."""
        return self.slice(name)[a:b]

    def text_config(self) -> dict:
        c = self.config
        t = dict(c.get("text_config") or {})
        return {**{k: v for k, v in c.items() if k not in ("text_config", "vision_config")}, **t}

    def close(self):
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles = {}


# ---- metadata ----------------------------------------------------------------------------------------

def spec_from_config(t: dict, outtype: str) -> DS41Spec:
    """The checkpoint's text_config as the DS41Spec whose metadata the file carries (V4.1's names; NeMo's
    DeepseekV41TextConfig defaults where a key is absent)."""
    def get(k, default=None):
        v = t.get(k, default)
        if v is None:
            raise ModelFormatError(f"config.json: missing key {k!r} in text_config")
        return v
    L = get("num_hidden_layers")
    rs = t.get("rope_scaling") or t.get("rope_parameters") or {}
    spec = DS41Spec(
        n_layer=L, n_embd=get("hidden_size"), n_head=get("num_attention_heads"), head_dim=get("head_dim", 512),
        rope_dim=get("qk_rope_head_dim", 64), q_lora_rank=get("q_lora_rank"), o_groups=get("o_groups"),
        o_lora_rank=get("o_lora_rank"), n_expert=get("n_routed_experts"), n_expert_used=get("num_experts_per_tok"),
        n_ff_exp=get("moe_intermediate_size"), n_vocab=get("vocab_size"),
        compress_ratios=tuple(get("compress_ratios"))[:L], n_hash_layers=0, n_shared=get("n_shared_experts", 1),
        sliding_window=get("sliding_window", 128), index_n_heads=get("index_n_heads", 32),
        index_head_dim=get("index_head_dim", 128), index_topk=get("index_topk", 512), hc_mult=get("hc_mult", 4),
        hc_sinkhorn_iters=get("hc_sinkhorn_iters", 20), hc_eps=get("hc_eps", 1e-6),
        context_length=get("max_position_embeddings", 1048576), rope_theta=get("rope_theta", 10000.0),
        compress_rope_theta=get("compress_rope_theta", 160000.0), rope_factor=float(rs.get("factor", 1.0)),
        rope_orig_ctx=int(rs.get("original_max_position_embeddings", 0)),
        yarn_beta_fast=float(rs.get("beta_fast", 32)), yarn_beta_slow=float(rs.get("beta_slow", 1)),
        swiglu_limit=float(get("swiglu_limit", 10.0)), routed_scale=float(get("routed_scaling_factor")),
        rms_eps=float(get("rms_norm_eps")), expert_qtype="MXFP4",
        dense="F32" if outtype == "f32" else "release",
        kv_sources=tuple(get("kv_source_layer_ids")), index_sources=tuple(get("index_source_layer_ids")),
        candidate_layer=int(get("candidate_source_layer_id", -1)), candidate_blocks=get("candidate_topk_blocks", 2048),
        candidate_block_size=get("candidate_block_size", 8), engram_layers=tuple(t.get("engram_layer_ids") or ()),
        engram_heads=get("engram_n_heads", 8), engram_key_length=get("engram_head_dim", 256),
        engram_max_ngram=get("engram_max_ngram_size", 4), engram_vocab=get("engram_vocab_size", 16_000_000),
        engram_pad_token=get("engram_pad_token_id", 2), chat_template="deepseek-v4")
    if not t.get("norm_topk_prob", True):
        raise ModelFormatError("config.json: norm_topk_prob false is not DeepSeek-V4.1's routing")
    return spec


def tokenizer_metadata(ckpt: Checkpoint) -> dict:
    """tokenizer.json (byte-level BPE) -> the GGUF tokenizer keys (tokens in id order, merges, types, specials)."""
    from tokenizers import Tokenizer
    p = ckpt.dir / "tokenizer.json"
    if not p.is_file():
        raise InvalidRequestError(f"{ckpt.dir}: no tokenizer.json (Engram's token map and the GGUF tokenizer need it)")
    tok = Tokenizer.from_file(str(p))
    j = json.loads(p.read_text())
    model = j.get("model", {})
    if model.get("type") != "BPE":
        raise ModelFormatError(f"{p}: tokenizer model {model.get('type')!r}; only byte-level BPE is converted")
    n = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) or f"[PAD{i}]" for i in range(n)]
    added = {a["id"]: a for a in j.get("added_tokens", [])}
    types = [(3 if added[i].get("special") else 4) if i in added else 1 for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg = {}
    tc = ckpt.dir / "tokenizer_config.json"
    if tc.is_file():
        cfg = json.loads(tc.read_text())
    return {"tokens": tokens, "types": types, "merges": merges, "pre": _pre_name(j), "add_bos": cfg.get("add_bos_token", True),
            "bos": ckpt.config.get("bos_token_id", 0), "eos": ckpt.config.get("eos_token_id", 1),
            "chat_template": cfg.get("chat_template"), "tokenizer": tok}


def _pre_name(j: dict) -> str:
    """The GGUF pre-tokenizer name (llama.cpp's) of tokenizer.json's pre_tokenizer: its Split regexes in order (a
    CR or LF character written as `\\r` / `\\n`, as the regex means it), or a lone regex-splitting ByteLevel (GPT-2's).
    One we could not read back is refused here, not at the first request."""
    from betelgeuse.gguf.vocab import PRE_SPLITS
    pre = j.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre])
    regs = tuple(p.get("pattern", {}).get("Regex", "").replace("\r", r"\r").replace("\n", r"\n")
                 for p in parts if p.get("type") == "Split")
    if not regs and any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return "gpt2"
    for name, splits in PRE_SPLITS.items():
        if regs == splits:
            return name
    raise UnsupportedError(f"tokenizer.json: pre-tokenizer splits {list(regs)!r} are none of the known ones "
                           f"({', '.join(PRE_SPLITS)})")


def add_tokenizer_metadata(w, tm: dict) -> None:
    from betelgeuse.gguf.templates import chat_template
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tm["pre"])
    w.add_token_list(tm["tokens"])
    w.add_token_types(tm["types"])
    w.add_token_merges(tm["merges"])
    w.add_bos_token_id(int(tm["bos"]))
    w.add_eos_token_id(int(tm["eos"]))
    w.add_add_bos_token(bool(tm.get("add_bos", True)))
    w.add_chat_template(tm["chat_template"] if isinstance(tm["chat_template"], str) else chat_template("deepseek-v4"))


def engram_params(spec: DS41Spec, tm: dict, t: dict, table_rows: dict[int, int]):
    """The Engram constants the release derives (ds41layout.engram_constants), from this checkpoint's tokenizer."""
    if not spec.engram_layers:
        return None
    tmap, n_comp = ds41layout.compressed_token_map(tm["tokenizer"])
    want = t.get("engram_compressed_vocab_size")
    if want is not None and want != n_comp:
        raise ModelFormatError(f"config.json: engram_compressed_vocab_size is {want} but tokenizer.json compresses to "
                               f"{n_comp} ids (every hash multiplier derives from it)")
    mult, primes, offs = ds41layout.engram_constants(spec.engram_layers, spec.engram_max_ngram, spec.engram_heads,
                                                     spec.engram_vocab, n_comp)
    tmap = tmap + [0] * max(0, spec.n_vocab - len(tmap))
    return ds41layout.EngramParams(
        layer_ids=spec.engram_layers, n_heads=spec.engram_heads, key_length=spec.engram_key_length,
        max_ngram=spec.engram_max_ngram, pad_id=tmap[spec.engram_pad_token], multipliers=tuple(map(tuple, mult)),
        primes=tuple(map(tuple, primes)), offsets=tuple(map(tuple, offs)), token_map=tuple(tmap),
        rows=tuple(table_rows[l] for l in spec.engram_layers))


# ---- tensors -------------------------------------------------------------------------------------------

def _f32(x) -> np.ndarray:
    import torch
    return x.to(torch.float32).numpy()


def _scaled_rows(ck: Checkpoint, name: str, scale: str | None, a: int, b: int, block: int) -> np.ndarray:
    """Rows [a, b) of a (possibly FP8 + ue8m0-scaled) matrix as float32."""
    w = _f32(ck.rows(name, a, b))
    if scale is None:
        return w
    rows, cols = ck.meta[name][0]
    srows = ck.meta[scale][0][0]
    br = 1 if srows == rows else block              # Engram tables: one scale per 32 values of a row
    bc = -(-cols // ck.meta[scale][0][1])
    assert a % br == 0, (a, br)                     # chunks start on a block row
    s = _f32(ck.rows(scale, a // br, -(-b // br)))
    return w * np.repeat(np.repeat(s, br, axis=0)[: b - a], bc, axis=1)[:, :cols]


def _fp4_to_mxfp4(ck: Checkpoint, name: str, scale: str, a: int, b: int) -> np.ndarray:
    """Rows [a, b) of a packed FP4 expert matrix -> ggml MXFP4 blocks uint8 [rows, cols/32, 17], bit for bit: the
    ue8m0 byte is ggml's exponent, nibble 2i / 2i+1 of byte i becomes element j / j+16 of the block."""
    import torch
    p = ck.rows(name, a, b).view(torch.uint8).numpy()                     # [r, cols/2]
    s = ck.rows(scale, a, b).view(torch.uint8).numpy()                    # [r, cols/32] e8m0 bytes
    r = p.shape[0]
    codes = np.empty((r, p.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = p & 0x0F, p >> 4
    codes = codes.reshape(r, -1, 32)
    out = np.empty((r, codes.shape[1], 17), dtype=np.uint8)
    out[:, :, 0] = s
    out[:, :, 1:] = codes[:, :, :16] | (codes[:, :, 16:] << 4)
    return out


def _encode(x: np.ndarray, gt: GT) -> np.ndarray:
    return x.astype(np.float32) if gt == GT.F32 else quants.quantize(x.astype(np.float32), gt)


def plan(ck: Checkpoint, spec: DS41Spec, outtype: str):
    """(gguf name, torch shape, type, chunk generator) for every tensor the text model uses, in ds41layout's order."""
    t_out = OUTTYPES[outtype]
    block = int((ck.config.get("quantization_config") or {}).get("weight_block_size", [128, 128])[0])
    gg: dict[str, list] = {}
    experts: dict[str, dict[int, str]] = {}
    for name in ck.meta:
        if name.endswith(".scale"):
            continue
        try:
            got = ds41layout.released_to_gguf(name)
        except KeyError:
            raise ModelFormatError(f"{ck.dir}: tensor {name!r} has no deepseek41 GGUF name") from None
        if got is None:
            continue
        gname, e = got
        if e is None:
            gg[gname] = [name]
        else:
            experts.setdefault(gname, {})[e] = name
    out = []
    for gname, parts in experts.items():
        E = len(parts)
        if sorted(parts) != list(range(E)):
            raise ModelFormatError(f"{ck.dir}: {gname} is missing experts (have {E}, ids {sorted(parts)[:4]}...)")
        (r, half), dt = ck.meta[parts[0]]
        scale = parts[0][: -len("weight")] + "scale"
        if dt not in ("I8", "U8") or scale not in ck.meta:
            raise ModelFormatError(f"{ck.dir}: routed expert {parts[0]} is {dt}, expected packed FP4 (int8 + scale)")

        def gen(parts=parts, r=r):
            step = max(1, _CHUNK // (2 * ck.meta[parts[0]][0][1]))
            for e in range(len(parts)):
                sc = parts[e][: -len("weight")] + "scale"
                for a in range(0, r, step):
                    yield _fp4_to_mxfp4(ck, parts[e], sc, a, min(r, a + step))
        out.append((gname, (E, r, 2 * half), GT.MXFP4, gen))
    for gname, (name,) in gg.items():
        shape, dt = ck.meta[name]
        scale = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        scale = scale if scale in ck.meta else None
        k = ds41layout.kind(gname)
        if len(shape) == 1:
            gt = GT.F32
        elif scale is not None:
            gt = t_out
        elif dt == "F32" or k in ds41layout.F32_2D:
            gt = GT.F32
        else:
            gt = GT.F32 if outtype == "f32" else GT.BF16
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape

        def gen(name=name, scale=scale, rows=rows, cols=cols, gt=gt, one=len(shape) == 1):
            if one:
                yield _encode(_f32(ck.slice(name)[:]), gt)
                return
            step = max(block, _CHUNK // cols // block * block)
            for a in range(0, rows, step):
                yield _encode(_scaled_rows(ck, name, scale, a, min(rows, a + step), block), gt)
        out.append((gname, tuple(shape), gt, gen))
    order = {n: i for i, (n, _) in enumerate(ds41layout.tensors(spec.config(engram=None)))}
    known = {n for n, *_ in out}
    missing = sorted(set(order) - known - {n for n in order if ds41layout.kind(n) == ds41layout.ENGRAM_TABLE})
    if missing:
        raise ModelFormatError(f"{ck.dir}: the checkpoint has no tensor for {missing[0]!r} (config.json's layer "
                               f"roles need it){f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
    return sorted(out, key=lambda p: order.get(p[0], len(order)))


def convert(src: str | os.PathLike, dst: str | os.PathLike, outtype: str = "q8_0", progress: bool = True) -> None:
    """Convert the checkpoint directory `src` into the GGUF `dst` (module doc)."""
    from betelgeuse.gguf.synth_common import write_gguf
    from betelgeuse.gguf.synth_ds41 import ARCH, add_metadata
    if outtype not in OUTTYPES:
        raise InvalidRequestError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    ck = Checkpoint(src)
    try:
        arch = (ck.config.get("architectures") or ["?"])[0]
        if arch != "DeepseekV41ForCausalLM" and ck.config.get("model_type") != "deepseek_v41":
            raise InvalidRequestError(f"{ck.dir}: architecture {arch!r}; `betelgeuse convert` converts "
                                      "DeepseekV41ForCausalLM (DeepSeek-V4.1) checkpoints")
        t = ck.text_config()
        spec = spec_from_config(t, outtype)
        tm = tokenizer_metadata(ck)
        rows = {l: ck.meta[f"layers.{l}.engram.embed.weight"][0][0] for l in spec.engram_layers
                if f"layers.{l}.engram.embed.weight" in ck.meta}
        missing = [l for l in spec.engram_layers if l not in rows]
        if missing:
            raise ModelFormatError(f"{ck.dir}: config.json names Engram layer {missing[0]} but the checkpoint has no "
                                   f"layers.{missing[0]}.engram.embed.weight")
        g = engram_params(spec, tm, t, rows)
        p = plan(ck, spec, outtype)

        def meta(w):
            add_metadata(w, spec, tokenizer=False, engram=g, name=str(ck.config.get("_name_or_path") or ck.dir.name))
            add_tokenizer_metadata(w, tm)
        write_gguf(dst, ARCH, p, meta, progress)
    finally:
        ck.close()


