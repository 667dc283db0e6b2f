"""A validated, memory-mapped view of a GGUF model file: config, tensor index, expert byte ranges.

`GGUFModelFile.open` maps the file read-only and parses its header with our own parser
(`header.py`: gguf-py's GGUFReader takes ~10 s on a 151k-token vocabulary), so opening a 30 GB
model reads only its header pages; then it checks everything a forward pass will rely on, so that a
bad file fails at start-up with one line naming the problem instead of deep inside a pass.

Expert tensors are llama.cpp's merged `blk.N.ffn_{gate,up,down}_exps.weight`: torch shape
(n_expert, rows, cols) with the expert index outermost, so expert e is the contiguous byte range
`offset + e * nbytes / n_expert` of the file. The fused `ffn_gate_up_exps` (gate rows first, then
up rows, per expert) is split into two sub-ranges of that range; rows are quantized independently,
so half the rows are exactly half the bytes.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf.header import GGUF_MAGIC, GGUFHeader, TensorEntry, parse_header
from betelgeuse.gguf.layouts import OUTPUT, OUTPUT_NORM, TOKEN_EMBD, Layout, blk, check_arch
from betelgeuse.gguf.modelconfig import ModelConfig, get_int
from betelgeuse.gguf.qtypes import SUPPORTED_QTYPES, block_size, qtype_name, tensor_nbytes

QT_I32 = 26                    # GGMLQuantizationType.I32


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    qtype: int                 # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]     # torch order = reversed GGML ne; ffn_gate_exps -> (n_expert, n_ff, n_embd)
    offset: int                # absolute file offset of the first byte
    nbytes: int


@dataclass(slots=True, frozen=True)
class ExpertPart:              # one matrix of one expert: a contiguous byte range of the file
    kind: str                  # "gate" | "up" | "down"
    offset: int                # absolute file offset, bytes
    nbytes: int
    qtype: int
    shape: tuple[int, int]     # torch order: gate/up (n_ff, n_embd), down (n_embd, n_ff)


def _tensor_table(path: str, entries: list[TensorEntry], size: int) -> list[TensorInfo]:
    """The parsed tensor table checked against the file: every type known to GGML, every tensor's
    bytes inside the file (the first one past the end is named, as a truncated download would)."""
    out = []
    for e in entries:
        shape = tuple(reversed(e.ne))            # torch order
        try:
            blk_elems, blk_bytes = block_size(e.qtype)
        except UnsupportedError:
            raise ModelFormatError(f"{path}: corrupt GGUF file: tensor {e.name!r} has type {qtype_name(e.qtype)} "
                                   f"and shape {list(shape)}") from None
        nbytes = math.prod(shape) * blk_bytes // blk_elems
        if e.offset + nbytes > size:
            raise ModelFormatError(f"{path}: truncated: tensor {e.name!r} ends at byte {e.offset + nbytes} "
                                   f"but the file has {size} bytes")
        out.append(TensorInfo(name=e.name, qtype=e.qtype, shape=shape, offset=e.offset, nbytes=nbytes))
    return out


class GGUFModelFile:
    """An open model file. Build with `GGUFModelFile.open(path)`; `close()` (or `with`) releases the map."""

    path: str
    config: ModelConfig
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]

    def __init__(self, path: str, data: np.ndarray, header: GGUFHeader, tensors: dict[str, TensorInfo],
                 config: ModelConfig):
        self.path = path
        self.metadata = header.metadata
        self.tensors = tensors
        self.config = config
        self.alignment = header.alignment       # bytes; every tensor offset is data_offset + k * alignment
        self.data_offset = header.data_offset   # absolute file offset of the tensor data region
        self._map: np.ndarray | None = data     # uint8 [file size]: read-only view of the file map
        self._mm: mmap.mmap | None = None       # the map itself (for madvise)
        # Per layer: (gate, up, down) as (tensor, first row, n_rows) of the merged tensor.
        self._experts: list[tuple[tuple[TensorInfo, int, int], ...]] = []
        n_ff = config.n_ff_exp
        for i in range(config.n_layer):
            down = (tensors[blk(i, "ffn_down_exps")], 0, config.n_embd)
            if blk(i, "ffn_gate_up_exps") in tensors:
                fused = tensors[blk(i, "ffn_gate_up_exps")]
                self._experts.append(((fused, 0, n_ff), (fused, n_ff, n_ff), down))
            else:
                self._experts.append(((tensors[blk(i, "ffn_gate_exps")], 0, n_ff),
                                      (tensors[blk(i, "ffn_up_exps")], 0, n_ff), down))

    # ---- opening and validation -------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFModelFile":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ModelFormatError(f"{path}: no such file")
        if not os.path.isfile(path):
            raise ModelFormatError(f"{path}: not a regular file")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
                if magic != GGUF_MAGIC:
                    raise ModelFormatError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the close
                # no kernel read-ahead around page faults: it would pull neighbouring expert bytes into the
                # page cache (invariant 4); raw() asks for exactly each tensor's range instead
                mm.madvise(mmap.MADV_RANDOM)
        except OSError as e:
            raise ModelFormatError(f"{path}: cannot read: {e.strerror}") from None
        header = parse_header(mm, path)
        table = _tensor_table(path, header.tensors, size)
        layout = check_arch(header.metadata, path)  # an unknown architecture is named before its tensors

        tensors: dict[str, TensorInfo] = {}
        for info in table:
            if info.qtype not in SUPPORTED_QTYPES:
                raise UnsupportedError(
                    f"{path}: tensor {info.name!r} has type {qtype_name(info.qtype)}, which is not supported "
                    f"(supported: {', '.join(sorted(qtype_name(q) for q in SUPPORTED_QTYPES))})")
            blk_elems, _ = block_size(info.qtype)
            if not info.shape or info.shape[-1] % blk_elems:
                raise ModelFormatError(f"{path}: tensor {info.name!r} rows of {info.shape[-1:]} elements are not "
                                       f"a multiple of the {qtype_name(info.qtype)} block ({blk_elems})")
            assert info.nbytes == tensor_nbytes(info.qtype, info.shape)
            tensors[info.name] = info

        config = cls._config(path, layout, header.metadata, tensors)
        cls._check_tensors(path, layout, config, tensors)
        # read-only buffer -> read-only array; views keep the map alive after close()
        f = cls(path, np.frombuffer(mm, dtype=np.uint8), header, tensors, config)
        f._mm = mm
        return f

    @staticmethod
    def _config(path: str, layout: Layout, metadata: dict[str, object], tensors: dict[str, TensorInfo]) -> ModelConfig:
        """Check every required tensor is present, then read the config (shape facts from layer 0)."""
        n_layer = get_int(metadata, f"{layout.arch}.block_count", path)

        def need(name: str) -> TensorInfo:
            if name not in tensors:
                raise ModelFormatError(f"{path}: required tensor {name!r} is missing")
            return tensors[name]

        embd = need(TOKEN_EMBD)
        need(OUTPUT_NORM)
        for i in range(n_layer):
            for t in layout.required:
                need(blk(i, t))
            if blk(i, "ffn_gate_up_exps") in tensors:
                if blk(i, "ffn_gate_exps") in tensors or blk(i, "ffn_up_exps") in tensors:
                    raise ModelFormatError(f"{path}: layer {i} has both fused ffn_gate_up_exps and separate gate/up experts")
            else:
                need(blk(i, "ffn_gate_exps"))
                need(blk(i, "ffn_up_exps"))
        if len(embd.shape) != 2:
            raise ModelFormatError(f"{path}: tensor {TOKEN_EMBD!r} should be 2-D, got shape {list(embd.shape)}")
        if n_layer <= 0:
            raise ModelFormatError(f"{path}: block_count must be positive, got {n_layer}")
        if blk(0, "ffn_gate_up_exps") in tensors:
            g = tensors[blk(0, "ffn_gate_up_exps")]
            n_ff = g.shape[1] // 2 if len(g.shape) == 3 else None
        else:
            g = tensors[blk(0, "ffn_gate_exps")]
            n_ff = g.shape[1] if len(g.shape) == 3 else None
        if len(g.shape) != 3:
            raise ModelFormatError(f"{path}: tensor {g.name!r} should be 3-D (n_expert, n_ff, n_embd), got {list(g.shape)}")
        return layout.config(metadata, where=path, stem=Path(path).stem, n_vocab=embd.shape[0],
                             n_expert=g.shape[0], n_ff_exp=n_ff, shapes={n: t.shape for n, t in tensors.items()})

    @staticmethod
    def _check_tensors(path: str, layout: Layout, c: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
        """Every tensor of the architecture's layout is present, has its shape and (I32 or float) its kind of type."""
        for name, shape in layout.tensors(c, tensors):
            if name not in tensors:
                raise ModelFormatError(f"{path}: required tensor {name!r} is missing")
            got = tensors[name].shape
            if got != shape:
                raise ModelFormatError(f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                                       f"from the metadata (torch order)")
            want_int = layout.is_int(name)
            if want_int != (tensors[name].qtype == QT_I32):
                raise ModelFormatError(f"{path}: tensor {name!r} has type {qtype_name(tensors[name].qtype)}, "
                                       f"expected {'I32' if want_int else 'a float type'}")

    # ---- access -----------------------------------------------------------------------------

    @property
    def tied_output(self) -> bool:
        """True when the file has no output.weight and the LM head reuses token_embd."""
        return OUTPUT not in self.tensors

    def info(self, name: str) -> TensorInfo:
        """The TensorInfo of `name`; output.weight falls back to token_embd when tied."""
        if name == OUTPUT and self.tied_output:
            name = TOKEN_EMBD
        if name not in self.tensors:
            raise ModelFormatError(f"{self.path}: no tensor named {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """uint8 [nbytes]: the stored bytes of tensor `name`, a read-only view of the file map."""
        info = self.info(name)
        if self._map is None:
            raise ValueError(f"{self.path}: file is closed")
        lo = info.offset - info.offset % mmap.PAGESIZE
        self._mm.madvise(mmap.MADV_WILLNEED, lo, info.offset + info.nbytes - lo)   # read this tensor, nothing else
        return self._map[info.offset:info.offset + info.nbytes]

    def load_tensor(self, name: str, device: "str | torch.device" = "cpu", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """Tensor `name` dequantized on `device` to `dtype`, shape = info.shape (a fresh tensor).
        The quantized bytes are copied to `device` first, so the dequantization runs there."""
        import torch                                     # lazily: the store process never dequantizes
        from betelgeuse.gguf.quants import dequantize
        dtype = torch.float32 if dtype is None else dtype
        info = self.info(name)
        raw = torch.from_numpy(np.array(self.raw(name)))  # copy: the map is read-only
        return dequantize(raw.to(device), info.qtype, info.shape, dtype)

    def expert_parts(self, layer: int, expert: int) -> tuple[ExpertPart, ExpertPart, ExpertPart]:
        """(gate, up, down) byte ranges of one expert of one layer."""
        c = self.config
        if not (0 <= layer < c.n_layer and 0 <= expert < c.n_expert):
            raise IndexError(f"expert ({layer}, {expert}) out of range: {c.n_layer} layers x {c.n_expert} experts")
        parts = []
        for kind, (t, row0, rows) in zip(("gate", "up", "down"), self._experts[layer]):
            per_expert = t.nbytes // c.n_expert         # bytes of one expert's slice of the merged tensor
            per_row = per_expert // t.shape[1]           # bytes of one row
            assert per_expert * c.n_expert == t.nbytes and per_row * t.shape[1] == per_expert
            parts.append(ExpertPart(kind=kind, offset=t.offset + expert * per_expert + row0 * per_row,
                                    nbytes=rows * per_row, qtype=t.qtype, shape=(rows, t.shape[2])))
        return parts[0], parts[1], parts[2]

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of `layer` (gate + up + down); the same for every expert of a layer."""
        return sum(p.nbytes for p in self.expert_parts(layer, 0))

    def close(self) -> None:
        """Drop the file map (views handed out by raw() keep it alive until they are freed)."""
        self._map = None
        self._mm = None

    def __enter__(self) -> "GGUFModelFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"GGUFModelFile({self.path!r}, {c.arch}, {c.n_layer} layers, {c.n_expert} experts "
                f"top-{c.n_expert_used}, {len(self.tensors)} tensors)")
