"""One layer's routed experts over slot indices: one interface, two backends.

  torch   the reference (CPU, CI; also the fallback on CUDA for other types): a loop over the
          group's experts, each dequantized from its slot and applied to its rows in sub-batches of
          `sub_batch` (torch_moe.run_expert), ranks combined in order (torch_moe.moe_combine). Bit-identical
          to the reference models on the same device and dtype.
  triton  the GPU hot path (also runs under TRITON_INTERPRET=1 on the CPU in tests): rows sorted by
          expert on the device, then ONE gate_up + ONE down launch per tier group, whatever the number
          of experts in it, dequantizing the expert bytes inside the matmul (every type of TRITON_QTYPES:
          F32/F16/BF16, Q8_0, MXFP4, the K-quants Q6_K..Q2_K, IQ4_XS/IQ4_NL, IQ3_XXS, IQ2_XS, IQ2_XXS),
          then one combine.

A layer is used like this (the runner owns tiers, copies and the store):

    r = moe.route(ids, w)                       # ids/w [T,k]; device sort (triton) or host plan (torch)
    moe.apply(r, h, group)                      # for each tier group as its bytes are ready
    out = moe.combine(r)                        # [T,H] = sum_r w_r * expert_r(h)

A Group names the experts whose bytes are ready and where they are: byte offsets relative to the worker's
device pool (`ExpertCache.pool`): base[e] != -1 for experts in the group, -1 for the others. An offset may point
outside the pool (decode's at-hand group, worker/at_hand.py: a flex-cache chunk, or a host-arena slot read in place
over PCIe, whose device address is then below or above the pool's: a negative offset). The triton backend reads the
table on the device (`base_dev`, no host loop); the torch one walks `experts` (or the table's entries != -1), each
read from `srcs[e]` = (tensor, byte offset) where given, else from the pool at base[e].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from betelgeuse.gguf.qtypes import row_nbytes
from betelgeuse.kernels import mma_pack
from betelgeuse.kernels.kinds import TILE_QTYPES, TRITON_QTYPES, mma_qtypes, tile_plan
from betelgeuse.kernels.torch_moe import ExpertWork, moe_combine, plan_experts, run_expert

def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:       # not installed, or no driver/interpreter
        return False
    return True


@dataclass(slots=True)
class Group:
    experts: np.ndarray | None       # [n] int64 expert ids, ascending (torch backend; None = from base_host)
    base_host: np.ndarray | None     # [E] int64 byte offset of each expert's slot in the pool, -1 = not here
    base_dev: torch.Tensor | None    # the same table on the device (triton backend)
    srcs: list | None = None         # torch backend: [E] (tensor, byte offset) of each expert's slot, or None = pool


@dataclass(slots=True)
class Routing:
    """One layer's routing, prepared for its groups."""
    h: torch.Tensor                  # [T,H] expert input
    ids: torch.Tensor                # [T,k] int64
    w: torch.Tensor                  # [T,k]
    y: torch.Tensor                  # [T*k, H] expert outputs by (token, rank); every row written once
    rows: torch.Tensor | None        # triton: [T*k] int32 (token*k + rank) sorted by expert (stable)
    off: torch.Tensor | None         # triton: [E+1] int32 first sorted row of each expert
    counts: torch.Tensor             # [E] int64 rows per expert, on the device
    inter: torch.Tensor | None       # triton: [T*k, F] activations, sorted-row order
    plan: dict | None                # torch: {expert: ExpertWork}
    hq: tuple | None = None          # triton with act_quant q8_1 / bf16: quantize_q8_1(h) / prepare_bf16(h), by route()


