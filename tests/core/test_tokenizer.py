"""Tokenizer from GGUF metadata, checked against Hugging Face transformers' GGUF tokenizer and gguf's reader."""

from dataclasses import replace

import pytest
from gguf import GGUFReader

from betelgeuse.errors import InvalidRequestError, ModelFormatError, UnsupportedError
from betelgeuse.gguf.synth import PRESETS, write_model
from betelgeuse.tokenizer import IncrementalDecoder, Tokenizer, read_metadata

TEXTS = [
    "Hello world!",
    "The river ran low that summer, and the people of the valley walked out.",
    "don't  stop\n\n  believing -- it's 12345 or 3.14159?\tTabs\r\nand CRLF",
    "Café naïve façade über señor, Здравствуйте мир, こんにちは世界, 你好，世界 🙂🚀✨ “quoted”",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
    "unseen wordz like xylophonic qwertyuiop and     many   spaces   ",
    "",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_model(p, PRESETS["tiny"], progress=False)
    return p


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_file(model)


def test_read_metadata_matches_gguf_reader(model):
    md = read_metadata(model)
    fields = {k: f.contents() for k, f in GGUFReader(model).fields.items() if not k.startswith("GGUF.")}
    assert md.keys() == fields.keys()
    for k, v in fields.items():
        assert md[k] == (pytest.approx(v) if isinstance(v, float) else v), k


def test_read_metadata_errors(tmp_path, model):
    with pytest.raises(ModelFormatError, match="cannot open"):
        read_metadata(tmp_path / "missing.gguf")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        read_metadata(tmp_path / "x.gguf")
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        read_metadata(tmp_path / "e.gguf")
    (tmp_path / "t.gguf").write_bytes(model.read_bytes()[:5000])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_metadata(tmp_path / "t.gguf")


def test_round_trip(tok):
    for t in TEXTS:
        ids = tok.encode(t)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert tok.decode(ids, skip_special=False) == t
    assert tok.decode(tok.encode(TEXTS[4])) == "user\nWhat is two plus two?\nassistant\n"
    assert len(tok.encode(" the the the the")) == 4         # learned merges are used
    assert tok.n_vocab == PRESETS["tiny"].n_vocab


def test_matches_transformers(model, tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    for t in TEXTS:
        assert tok.encode(t) == ref.encode(t, add_special_tokens=False), t
        ids = tok.encode(t)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), t
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    for gen in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)


def test_special_ids(tok):
    im_end, eot = tok.encode("<|im_end|>"), tok.encode("<|endoftext|>")
    assert len(im_end) == 1 and len(eot) == 1
    assert tok.eos_id == im_end[0] and tok.eos_ids == {im_end[0], eot[0]}
    assert tok.bos_id == eot[0]
    assert tok.encode("hi", add_special=True) == tok.encode("hi")  # add_bos_token is false (Qwen)
    assert tok.id_to_piece(im_end[0]) == "<|im_end|>"
    assert tok.id_to_piece(tok.encode(" the")[0]) == " the"
    with pytest.raises(InvalidRequestError, match="out of range"):
        tok.decode([tok.n_vocab])


def test_incremental_decoder_multibyte(tok):
    text = "Hi 你好世界 🙂🚀 Здравствуйте, naïve ½!"
    ids = tok.encode(text)
    # some characters really are split across tokens (byte-level pieces alone are not valid UTF-8)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == text
    assert "" in pieces                                        # something was held back


