"""The streaming GGUF writer and generators that every synthetic architecture's writer shares (synth.py for
qwen3moe, synth_ds4.py for deepseek4): per-tensor seeded random streams, matrices chunk by chunk (Q8_0 as
random blocks), views of a random tile, tensor byte sizes, and the trained byte-level BPE tokenizer with its
corpus. `write_gguf` never holds more than one chunk (~16 MiB) of weights in RAM.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter, quants

from betelgeuse.gguf.qtypes import block_size, tensor_nbytes
from betelgeuse.gguf.quants_synth import BLOCK_TYPES, block_tile

CHUNK_ELEMS = 8 << 20       # weights generated per chunk (Q8_0: ~8.5 MiB, F32: 32 MiB)
_Q8_UNIFORM_STD = math.sqrt((256 ** 2 - 1) / 12) * math.sqrt(1 + 1 / 48)  # int8 uniform x scale jitter


def tensor_rng(spec, name: str) -> np.random.Generator:
    # Per-tensor stream keyed by the name (and spec.seed), so adding a tensor never changes the others.
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([spec.seed, zlib.crc32(name.encode())])))


def _q8_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Random Q8_0 rows: uint8 (rows, cols/32, 34) = f16 scale d + 32 int8 qs; weights d*qs have ~std."""
    nb = rows * cols // 32
    words = rng.integers(0, 2 ** 64 - 1, size=(nb * 34 + 7) // 8, dtype=np.uint64, endpoint=True)
    raw = words.view(np.uint8)[: nb * 34].reshape(nb, 34)
    d16 = raw.view(np.uint16)[:, 0]                    # (nb,) random bits -> scale, jitter in [0.75, 1.25)
    jitter = 0.75 + 0.5 * (np.arange(256, dtype=np.float64) + 0.5) / 256
    table = (jitter * (std / _Q8_UNIFORM_STD)).astype(np.float16).view(np.uint16)
    d16[:] = table[d16 >> 8]                          # a gather: 2x faster than float math per block
    return raw.reshape(rows, cols // 32, 34)


def matrix_chunks(rng: np.random.Generator, rows: int, cols: int, std: float, qtype: str,
                  zero_row: int | None = None, const_col: tuple[int, float] | None = None,
                  zero_rows=(), zero_cols=(), set_rows: dict | None = None, seed: int = 0) -> Iterator[np.ndarray]:
    """A (rows, cols) matrix in `qtype`, row chunks; optional zero rows / zero columns / a constant column, and rows
    given outright (set_rows {row: float [cols]}, applied last). The random draws never depend on these options.
    The K-/i-quants (quants_synth.BLOCK_TYPES) are random valid blocks of values ~std: views of a per-seed tile
    (block_tile) at random offsets, so a writer runs at disk speed; of the options they take only zero rows
    (all-zero bytes: d = 0), for which the chunks holding them are copied."""
    zr = sorted({*zero_rows, *(() if zero_row is None else (zero_row,))})
    if qtype in BLOCK_TYPES:
        assert const_col is None and not len(zero_cols) and not set_rows, f"{qtype}: zero rows only"
        yield from _block_chunks(rng, rows, cols, std, int(GT[qtype]), zr, seed)
        return
    step = max(1, CHUNK_ELEMS // cols)
    zc = np.asarray(sorted(zero_cols), np.int64)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        mine = [r - r0 for r in zr if r0 <= r < r0 + n]
        given = {r - r0: v for r, v in (set_rows or {}).items() if r0 <= r < r0 + n}
        if qtype == "Q8_0":
            blk = _q8_blocks(rng, n, cols, std)        # (n, cols/32, 34)
            if zc.size:
                blk[:, zc // 32, 2 + zc % 32] = 0     # the columns' qs
            blk[mine] = 0                             # d = 0, qs = 0
            if const_col is not None:
                j, a = const_col
                b, p = divmod(j, 32)
                d = blk[:, b, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
                q = np.clip(np.rint(a / d), -127, 127).astype(np.int8)
                blk[:, b, 2 + p] = q.view(np.uint8)
            for r, v in given.items():
                blk[r] = quants.quantize(np.asarray(v, np.float32)[None], GT.Q8_0).reshape(cols // 32, 34)
            yield blk
            continue
        x = rng.standard_normal((n, cols), dtype=np.float32) * np.float32(std)
        x[:, zc] = 0
        x[mine] = 0
        if const_col is not None:
            x[:, const_col[0]] = const_col[1]
        for r, v in given.items():
            x[r] = v
        yield x if qtype == "F32" else x.astype(np.float16) if qtype == "F16" else quants.quantize(x, GT.BF16)


def _block_chunks(rng: np.random.Generator, rows: int, cols: int, std: float, qt: int, zero_rows: list[int],
                  seed: int) -> Iterator[np.ndarray]:
    """matrix_chunks of a block type: uint8 [blocks, type_size] chunks, the blocks of `zero_rows` all zero."""
    blk, size = block_size(qt)
    tile, per_row = block_tile(qt, seed, std), cols // blk
    zb = np.asarray(zero_rows, np.int64)[:, None] * per_row + np.arange(per_row)    # the zero rows' blocks
    zb = zb.ravel()
    u0 = 0
    for ch in tiled_chunks(rng, tile, rows * per_row, len(tile) // 2):
        mine = zb[(zb >= u0) & (zb < u0 + len(ch))] - u0
        if mine.size:
            ch = ch.copy()
            ch[mine] = 0
        u0 += len(ch)
        yield ch


def tiled_chunks(rng: np.random.Generator, tile: np.ndarray, n: int, per: int) -> Iterator[np.ndarray]:
    """`n` units (rows of `tile`: blocks, elements) in chunks of at most `per`, each a view of `tile` at a random
    offset: no generation and no copy per chunk, so a writer that uses it runs at disk speed. `tile` holds at
    least 2 * per units (so the offsets vary) and is never written to (the views go to the writer thread)."""
    assert len(tile) >= min(n, 2 * per), (len(tile), n, per)
    for u0 in range(0, n, per):
        k = min(per, n - u0)
        o = int(rng.integers(0, len(tile) - k + 1))
        yield tile[o: o + k]


def nbytes(shape: tuple[int, ...], gt: GT) -> int:
    return tensor_nbytes(int(gt), tuple(shape))


def add_tokenizer(w: GGUFWriter, n_vocab: int, chat_template: str = "default") -> None:
    """A byte-level BPE of `n_vocab` tokens trained on CORPUS, Qwen-style specials, the chat template (by name:
    gguf/templates.py)."""
    from betelgeuse.gguf.templates import chat_template as template_named
    from betelgeuse.gguf.vocab import train_vocab
    v = train_vocab(CORPUS, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    w.add_token_merges(v.merges)
    w.add_bos_token_id(v.endoftext_id)
    w.add_eos_token_id(v.im_end_id)
    w.add_pad_token_id(v.endoftext_id)
    w.add_add_bos_token(False)
    w.add_chat_template(template_named(chat_template))


# Tokenizer training text: a few paragraphs of plain English plus some non-ASCII, so that the
# vocabulary has real word pieces and multi-byte characters span several tokens.
CORPUS = [
    "The river ran low that summer, and the people of the valley walked out onto the dry stones to "
    "look for things the water had kept. They found coins, a bicycle, a blue bottle with a letter in "
    "it, and the old iron bell that had fallen from the chapel tower in the great storm of 1911.",
    "A mixture of experts is a neural network in which a small router chooses, for every token, a few "
    "experts out of many. Each expert is a feed-forward network. Only the chosen experts run, so the "
    "model can be very large while each token costs little. The hard part is memory: the experts must "
    "be somewhere, and moving them from the disk to the GPU takes time.",
    "She opened the window, counted the boats in the harbour (there were twelve, and one of them was "
    "red), and wrote the number in her notebook next to yesterday's: eleven. Tomorrow, she thought, "
    "there would be thirteen. There were never fewer, only more, as if the sea were making them.",
    "To build the project, run the tests first. If a test fails, read the message; it names the file "
    "and the line. Don't guess! Measure the time it takes, write it down, and compare it with the "
    "number you expected. A result you cannot repeat is not a result.",
    "In the morning the market was full of voices: fishermen selling what they had caught, children "
    "running between the stalls, an old man playing the violin for anyone who would listen. Bread, "
    "cheese, apples, onions, honey and salt were piled high on the wooden tables.",
    "Numbers matter: 3 apples, 14 pears, 159 cherries, 2653 grapes, 58979 seeds; 3.14159, 2.71828, "
    "1,000,000 and 0.001. Dates like 2024-06-01 and times like 12:30 appear everywhere in text.",
    "Questions and answers. What is the capital of France? Paris. What is two plus two? Four. Who wrote "
    "this? We did. Why is the sky blue? Because the air scatters blue light more than red light.",
    "Café, naïve, façade, über, señor, smörgåsbord. Здравствуйте, мир. こんにちは世界。你好，世界。"
    "Γειά σου κόσμε. مرحبا بالعالم. 🙂 🚀 ✨ — “quoted” ‘text’ … ½ ° € £ ¥.",
    "def route(tokens, experts, k=8):\n    scores = router(tokens)\n    top = scores.topk(k)\n"
    "    return [experts[i] for i in top.indices]\n\nfor layer in range(48):\n    x = layer(x)\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How "
    "vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.",
]

def write_gguf(path: str | os.PathLike, arch: str, plan, add_metadata: Callable[[GGUFWriter], None],
               progress: bool = True) -> None:
    """The streaming writer shared by every architecture: `plan` lists (name, torch shape, type, chunk
    generator) in file order; `add_metadata(writer)` adds the key/value pairs."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, arch)
    add_metadata(w)
    for name, shape, gt, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, gt), raw_dtype=gt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    total = sum(nbytes(shape, gt) for _, shape, gt, _ in plan)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {path.name}")
    # Generation (numpy, main thread) overlaps with the write (GIL released) in a writer thread.
    q: queue.Queue = queue.Queue(maxsize=4)
    err: list[BaseException] = []

    def writer() -> None:
        while (buf := q.get()) is not None:
            try:
                if not err:
                    fout.write(memoryview(buf).cast("B"))
            except BaseException as e:  # surfaced in the main thread
                err.append(e)

    t = threading.Thread(target=writer, name="synth-writer", daemon=True)
    t.start()
    try:
        for name, shape, gt, gen in plan:
            n = 0
            for chunk in gen():
                chunk = np.ascontiguousarray(chunk)
                n += chunk.nbytes
                q.put(chunk)
                if bar is not None:
                    bar.update(chunk.nbytes)
                if err:
                    raise err[0]
            assert n == nbytes(shape, gt), (name, n, nbytes(shape, gt))
            pad = GGUFWriter.ggml_pad(n, w.data_alignment) - n
            if pad:
                q.put(np.zeros(pad, np.uint8))
    finally:
        q.put(None)
        t.join()
        if bar is not None:
            bar.close()
    if err:
        w.close()
        raise err[0]
    w.close()
    os.replace(tmp, path)