class MoEKernels:
    """The per-layer expert math for one model file's geometry, on one device."""

    def __init__(self, backend: str, n_expert: int, n_ff: int, starts: torch.Tensor, qtypes: list[tuple[int, int]],
                 sub_batch: int, weights_fn=None, act_limit: float | None = None, act_quant: str = "off",
                 sort_rows: bool = False):
        """starts [L,E,3] int64: byte offset of gate/up/down inside a slot (device); qtypes[l] = (gate/up, down)
        GGML types per layer; weights_fn(slot_bytes, layer, expert) -> (gate, up, down) for the torch path;
        act_quant "q8_1": the triton backend runs the parts whose type has an int8 MMA schedule on q8_1
        activations (triton_mmq; approximate), the others on the float schedules; "bf16": those parts on the bf16
        MMA of their integer quants (triton_mmq's BF mode: the activations as bf16, exact products, float noise);
        "auto": bf16 for AUTO_QTYPES only (where the device measured it faster); the torch backend ignores it.
        sort_rows: the triton backend sorts a routing of up to triton_moe.SORT_ROWS_MAX rows in one launch
        (engine.decode_gemv; off: the torch ops' ~8 launches)."""
        assert backend in ("torch", "triton"), backend
        assert act_quant in ("off", "q8_1", "bf16", "auto"), act_quant
        self.act_quant = act_quant
        self.backend, self.E, self.F = backend, n_expert, n_ff
        self.starts, self.qtypes, self.sub_batch = starts, qtypes, sub_batch
        self.weights_fn, self.limit = weights_fn, act_limit
        self._sort_max = 0       # rows up to which route() sorts in one launch (sort_rows, triton: SORT_ROWS_MAX)
        self._mq = None          # triton_mmq where some layer's part runs on q8_1 activations (act_quant, triton)
        self._quant_h = False    # some layer's gate/up does: route() makes h's q8_1
        self._launch_consts: dict = {}   # (layer, H) -> _layer_launch's constants
        # engine.pack_experts (pack_check): per layer, its Q8_0 launches take gluon_mmq's PK 2, which reads each
        # expert's layout from bit 0 of its base offset (a packed VRAM slot's: worker/expert_cache.py)
        self.packed = np.zeros(len(qtypes), dtype=bool)
        # engine.tile_experts (tile_check): per layer, its triton_moe launches are told `tiled` (each expert read in the
        # layout bit 0 of its base offset names: a tiled VRAM slot's, worker/expert_cache.py); never a packed layer
        self.tiled = np.zeros(len(qtypes), dtype=bool)
        self._row_blocks: dict = {}      # (layer, n_rows) -> _row_block's BM (its config dict made once, not per read)
        if backend == "triton":
            from betelgeuse.kernels import triton_moe
            self._tk = triton_moe
            self._sort_max = triton_moe.SORT_ROWS_MAX if sort_rows else 0
            assert self.supports(qtypes), qtypes
            self._aligned = self._starts_aligned(starts)
            mt = mma_qtypes(act_quant)
            if any(q in mt for part in qtypes for q in part):
                from betelgeuse.kernels import triton_mmq
                self._mq = triton_mmq
                self._quant_h = any(qg in mt for qg, _ in qtypes)
                # bf16: the block sums of x only where a K-quant's min term takes them (Q4_K, Q5_K)
                self._sums_h = any(qg in (12, 13) for qg, _ in qtypes)

    def _prepare(self, x: torch.Tensor, sums: bool) -> tuple:
        """triton_mmq's activations of x for act_quant: q8_1 (quantize_q8_1) or bf16 (prepare_bf16; sums: the block
        sums of x, the K-quants' min term)."""
        return self._mq.quantize_q8_1(x) if self.act_quant == "q8_1" else self._mq.prepare_bf16(x, sums)

    @staticmethod
    def supports(qtypes: list[tuple[int, int]]) -> bool:
        return all(a in TRITON_QTYPES and b in TRITON_QTYPES for a, b in qtypes)

    @staticmethod
    def _starts_aligned(starts: torch.Tensor) -> bool:
        """Every part starts 16-byte aligned in its slot (GGUF data is 32-aligned): the kernels may then load
        whole 16-byte vectors of the blocks (one host sync, at construction)."""
        return bool((starts.remainder(16) == 0).all())

    def mmq_parts(self, layer: int, H: int) -> tuple[bool, bool]:
        """(gate/up, down) of `layer` run on triton_mmq's schedule (q8_1: the int8 MMA; bf16: the bf16 MMA):
        act_quant is not off, the backend triton and the part's type has the schedule (MMQ_TYPES, as GGML type ids
        here so that the torch path never imports triton)."""
        if self.backend != "triton" or self.act_quant == "off":
            return False, False
        qg, qd = self.qtypes[layer]
        mt = mma_qtypes(self.act_quant)
        return (qg in mt and H % mt[qg] == 0, qd in mt and self.F % mt[qd] == 0)

    def _layer_launch(self, layer: int, H: int) -> tuple:
        """The triton launches' per-layer constants for inputs of width H: (gate/up, down kernel type codes, their
        q8_1 parts (mmq_parts), their row bytes, the MMA's PK: 2 in a packed layer, triton_moe's `tiled`: a tiled
        layer), made once per (layer, H): an expert group's launches take them every time (each of them a few us of
        Python; they depend on the model file, act_quant, pack_experts and tile_experts alone)."""
        v = self._launch_consts.get((layer, H))
        if v is None:
            qg, qd = self.qtypes[layer]
            v = self._launch_consts[layer, H] = (self._tk.QT_CODES[qg], self._tk.QT_CODES[qd],
                                                 *self.mmq_parts(layer, H), row_nbytes(qg, H), row_nbytes(qd, self.F),
                                                 2 if self.packed[layer] else 0, bool(self.tiled[layer]))
        return v

    def pack_check(self, parts, slot_bytes: int, device) -> np.ndarray:
        """engine.pack_experts: the layers whose VRAM slots may hold mma_pack's layout -> [n_layer] bool (all False:
        the model has no expert of a type with a packed form: Q8_0, MXFP4, Q4_K); raises ValueError naming why not
        where some packed expert's launch would not be gluon_mmq's PK form, the one kernel that reads packed bytes (the
        bits are PK 0's: cpu-pack62, cpu-packk62, cpu-mxpk63). parts[l][e]: an expert's (gate, up, down) parts
        (ExpertCache.parts: .qtype, .shape (rows, K)). A layer with a part of such a type packs; every part of it
        must be of one (the flag is an expert's: another type's kernel would read it), rows and K whole tiles and steps
        (mma_pack.usable); the triton backend with each packed type on the bf16 MMA (act_quant bf16, or auto for Q8_0
        and MXFP4: mma_qtypes); GP >= 1 for Q8_0 at both rows buckets (triton_mmq.BF_TUNING; a packed launch is GL 1:
        triton_mmq.config); and gluon_mmq.usable here (CUDA sm_90, Gluon, not the interpreter, 16-byte aligned
        parts)."""
        kinds = [{int(m.qtype) for ps in parts[l] for m in ps} for l in range(len(parts))]
        layers = np.array([bool(k & mma_pack.GGML.keys()) for k in kinds], dtype=bool)
        if not layers.any():
            return layers
        mixed = [(l, k) for l, k in enumerate(kinds) if layers[l] and not k <= mma_pack.GGML.keys()]
        if mixed:
            l, k = mixed[0]
            raise ValueError(f"layer {l} mixes Q8_0 / MXFP4 / Q4_K expert parts with other types (its types "
                             f"{sorted(k)})"
                             " (the packed flag is an expert's: every part of a packed layer must have a packed form)")
        bad = next(((l, m.qtype, m.shape) for l in np.nonzero(layers)[0] for ps in parts[l] for m in ps
                    if not mma_pack.usable(*m.shape, mma_pack.GGML[int(m.qtype)])), None)
        if bad is not None:
            raise ValueError(f"layer {bad[0]} has a part of type {bad[1]} and shape {bad[2]}: mma_pack needs rows a "
                             "multiple of 64 and K of 64 (Q8_0, MXFP4) or 256 (Q4_K)")
        used = set().union(*(kinds[l] for l in np.nonzero(layers)[0]))
        bf = self.act_quant in ("bf16", "auto")             # q8_1 / off: no type on the bf16 MMA
        off = sorted(used - mma_qtypes(self.act_quant).keys()) if bf else sorted(used)
        if self.backend != "triton" or off:
            raise ValueError(f"the packed types' expert launches here are not gluon_mmq's bf16 MMA (kernels: "
                             f"{self.backend}, act_quant = {self.act_quant!r}, GGML types {off} off it; "
                             "packing needs the triton kernels with act_quant bf16, or auto for Q8_0 / MXFP4)")
        from betelgeuse.kernels import gluon_mmq as gm
        mq = self._mq
        l0 = int(np.nonzero(layers)[0][0])
        H = parts[l0][0][0].shape[1]
        aligned = slot_bytes % 16 == 0 and self._aligned
        for qt in sorted(mma_pack.GGML[t] for t in used):
            for bucket in sorted(mq.BUCKETS):
                c = mq.config(qt, bucket, bf=True, pk=2)
                if qt == 0 and not c.get("GP"):
                    raise ValueError(f"type {qt}'s bf16 schedule at {bucket} rows has GP {c.get('GP')}: Q8_0's packed "
                                     "form needs GP >= 1")
                for K in (H, self.F):
                    if not gm.usable(qt, c, mq._chunk(c, qt, K)[0], device, aligned):
                        raise ValueError("gluon_mmq's kernel cannot run here (it needs CUDA sm_90, Gluon, no "
                                         f"TRITON_INTERPRET and 16-byte aligned parts; device {device}, aligned "
                                         f"{aligned})")
        return layers

    def tile_check(self, parts) -> tuple[np.ndarray, dict[str, list[int]]]:
        """engine.tile_experts: the layers whose VRAM slots take the tile layout -> ([n_layer] bool, {why not: its
        layers} for the others). tile_plan's layers (the model's types and shapes, act_quant), less those whose launches
        here are not triton_moe's float MMA path, the one whose tiled form gained on the device: the torch kernels,
        a packed layer (pack_check: its launches are gluon_mmq's; packing wins where both are on, as its kernel is the
        one its act_quant asked for), or a type whose tuned config takes the decode schedule (MV: GGUF rows only,
        triton_moe raises on a tiled launch of it) in some rows bucket. Never refuses: what cannot tile stays GGUF."""
        why = tile_plan(parts, self.act_quant)
        if self.backend != "triton":
            why = [w or f"kernels: {self.backend} (the tile layout is read by the triton kernels alone)" for w in why]
        for l, w in enumerate(why):
            if w is None and self.packed[l]:
                why[l] = "packed (engine.pack_experts: its launches are gluon_mmq's, which read mma_pack's layout)"
            elif w is None:
                mv = sorted({TILE_QTYPES[int(m.qtype)] for m in parts[l][0] for b in self._tk.BUCKETS
                             if self._tk.config(self._tk.QT_CODES[int(m.qtype)], b)["MV"]})
                if mv:
                    why[l] = f"types {mv} take the decode schedule (MV), which reads GGUF rows only"
        layers = np.array([w is None for w in why], dtype=bool)
        out: dict[str, list[int]] = {}
        for l, w in enumerate(why):
            if w is not None:
                out.setdefault(w, []).append(l)
        return layers, out

    def weight_reads(self, layer: int, rows: np.ndarray | list[int], n_rows: int) -> int:
        """How many times a launch of `n_rows` rows reads its experts' bytes, for experts with `rows` rows each: the
        triton kernels run one program per (output block, row block of one expert), each reading its weight rows over
        all of K, so an expert's bytes are read once per row block: ceil(rows / BM) (BM = 16, or BM_MV rows on the
        mmvq decode schedule; gate/up's type and rows bucket; the q8_1 schedule's BM is 16 too); the torch kernels
        dequantize an expert once per group. rows as a list (a decode layer's few experts): the same sums in Python,
        which cost less than numpy calls on them (no generator: each of its steps is a Python call; rows are counts,
        >= 0)."""
        if isinstance(rows, list):
            if self.backend != "triton":
                return len(rows) - rows.count(0)
            bm = self._row_block(layer, n_rows)
            return sum([(x + bm - 1) // bm for x in rows])
        rows = np.asarray(rows, dtype=np.int64)
        if self.backend != "triton":
            return int((rows > 0).sum())
        bm = self._row_block(layer, n_rows)
        return int(((rows + bm - 1) // bm).sum())

    def _row_block(self, layer: int, n_rows: int) -> int:
        """The rows of one row block (BM) of gate/up's launch of `n_rows` rows on `layer` (weight_reads)."""
        bm = self._row_blocks.get((layer, n_rows))
        if bm is None:              # the config of the layer's gate/up type and the rows' bucket: a module constant
            qg = self.qtypes[layer][0]
            c = self._tk.config(self._tk.QT_CODES[qg], self._tk.bucket_of(n_rows, self.E))
            bm = self._row_blocks[layer, n_rows] = c["BM_MV"] if c["MV"] else c["BM"]
        return bm

    # ---- per layer ------------------------------------------------------------------------------
    def route(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, chunks=None) -> Routing:
        """chunks: the pass's position-aligned chunks (chunks.pass_chunks); the torch backend keeps each
        sub-batch inside one chunk (the triton kernels compute every row alone: nothing to keep)."""
        T, k = ids.shape
        y = torch.empty(T * k, h.shape[-1], dtype=h.dtype, device=h.device)
        flat = ids.reshape(-1)
        if flat.shape[0] <= self._sort_max:          # 0 on the torch backend and with sort_rows off
            # decode's few rows: counts, the stable sort by expert and the offsets in one launch (the torch ops
            # below were ~8 launches a layer: two fills, scatter_add, argsort, a cast, a fill, cumsum, a copy)
            counts, rows, off = self._tk.sort_rows(flat, self.E)
        else:
            # rows per expert without a host sync (torch.bincount reads the max back to size its output)
            counts = torch.zeros(self.E, dtype=torch.int64, device=h.device).scatter_add_(0, flat, torch.ones_like(flat))
            if self.backend == "torch":
                return Routing(h, ids, w, y, None, None, counts, None, plan_experts(ids, chunks))
            rows = torch.argsort(flat, stable=True).to(torch.int32)
            off = torch.zeros(self.E + 1, dtype=torch.int32, device=h.device)
            off[1:] = torch.cumsum(counts, 0)
        inter = torch.empty(T * k, self.F, dtype=h.dtype, device=h.device)
        r = Routing(h, ids, w, y, rows, off, counts, inter, None)
        if self._quant_h and h.shape[1] % 32 == 0:
            # here, not at the first apply(): a captured decode graph replays route() and the layer's eager groups
            # then apply() the captured Routing, whose h the replay rewrote in place (a copy made once would go stale)
            r.hq = self._prepare(h.contiguous(), self._sums_h)
        return r

    def apply(self, r: Routing, layer: int, pool: torch.Tensor, g: Group, slot_bytes: int,
              starts: torch.Tensor | None = None) -> None:
        """Compute the group's experts for their rows of r (writes r.y). starts [E,3] overrides the
        layer's part offsets (the reference path packs experts its own way)."""
        if self.backend == "triton":
            tk = self._tk
            st = self.starts[layer] if starts is None else starts
            aligned = slot_bytes % 16 == 0 and (self._aligned if starts is None else self._starts_aligned(starts))
            H = r.h.shape[1]
            qg, qd, mg, md, rg, rd, pk, tiled = self._layer_launch(layer, H)
            mq = self._mq
            if mg:
                assert r.hq is not None, "route() makes the q8_1 of h"
                mq.gate_up(r.hq, pool, g.base_dev, st, r.rows, r.off, r.inter, self.F, r.ids.shape[1],
                           qg, self.limit, rg, aligned, pk)
            else:
                tk.gate_up(r.h, pool, g.base_dev, st, r.rows, r.off, r.inter, self.F, r.ids.shape[1],
                           qg, self.limit, rg, aligned, tiled)
            if md:
                mq.down(self._prepare(r.inter, qd in (5, 6)), pool, g.base_dev, st, r.rows, r.off, r.y, qd, rd,
                        aligned, pk)
            else:
                tk.down(r.inter, pool, g.base_dev, st, r.rows, r.off, r.y, r.ids.shape[0], qd, rd, aligned, tiled)
            return
        T, k = r.ids.shape
        y3 = r.y.view(T, k, -1)
        experts = g.experts if g.experts is not None else np.nonzero(g.base_host != -1)[0]
        for e in experts:
            e = int(e)
            work: ExpertWork | None = r.plan.get(e)
            if work is None:
                continue
            # (bit 0 of an offset flags a packed or tiled VRAM slot, ExpertCache._own: not part of its address; the
            # torch kernels never meet one, as pack_check and tile_check take the triton backend)
            src, b = (pool, int(g.base_host[e]) & ~1) if g.srcs is None else g.srcs[e]
            run_expert(r.h, y3, work, self.weights_fn(src[b: b + slot_bytes], layer, e), self.sub_batch,
                       self.limit)

    def warm(self, pool: torch.Tensor, slot_bytes: int, H: int, k: int, dtype: torch.dtype, tokens,
             prefill: int = 0) -> int:
        """The triton backend: every kernel variant a group of T tokens (T in `tokens`) launches, launched once per
        layer kind (its (gate/up, down) types, q8_1 parts and the alignment of its part offsets' row: what a launch's
        compile key depends on besides T) through route, apply and both combine forms (a fresh [T,H]; rows into an
        [max T, H] buffer: the decode lanes'), as a pass's groups would, on a table of -1: every program returns at
        once, reading no expert byte and writing only these scratch rows (no workspace counter moves). On CUDA each
        variant compiles here (issue 21: not inside a timed step). Whatever group a pass runs (at-hand, misses,
        merged, one expert), its table is [E] and its rows T*k, so T and the layer kind are all a variant depends
        on. prefill > 0: also the fewest T that launch each other variant a pass of up to `prefill` tokens can
        (triton_moe.launch_kinds: the rows-16 bucket, split-K or walked), so a first long prompt compiles nothing
        either. -> the groups launched (0: the torch backend)."""
        if self.backend != "triton":
            return 0
        dev = pool.device
        base = torch.full((self.E,), -1, dtype=torch.int64, device=dev)
        g = Group(None, None, base)
        kinds: dict = {}
        for layer in range(len(self.qtypes)):
            kinds.setdefault((self.qtypes[layer], self.mmq_parts(layer, H), self.starts[layer].data_ptr() % 16 == 0,
                              bool(self.packed[layer]), bool(self.tiled[layer])), layer)
        tokens = list(tokens)
        T_max = max(tokens)
        out = torch.zeros((T_max, H), dtype=dtype, device=dev)
        lanes = torch.arange(T_max, dtype=torch.int64, device=dev)
        aligned = slot_bytes % 16 == 0 and self._aligned
        n = 0
        for layer in kinds.values():
            # (a tiled layer's variants: the same T, as `tiled` adds constexprs that no rows count picks)
            qg, qd, _, _, rg, rd, _, _ = self._layer_launch(layer, H)
            more = [T for T in self._tk.launch_kinds(qg, qd, self.E, H, self.F, k, self.limit, rg, rd, aligned,
                                                     dtype, dev, prefill) if T not in tokens] if prefill else []
            for T in tokens + more:
                h = torch.zeros((T, H), dtype=dtype, device=dev)
                ids = (torch.arange(T * k, device=dev) % self.E).view(T, k)
                w = torch.zeros((T, k), dtype=dtype, device=dev)
                r = self.route(h, ids, w)
                self.apply(r, layer, pool, g, slot_bytes)
                self.combine(r)
                if T <= T_max:                  # the decode lanes' form (rows into their buffer)
                    self.combine(r, out, lanes[:T])
                n += 1
        return n

    def combine(self, r: Routing, out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T,H]: ranks reduced 0..k-1 in order, so no tier or group order changes a bit. out [B,H] and rows [T]
        (the batched decode lanes): row t written into out[rows[t]] (triton: by the kernel itself), out returned."""
        T, k = r.ids.shape
        if self.backend == "triton":
            if out is None:
                out = torch.empty(T, r.y.shape[1], dtype=r.h.dtype, device=r.h.device)
            return self._tk.combine(r.y, r.w, out, rows)
        y = moe_combine(r.y.view(T, k, -1), r.w)
        return y if out is None else out.index_copy_(0, rows, y)


def pack_experts(parts_of, experts, n_expert: int, device) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, int]:
    """A pool holding the raw bytes of `experts` one slot each (the in-process reference path), every part at a
    64-byte aligned offset as in the worker's slots: parts_of(e) -> (gate, up, down) uint8 CPU tensors. Returns
    (pool uint8 on `device`, starts [E,3] int64 on `device` (offset of each part inside its expert's slot),
    base [E] int64 (-1 = not packed), slot bytes)."""
    raws = {int(e): parts_of(int(e)) for e in experts}
    slot = max([sum(-(-p.numel() // 64) * 64 for p in ps) for ps in raws.values()] + [64])
    buf = torch.zeros(max(1, len(raws)) * slot, dtype=torch.uint8)
    starts = np.zeros((n_expert, 3), dtype=np.int64)
    base = np.full(n_expert, -1, dtype=np.int64)
    for i, (e, ps) in enumerate(raws.items()):
        base[e] = o = i * slot
        for k, p in enumerate(ps):
            starts[e, k] = o - base[e]
            buf[o: o + p.numel()] = p
            o += -(-p.numel() // 64) * 64
    return buf.to(device), torch.from_numpy(starts).to(device), base, slot
