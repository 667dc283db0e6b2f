"""Our GGUF header parser against gguf-py's GGUFReader (the independent reference) on synth files,
a hand-written file with every value type, and broken headers.

The big-vocabulary files are sparse: the real header (bench geometry, 151,936 tokens) followed by
a hole as long as the tensor data, so GGUFReader can map every tensor without writing 1.3 GB.
"""

import os
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf import GGUFModelFile, synth, synth_common
from betelgeuse.gguf.header import parse_header, read_header

QWEN_MERGES = 151387   # merges in Qwen3's tokenizer


def reference(path):
    """What GGUFReader says: (metadata, value types, [(name, qtype, ne, offset)], alignment, data_offset)."""
    r = gguf.GGUFReader(path)
    md, types = {}, {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            md[k] = f.contents()
        except UnicodeDecodeError:  # invalid UTF-8 -> U+FFFD, as reader.py always did
            md[k] = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data] \
                if f.types[0] == gguf.GGUFValueType.ARRAY else bytes(f.parts[-1]).decode("utf-8", "replace")
        types[k] = tuple(int(t) for t in f.types)
    tensors = [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape.tolist()), int(t.data_offset))
               for t in r.tensors]
    return md, types, tensors, int(r.alignment), int(r.data_offset)


def assert_same(path, nested=()):
    """Our header == GGUFReader's, value for value, type for type (python types too)."""
    h = read_header(path)
    md, types, tensors, alignment, data_offset = reference(path)
    assert list(h.metadata) == list(md)
    for k, want in md.items():
        got = h.metadata[k]
        if k in nested:   # GGUFReader flattens nested arrays (its FIXME); we keep the nesting
            got = [x for sub in got for x in sub]
        assert got == want, k
        assert [type(x) for x in (got if isinstance(got, list) else [got])] == \
               [type(x) for x in (want if isinstance(want, list) else [want])], k
        assert h.value_types[k] == types[k], k
    assert [(t.name, t.qtype, t.ne, t.offset) for t in h.tensors] == tensors
    assert (h.alignment, h.data_offset, h.file_size) == (alignment, data_offset, os.path.getsize(path))
    return h


def write_sparse(path, spec, extra_strings=0):
    """The header synth.write_model writes for `spec`, then a hole for the tensor data."""
    plan = synth.tensor_plan(spec)
    w = gguf.GGUFWriter(str(path), synth.ARCH)
    synth._add_metadata(w, spec)
    if extra_strings:   # Qwen-sized merges (synth's tiny corpus only yields a few hundred)
        w.add_array("test.merges", [f"\u0120t{i % 977} x{i}" for i in range(extra_strings)])
    for name, shape, gt, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), synth_common.nbytes(shape, gt), raw_dtype=gt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    end = w.fout[0].tell()
    w.close()
    data = gguf.GGUFWriter.ggml_pad(end, gguf.GGUF_DEFAULT_ALIGNMENT)
    os.truncate(path, data + sum(gguf.GGUFWriter.ggml_pad(synth_common.nbytes(s, g), gguf.GGUF_DEFAULT_ALIGNMENT)
                                 for _, s, g, _ in plan))


def test_tiny_preset(tmp_path):
    p = tmp_path / "tiny.gguf"
    synth.write_model(p, synth.PRESETS["tiny"], progress=False)
    h = assert_same(p)
    assert len(h.metadata["tokenizer.ggml.tokens"]) == 1024 and h.metadata["tokenizer.ggml.merges"]
    with GGUFModelFile.open(p) as m:
        assert m.metadata == h.metadata and m.data_offset == h.data_offset
        assert [(i.name, i.offset) for i in m.tensors.values()] == [(t.name, t.offset) for t in h.tensors]


def test_bench_vocab_matches_and_is_fast(tmp_path):
    p = tmp_path / "bench-1L.gguf"
    write_sparse(p, synth.spec_from_preset("bench", n_layer=1))
    t0 = time.perf_counter()
    h = read_header(p)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert_same(p)
    ref = time.perf_counter() - t0
    assert len(h.metadata["tokenizer.ggml.tokens"]) == 151936
    t0 = time.perf_counter()
    with GGUFModelFile.open(p) as m:
        opened = time.perf_counter() - t0
        assert m.config.n_vocab == 151936 and m.config.n_layer == 1
    print(f"\n151936-token header: ours {ours:.2f} s, GGUFModelFile.open {opened:.2f} s, "
          f"GGUFReader + contents() {ref:.2f} s")
    assert opened < 3.0


def test_qwen_sized_vocab_and_merges_open_fast(tmp_path):
    p = tmp_path / "bench-qwen.gguf"
    write_sparse(p, synth.spec_from_preset("bench", n_layer=2), extra_strings=QWEN_MERGES)
    t0 = time.perf_counter()
    with GGUFModelFile.open(p) as m:
        opened = time.perf_counter() - t0
        merges = m.metadata["test.merges"]
        assert len(merges) == QWEN_MERGES and merges[-1] == f"\u0120t{(QWEN_MERGES - 1) % 977} x{QWEN_MERGES - 1}"
    print(f"\n151936 tokens + {QWEN_MERGES} merges: GGUFModelFile.open {opened:.2f} s")
    assert opened < 3.0