def test_incremental_decoder_flush_incomplete(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1
    dec = IncrementalDecoder(tok)
    assert dec.push(ids[0]) == ""
    assert dec.flush() == "\ufffd"


def test_chat_template(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(out)[0] == tok.encode("<|im_start|>")[0]
    with pytest.raises(InvalidRequestError, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="messages"):
        tok.apply_chat_template([{"role": "user"}])


def test_template_features(model):
    md = read_metadata(model)
    md["tokenizer.chat_template"] = (
        "{% for m in messages %}\n  {{ m['content'] | tojson }}\n{% endfor %}{{ bos_token }}")
    t = Tokenizer.from_metadata(md)
    assert t.apply_chat_template([{"role": "user", "content": "é\"x"}]) == '  "é\\"x"\n<|endoftext|>'
    del md["tokenizer.chat_template"]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_metadata(md).apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_model_type(model):
    md = read_metadata(model)
    for kind in ("llama", "no_vocab", "bert"):
        with pytest.raises(UnsupportedError, match=repr(kind)):
            Tokenizer.from_metadata({**md, "tokenizer.ggml.model": kind})
    md.pop("tokenizer.ggml.model")
    with pytest.raises(UnsupportedError, match="None"):
        Tokenizer.from_metadata(md)
    with pytest.raises(UnsupportedError, match="pre-tokenizer 'weird'"):
        Tokenizer.from_metadata({**read_metadata(model), "tokenizer.ggml.pre": "weird"})


def test_bench_sized_vocab(tmp_path):
    spec = replace(PRESETS["tiny"], n_layer=1, n_vocab=151936)
    p = tmp_path / "v.gguf"
    write_model(p, spec, progress=False)
    md = read_metadata(p)
    tok = Tokenizer.from_metadata(md)
    assert tok.n_vocab == 151936 == len(md["tokenizer.ggml.token_type"])
    assert md["tokenizer.ggml.tokens"][-1] == f"<|extra_{151936 - 256 - len(md['tokenizer.ggml.merges']) - 4}|>"
    assert tok.decode(tok.encode(TEXTS[3])) == TEXTS[3]
    assert tok.decode([151935, *tok.encode("ok")]) == "ok"      # unused padding is skipped


# DeepSeek-V3's pre_tokenizer exactly as its tokenizer.json writes it (DeepSeek-V3 / R1 / V4 on the Hugging Face
# hub; llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM lists the same three regexes). "\r\n" here are JSON escapes:
# the file's regexes hold the CR and LF characters themselves.
DEEPSEEK_V3_PRE_TOKENIZER_JSON = r'''{
  "type": "Sequence",
  "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]
}'''
DEEPSEEK_TEXTS = TEXTS + [
    "1234567 + 89 = 1234656; v1.2.3-rc4, 0xDEADBEEF, ١٢٣٤ and ５６７８",
    "東京タワーは333メートル。ひらがなとカタカナ、漢字。한국어 텍스트도 있어요.",
    "def f(x):\r\n    return x**2  # squared!!\n\n\n...and \"quotes\" 'single' [brackets]{braces}",
    "e\u0301 (combining acute) vs é, naïve coöperate; ﬁ ligature; Ǆ digraph; emoji 👩‍💻🏳️‍🌈",
]


def test_deepseek_v3_pre_tokenizer_matches_its_tokenizer_json(model):
    """A DeepSeek tokenizer.json converted to GGUF (convert_ds41's pre-tokenizer naming) and read back by our
    Tokenizer encodes every text to the ids Hugging Face `tokenizers` gives with that tokenizer.json itself."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from betelgeuse.gguf.convert_ds41 import _pre_name
    md = read_metadata(model)
    ours_qwen = Tokenizer.from_metadata(md)
    spec = json.loads(ours_qwen._tok.to_str())
    spec["pre_tokenizer"] = json.loads(DEEPSEEK_V3_PRE_TOKENIZER_JSON)
    hf = HFTokenizer.from_str(json.dumps(spec))
    assert _pre_name(spec) == "deepseek-v3"
    ours = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "deepseek-v3"})
    differs = 0
    for text in DEEPSEEK_TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text), skip_special=False) == text
        pieces = ours._tok.pre_tokenizer.pre_tokenize_str(text)
        assert pieces == hf.pre_tokenizer.pre_tokenize_str(text), text
        differs += pieces != ours_qwen._tok.pre_tokenizer.pre_tokenize_str(text)
    # the tiny vocabulary's ids seldom tell splits apart; the pieces do: not qwen2's (digits in threes, CJK runs,
    # punctuation before letters)
    assert differs >= 5


def test_deepseek_v3_splits_by_hand():
    """The three splits in turn, on cases worked out from the regexes by hand."""
    from tokenizers import Regex, pre_tokenizers

    from betelgeuse.gguf.vocab import PRE_SPLITS
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                   for r in PRE_SPLITS["deepseek-v3"]])

    def split(s):
        return [p for p, _ in pre.pre_tokenize_str(s)]
    assert split("1234567") == ["123", "456", "7"]
    assert split("東京タワーは333") == ["東京タワーは", "333"]
    assert split("Hello, world!!\n") == ["Hello", ",", " world", "!!\n"]
    assert split(".abc x.y") == [".abc", " x", ".y"]
    assert split("a  \n\nb") == ["a", "  \n\n", "b"]


def test_converter_names_the_pre_tokenizer_or_refuses():
    from betelgeuse.gguf.convert_ds41 import _pre_name
    from betelgeuse.gguf.vocab import QWEN2_SPLIT
    assert _pre_name({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}}) == "gpt2"
    qwen = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}},
                                                  {"type": "ByteLevel", "use_regex": False}]}
    assert _pre_name({"pre_tokenizer": qwen}) == "qwen2"
    odd = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": r"\d+"}},
                                                 {"type": "ByteLevel", "use_regex": False}]}
    with pytest.raises(UnsupportedError, match=r"pre-tokenizer splits \['\\\\d\+'\] are none of the known"):
        _pre_name({"pre_tokenizer": odd})
