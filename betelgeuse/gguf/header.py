"""A fast GGUF header parser: key/value metadata, tensor table, alignment, data offset.

gguf-py's `GGUFReader` builds a few numpy views per metadata value; with a Qwen-sized vocabulary
(151,936 tokens + ~150k merges) that is ~10 s per open, and the store, the worker and the CLI all
open the model. Here strings are decoded by one tight loop over the mapped bytes and numeric arrays
come from a single `numpy.frombuffer`, so the same header parses in well under a second.

Layout (GGUF v2/v3, little-endian; all counts and string lengths are u64):
  "GGUF" | u32 version | u64 n_tensors | u64 n_kv
  n_kv x       (string key | u32 value type | value)
  n_tensors x  (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset)
  padding to `general.alignment` (default 32) -> data_offset; tensor offsets are relative to it.
  value: scalar | string (u64 len + utf-8 bytes) | array (u32 elem type | u64 count | elems),
  arrays may nest (each element then carries its own elem type and count).

Values come out as plain python objects, like `ReaderField.contents()`: int/float/bool/str, and
lists of those (nested arrays -> nested lists). Strings that are not valid UTF-8 (byte-level
vocabularies may hold such tokens) decode with U+FFFD replacements.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from betelgeuse.errors import ModelFormatError, UnsupportedError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                      # GGML_MAX_DIMS

# GGUFValueType -> struct format of a scalar / numpy dtype of an array element (little-endian).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: struct.Struct("<B"), INT8: struct.Struct("<b"), UINT16: struct.Struct("<H"),
           INT16: struct.Struct("<h"), UINT32: struct.Struct("<I"), INT32: struct.Struct("<i"),
           FLOAT32: struct.Struct("<f"), BOOL: struct.Struct("<?"), UINT64: struct.Struct("<Q"),
           INT64: struct.Struct("<q"), FLOAT64: struct.Struct("<d")}
_NP = {UINT8: np.dtype("<u1"), INT8: np.dtype("<i1"), UINT16: np.dtype("<u2"), INT16: np.dtype("<i2"),
       UINT32: np.dtype("<u4"), INT32: np.dtype("<i4"), FLOAT32: np.dtype("<f4"), BOOL: np.dtype("?"),
       UINT64: np.dtype("<u8"), INT64: np.dtype("<i8"), FLOAT64: np.dtype("<f8")}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")         # elem type, count
_PREAMBLE = struct.Struct("<4sIQQ")        # magic, version, n_tensors, n_kv: 24 bytes


@dataclass(slots=True, frozen=True)
class TensorEntry:
    name: str
    qtype: int                 # raw ggml type value (may be one gguf does not know: checked by the caller)
    ne: tuple[int, ...]        # GGML order as stored: ne[0] is the row length (torch shape = reversed)
    offset: int                # absolute file offset of the first byte (data_offset + relative offset)


@dataclass(slots=True)
class GGUFHeader:
    version: int
    metadata: dict[str, object]          # key -> python value, in file order
    value_types: dict[str, tuple[int, ...]]  # key -> (type,) or (ARRAY, elem type, ...) as GGUFValueType ints
    tensors: list[TensorEntry]           # in file order
    alignment: int                       # bytes
    data_offset: int                     # absolute offset of the tensor data region
    file_size: int                       # bytes of the buffer parsed


class _Truncated(Exception):
    """The header runs past the end of the buffer (internal; becomes a ModelFormatError)."""


class _Corrupt(Exception):
    """A header field holds an impossible value (internal; becomes a ModelFormatError)."""


def _strings(buf, pos: int, n: int, end: int) -> tuple[list[str], int]:
    """n consecutive GGUF strings from buf[pos:]: the hot loop (150k tokens, 150k merges)."""
    if n * 8 > end - pos:
        raise _Truncated
    unpack = _U64.unpack_from
    out = [""] * n
    for i in range(n):
        (ln,) = unpack(buf, pos)
        pos += 8
        stop = pos + ln
        if stop > end:
            raise _Truncated
        out[i] = buf[pos:stop].decode("utf-8", "replace")
        pos = stop
    return out, pos


def _value(buf, pos: int, t: int, end: int, types: list[int]) -> tuple[object, int]:
    """One value of type t at buf[pos:] -> (python value, position after it); appends the
    element types of arrays to `types` (the first element's, as GGUFReader does)."""
    if t == STRING:
        (ln,) = _U64.unpack_from(buf, pos)
        stop = pos + 8 + ln
        if stop > end:
            raise _Truncated
        return buf[pos + 8:stop].decode("utf-8", "replace"), stop
    s = _SCALAR.get(t)
    if s is not None:
        return s.unpack_from(buf, pos)[0], pos + s.size
    if t != ARRAY:
        raise _Corrupt(f"unknown metadata value type {t}")
    et, n = _ARRAY_HEAD.unpack_from(buf, pos)
    pos += _ARRAY_HEAD.size
    types.append(et)
    dt = _NP.get(et)
    if dt is not None:
        if n * dt.itemsize > end - pos:
            raise _Truncated
        a = np.frombuffer(buf, dtype=dt, count=n, offset=pos)
        return a.tolist(), pos + a.nbytes
    if et == STRING:
        return _strings(buf, pos, n, end)
    if et != ARRAY:
        raise _Corrupt(f"unknown array element type {et}")
    if n * _ARRAY_HEAD.size > end - pos:   # every nested array takes at least its 12-byte head
        raise _Truncated
    out = []
    for i in range(n):
        v, pos = _value(buf, pos, ARRAY, end, types if i == 0 else [])
        out.append(v)
    return out, pos


def _name(buf, pos: int, end: int, what: str) -> tuple[str, int]:
    (ln,) = _U64.unpack_from(buf, pos)
    stop = pos + 8 + ln
    if stop > end:
        raise _Truncated
    try:
        return bytes(buf[pos + 8:stop]).decode("utf-8"), stop
    except UnicodeDecodeError:
        raise _Corrupt(f"{what} at byte {pos} is not UTF-8") from None


def parse_header(buf, where: str) -> GGUFHeader:
    """Parse the GGUF header at the start of `buf` (bytes or a read-only mmap.mmap: anything whose
    slices are bytes). `where` names the file in error messages."""
    end = len(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFormatError(f"{where}: not a GGUF file (starts with {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    if end < _PREAMBLE.size:
        raise ModelFormatError(f"{where}: truncated GGUF header ({end} bytes)")
    _, version, n_tensors, n_kv = _PREAMBLE.unpack_from(buf, 0)
    if version & 0xFFFF == 0 and version:
        raise UnsupportedError(f"{where}: big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedError(f"{where}: GGUF version {version} is not supported (supported: 2, 3)")
    pos = _PREAMBLE.size
    metadata: dict[str, object] = {}
    value_types: dict[str, tuple[int, ...]] = {}
    try:
        # every key/value takes >= 8 + 4 bytes, every tensor info >= 8 + 4 + 4 + 8: a corrupt count
        # fails here instead of looping over the whole file
        if n_kv * 12 + n_tensors * 24 > end - pos:
            raise _Truncated
        for _ in range(n_kv):
            key, pos = _name(buf, pos, end, "metadata key")
            (t,) = _U32.unpack_from(buf, pos)
            types = [t]
            try:
                val, pos = _value(buf, pos + 4, t, end, types)
            except _Corrupt as e:
                raise _Corrupt(f"key {key!r}: {e}") from None
            if key in metadata:
                raise _Corrupt(f"duplicate metadata key {key!r}")
            metadata[key], value_types[key] = val, tuple(types)
        rel: list[tuple[str, int, tuple[int, ...], int]] = []
        seen: set[str] = set()
        for _ in range(n_tensors):
            name, pos = _name(buf, pos, end, "tensor name")
            (n_dims,) = _U32.unpack_from(buf, pos)
            if n_dims > MAX_DIMS:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, off = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            if name in seen:
                raise _Corrupt(f"duplicate tensor name {name!r}")
            seen.add(name)
            rel.append((name, qtype, ne, off))
    except (_Truncated, struct.error):
        raise ModelFormatError(f"{where}: truncated GGUF header: it runs past the end of the file "
                               f"({end} bytes)") from None
    except _Corrupt as e:
        raise ModelFormatError(f"{where}: corrupt GGUF header: {e}") from None

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if value_types["general.alignment"] != (UINT32,):
            raise ModelFormatError(f"{where}: corrupt GGUF header: general.alignment should be a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise ModelFormatError(f"{where}: corrupt GGUF header: general.alignment {alignment} is not a power of two")
    data_offset = -(-pos // alignment) * alignment
    tensors = [TensorEntry(name, qtype, ne, data_offset + off) for name, qtype, ne, off in rel]
    return GGUFHeader(version=version, metadata=metadata, value_types=value_types, tensors=tensors,
                      alignment=alignment, data_offset=data_offset, file_size=end)


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse the header of the file at `path` (mapped read-only; only the header pages are read)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return parse_header(b"", path)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return parse_header(m, path)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot open: {e.strerror}") from None
