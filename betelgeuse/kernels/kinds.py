"""Which GGML expert types each kernel family reads, and which layers may hold which VRAM layout: tables the store
process's slot plan and the CLI read too, so this module imports neither torch nor triton
(tests/model/test_model_interface.py checks the plan's imports)."""

from __future__ import annotations

from betelgeuse.kernels import tile_layout

# GGML types the triton kernels read directly (triton_quants.QT_CODES: F32, F16, Q8_0, BF16, MXFP4, Q4_K, Q5_K,
# Q6_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL, IQ2_XXS, IQ2_XS, IQ3_XXS); kept here so that the torch-only path never
# imports triton
TRITON_QTYPES = frozenset({0, 1, 8, 30, 39, 12, 13, 14, 11, 10, 23, 20, 16, 17, 18})
# GGML types with an int8 tensor-core schedule on q8_1 activations (triton_mmq.MMQ_TYPES: Q8_0, MXFP4, Q4_K) and the K
# multiple each needs (its block)
MMQ_QTYPES = {8: 32, 39: 32, 12: 256}
BF16_QTYPES = {**MMQ_QTYPES, 13: 256}    # act_quant bf16's types (triton_mmq.BF_TYPES): + Q5_K
# act_quant auto: the bf16 MMA only for the types where it beats the float schedule on the device (gpu-run53-roofline,
# H100, GB/s 1 / 16 rows: Q8_0 933 / 741 against 438 / 318, MXFP4 505 / 297 against 300 / 191); Q4_K and Q5_K keep the
# float schedule (their bf16 MMA measured 0.6-0.9x of it)
AUTO_QTYPES = {8: 32, 39: 32}


def mma_qtypes(act_quant: str) -> dict[int, int]:
    """The GGML types (id -> K multiple) whose triton expert parts run on triton_mmq's schedule under act_quant."""
    return {"off": {}, "q8_1": MMQ_QTYPES, "bf16": BF16_QTYPES, "auto": AUTO_QTYPES}[act_quant]


# engine.tile_experts: the GGML types whose VRAM slots take kernels/tile_layout's layout for triton_moe's float kernels
# (act_quant off; auto for Q4_K): those the device measured faster tiled (gpu-run65, H200, kernel_roofline.py --tiles,
# tiled / GGUF at 1 / 16 rows: Q8_0 1.29 / 1.22, Q4_K 1.33 / 1.28; MXFP4 0.99 / 1.01 stays GGUF; the MMA kernels'
# byte loads on tiles 0.45-0.78x of their shipped schedules, so never a layer on triton_mmq). Other types: unmeasured
TILE_QTYPES = {8: "Q8_0", 12: "Q4_K"}


def tile_plan(parts, act_quant: str) -> list[str | None]:
    """engine.tile_experts, what the model and act_quant decide (MoEKernels.tile_check adds the kernels' side; the VRAM
    plan counts the scratch from this alone): per layer, None where its VRAM slots may hold the tile layout, else why
    not. parts[l][e]: an expert's (gate, up, down) parts (.qtype, .shape (rows, K); expert 0 is read: a layer's experts
    share types and shapes). A layer tiles whole (bit 0 is an expert's flag, read by both its launches): every part of
    a TILE_QTYPES type, whole 64-row tiles of whole blocks (tile_layout.usable), none on triton_mmq's MMA
    (act_quant)."""
    mma = mma_qtypes(act_quant)
    out: list[str | None] = []
    for layer in parts:
        ps = layer[0]
        kinds = sorted({int(m.qtype) for m in ps})
        if not set(kinds) <= TILE_QTYPES.keys():
            out.append(f"expert types {kinds}: the tile layout gained on the device for {sorted(TILE_QTYPES.values())} "
                       "only")
        elif set(kinds) & mma.keys():
            out.append(f"act_quant = {act_quant!r} runs types {sorted(set(kinds) & mma.keys())} on triton_mmq's MMA, "
                       "whose loads are slower on tiles")
        elif not all(tile_layout.usable(*m.shape, int(m.qtype)) for m in ps):
            out.append(f"part shapes {[tuple(m.shape) for m in ps]}: not whole {tile_layout.TR}-row tiles of whole "
                       "blocks")
        else:
            out.append(None)
    return out