def write_all_types(path):
    """Every value type, nested arrays, a custom alignment, strings that are not valid UTF-8."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2 ** 64 - 1)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo 🙂")
    w.add_array("t.strs", ["a", "", "é", "@@BAD1@@", "<0xFF>"])
    w.add_array("t.ints", [3, -1, 2])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    w.add_key_value("t.u8s", [1, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_key_value("t.f64s", [0.1, 1e300], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.zeros((2, 3, 5), dtype=np.float16))
    w.add_tensor("c", gguf.quants.quantize(np.ones((1, 64), np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    i = data.index(b"@@BAD1@@")
    data[i:i + 8] = b"\xff\xfeok\xc3(\xe2\x82"   # invalid UTF-8, same length
    path.write_bytes(bytes(data))


def test_every_value_type(tmp_path):
    p = tmp_path / "types.gguf"
    write_all_types(p)
    h = assert_same(p, nested={"t.nested"})
    md = h.metadata
    assert md["t.nested"] == [[1, 2], [3, 4, 5]] and h.value_types["t.nested"] == (9, 9, 5)  # array of arrays of int32
    assert md["t.u64"] == 2 ** 64 - 1 and md["t.i8"] == -100 and md["t.f64"] == 0.1
    assert md["t.f32"] == float(np.float32(0.1)) and md["t.true"] is True and md["t.false"] is False
    assert md["t.str"] == "héllo 🙂"
    assert md["t.strs"] == ["a", "", "é", "\ufffd\ufffdok\ufffd(\ufffd", "<0xFF>"]
    assert h.alignment == 64 and h.data_offset % 64 == 0
    assert [(t.name, t.qtype, t.ne) for t in h.tensors] == [("a", 0, (3, 2)), ("b", 1, (5, 3, 2)), ("c", 8, (64, 1))]
    raw = p.read_bytes()
    assert np.array_equal(np.frombuffer(raw, np.float32, 6, h.tensors[0].offset), np.arange(6))


# ---- broken headers: one line naming the file and the problem ---------------------------------

def header_bytes(tmp_path):
    p = tmp_path / "types.gguf"
    write_all_types(p)
    raw = p.read_bytes()
    return raw, read_header(p).data_offset


def test_truncated_anywhere_in_the_header(tmp_path):
    raw, data_offset = header_bytes(tmp_path)
    for cut in list(range(4, 64)) + list(range(64, data_offset - 32, 7)):
        with pytest.raises(ModelFormatError, match="^x.gguf: truncated GGUF header") as ei:
            parse_header(raw[:cut], "x.gguf")
        assert "\n" not in str(ei.value)


def test_bad_magic_version_and_values(tmp_path):
    raw, _ = header_bytes(tmp_path)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        parse_header(b"GGML" + raw[4:], "x.gguf")
    with pytest.raises(UnsupportedError, match="GGUF version 1 is not supported"):
        parse_header(raw[:4] + (1).to_bytes(4, "little") + raw[8:], "x.gguf")
    with pytest.raises(UnsupportedError, match="big-endian"):
        parse_header(raw[:4] + (3).to_bytes(4, "big") + raw[8:], "x.gguf")
    # the type of the first key (general.architecture, a string) -> 77
    i = raw.index(b"general.architecture") + len(b"general.architecture")
    with pytest.raises(ModelFormatError, match="corrupt GGUF header: key 'general.architecture': unknown metadata value type 77"):
        parse_header(raw[:i] + (77).to_bytes(4, "little") + raw[i + 4:], "x.gguf")
    # a second key renamed to the first one's name
    with pytest.raises(ModelFormatError, match="duplicate metadata key 't.u8'"):
        parse_header(raw.replace(b"t.i8", b"t.u8", 1), "x.gguf")
    with pytest.raises(ModelFormatError, match="duplicate tensor name 'a'"):
        parse_header(raw.replace(b"\x01\x00\x00\x00\x00\x00\x00\x00b\x03\x00\x00\x00",
                                 b"\x01\x00\x00\x00\x00\x00\x00\x00a\x03\x00\x00\x00", 1), "x.gguf")
    # a count that promises more keys than the file could hold
    with pytest.raises(ModelFormatError, match="truncated GGUF header"):
        parse_header(raw[:16] + (2 ** 40).to_bytes(8, "little") + raw[24:], "x.gguf")


def test_model_file_errors_name_the_file(tmp_path):
    raw, data_offset = header_bytes(tmp_path)
    p = tmp_path / "cut.gguf"
    p.write_bytes(raw[:data_offset - 40])
    with pytest.raises(ModelFormatError, match=f"^{p}: truncated GGUF header"):
        GGUFModelFile.open(p)
    p.write_bytes(raw[:4] + (1).to_bytes(4, "little") + raw[8:])
    with pytest.raises(UnsupportedError, match=f"^{p}: GGUF version 1"):
        GGUFModelFile.open(p)
