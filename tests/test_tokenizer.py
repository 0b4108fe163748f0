"""Our GGUF-built tokenizer vs transformers' own GGUF tokenizer, on the default model.

transformers converts the GGUF vocabulary with its own code (``AutoTokenizer(...,
gguf_file=...)``); ours builds the ``tokenizers.Tokenizer`` from the same metadata
independently. They must agree id for id on a few hundred varied strings, on decoding,
and on the chat template.

One known difference, on purpose: the file says ``tokenizer.ggml.pre = "smollm"``, which
llama.cpp (and SmolLM2's own tokenizer.json) pre-tokenizes by isolating every Unicode
number character before GPT-2's split. transformers' converter ignores that value and
uses GPT-2's split alone, so it differs on whitespace runs before digits ("x  1") and on
non-ASCII numerals ("½", "Ⅻ"). The id-for-id comparison therefore uses transformers'
tokenizer with only its pre-tokenizer set to SmolLM2's; a second test pins down that
the unpatched one differs only on such strings.
"""

from __future__ import annotations

import copy
import json
import os
import unicodedata
from pathlib import Path

import pytest

import transformers  # a declared dependency (test extras): missing it fails, never skips

from jaxinfer.loading.gguf import open_gguf  # noqa: E402
from jaxinfer.loading.tokenizer import Tokenizer  # noqa: E402
from prompt_data import BUILTIN_QUESTIONS, mt_bench_turns  # noqa: E402


HANDWRITTEN = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "a", "A", "hello", " hello", "hello ",
    "  hello  ", "Hello, world!", "Hello world\r\nsecond line\r\n", "tabs\tand\t\ttabs",
    "mixed \t\n whitespace \u00a0nbsp\u3000ideographic space", "trailing spaces   ",
    "   leading spaces", "multiple     spaces    inside", "line1\nline2\n\nline4",
    "0", "7", "42", "123", "1234567890", "3.14159265358979", "1,000,000", "2024-01-01T12:34:56Z",
    "x1 y22 z333 w4444", " 1 2 3", "version 1.2.3-rc4", "0x1F600", "1e-5", "-42", "+1 (555) 010-9999",
    "½ ¾ ² ³ ⅕ ① ٣ ४", "Ⅻ roman", "don't won't it's we're they've I'm you'll he'd",
    "DON'T WON'T IT'S", "naïve café résumé coöperate", "Straße ß ẞ", "Ωμέγα ελληνικά",
    "Привет, мир! Как дела?", "日本語のテキストです。", "中文文本，包含标点符号。", "한국어 텍스트입니다",
    "ไทย ภาษา", "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "Tiếng Việt có dấu",
    "emoji 😀😃😄 ok", "👍🏽 👍🏿 👋🏻", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "👩🏽‍💻 coder", "🇺🇸🇯🇵 flags",
    "❤️ vs ❤ vs ♥", "e\u0301 (combining) vs é", "a\u0308\u0304 stacked marks", "Z\u0351\u0352\u0353algo",
    "\u200b zero width \u200c\u200d joiners \ufeff bom", "soft\u00adhyphen", "right\u200fleft mark",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n",
    "text<|im_end|>more", "<|im_start|><|im_start|>", "< |im_start| >", "<|im_start", "im_end|>",
    "<repo_name>x<file_sep>y", "<s> </s> <unk> [INST] [/INST]",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "if x == 1 and y != 2 or not z:\n\tpass", "SELECT * FROM users WHERE id = 42;",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}', "<div class=\"x\">&amp;</div>",
    "https://example.com/path?query=1&other=two#frag", "user@example.com", "C:\\Users\\name\\file.txt",
    "$ ls -la | grep '^d' > out.txt 2>&1", "a=b+c*d/e-f%g^h", "~!@#$%^&*()_+`-=[]{}|;':\",./<>?",
    "....", "----", "====", "!!!???", "…", "“quoted” ‘single’ «guillemets»", "— – -",
    "camelCaseIdentifier snake_case_name SCREAMING_CASE kebab-case", "AAAAAAAAAAAAAAAAAAAAAAAA",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "ab" * 40, " " * 17 + "x", "\n" * 9 + "y",
    "\t\t\t\tindented", "🙂" * 5, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐁𝐨𝐥𝐝 𝕕𝕠𝕦𝕓𝕝𝕖", "\U0010ffff\U000e0001",
    "The quick brown fox jumps over the lazy dog.", "Lorem ipsum dolor sit amet, consectetur.",
]


def _corpus(directory: Path | None = None) -> list[str]:
    texts = list(HANDWRITTEN)
    # MT-Bench's turns from ../shared/data; a plain clone has none: the project's own
    # questions (tests/prompt_data.py) instead.
    turns = mt_bench_turns(directory)
    texts += turns if turns is not None else BUILTIN_QUESTIONS
    # Variants that stress boundary handling: leading/trailing space and newline.
    base = list(texts)
    texts += [" " + t for t in base[:60]] + [t + "\n" for t in base[:60]]
    return texts


CORPUS = _corpus()


@pytest.fixture(scope="module")
def ours(default_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf_reader(open_gguf(default_gguf_path))


@pytest.fixture(scope="module")
def hf_gguf(default_gguf_path):
    """transformers' tokenizer for the GGUF, exactly as it builds it."""
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_gguf_path), gguf_file=os.path.basename(default_gguf_path))


@pytest.fixture(scope="module")
def reference(hf_gguf):
    """transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer (digits isolated)."""
    from tokenizers import pre_tokenizers

    ref = copy.deepcopy(hf_gguf)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return ref


def _has_number_issue(text: str) -> bool:
    """Numeric characters where GPT-2's split and SmolLM2's disagree: non-ASCII numerals,
    or a digit right after two or more whitespace characters."""
    if any(unicodedata.category(c).startswith("N") and not c.isascii() for c in text):
        return True
    return any(c.isdigit() and i >= 2 and text[i - 1].isspace() and text[i - 2].isspace()
               for i, c in enumerate(text))


@pytest.mark.slow
def test_transformers_gguf_differs_only_on_numbers(ours, hf_gguf):
    differ = [t for t in CORPUS if ours.encode(t) != hf_gguf.encode(t)]
    assert differ, "expected the known smollm pre-tokenizer difference to show up"
    assert all(_has_number_issue(t) for t in differ), differ
    # "x  1": SmolLM2/llama.cpp give x, "ĠĠ", 1; GPT-2's split gives x, "Ġ", "Ġ", 1.
    assert ours.convert_ids_to_tokens(ours.encode("x  1")) == ["x", "ĠĠ", "1"]
    assert hf_gguf.convert_ids_to_tokens(hf_gguf.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]


@pytest.mark.slow
def test_corpus_is_big_enough():
    assert len(CORPUS) >= 250, len(CORPUS)
    # and on a plain clone, without ../shared/data
    plain = _corpus(Path("/nonexistent-shared-data"))
    assert len(plain) >= 250 and set(BUILTIN_QUESTIONS) <= set(plain), len(plain)


@pytest.mark.slow
@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(ours, reference, add_special):
    for text in CORPUS:
        want = reference.encode(text, add_special_tokens=add_special)
        assert ours.encode(text, add_special_tokens=add_special) == want, repr(text)


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, reference, skip):
    for text in CORPUS:
        ids = reference.encode(text)
        got = ours.decode(ids, skip_special_tokens=skip)
        assert got == reference.decode(ids, skip_special_tokens=skip), repr(text)
        if not skip:
            assert got == text, repr(text)   # byte-level BPE round-trips exactly
    # Token-by-token pieces and arbitrary id soup, special ids included.
    soup = [0, 1, 2, 17, 198, 216, 1792, 49151, 2, 33, 34]
    assert ours.decode(soup, skip_special_tokens=False) == reference.decode(soup, skip_special_tokens=False)
    assert ours.decode(soup) == reference.decode(soup, skip_special_tokens=True) == "!\n  xectable12"
    assert ours.convert_ids_to_tokens(soup) == reference.convert_ids_to_tokens(soup)


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Write 日本語\n  with <|im_end|> inside."}],
]


@pytest.mark.slow
@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, reference, conv, gen):
    want = reference.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen,
                                         return_dict=False)
    assert ours.apply_chat_template(conv, add_generation_prompt=gen) == list(want)
    assert ours.render_chat(conv, gen) == reference.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=gen)


@pytest.mark.slow
def test_special_tokens_and_properties(ours, reference):
    assert ours.vocab_size == 49152 == len(reference)
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == (2,)            # <|im_end|>: both EOS and end of turn
    assert ours.pad_token_id == 2
    assert not ours.add_bos_token
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.all_special_ids == list(range(17))  # the 17 CONTROL tokens
    assert ours.chat_template == reference.chat_template
    assert ours.encode("<|im_start|>user") == [1, 4093]


@pytest.mark.slow
def test_from_hf_dir_roundtrip(ours, tmp_path):
    ours.hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    again = Tokenizer.from_hf_dir(str(tmp_path))
    for text in CORPUS[::3]:
        assert again.encode(text) == ours.encode(text), repr(text)
    conv = CONVERSATIONS[2]
    assert again.apply_chat_template(conv) == ours.apply_chat_template(conv)
    assert again.bos_token_id == 1 and again.eos_token_ids == (2, 0)
    assert again.chat_template == ours.chat_template
    assert again.vocab_size == ours.vocab_size


@pytest.mark.slow
def test_saved_tokenizer_loads_without_torch_and_as_autotokenizer_does(ours, tmp_path):
    """A tokenizer-only directory (what the weight cache saves and every warm start loads)
    is read by transformers' generic fast class directly: the same class and tokens as
    AutoTokenizer, without AutoTokenizer's module, which imports torch when torch is
    installed (seconds of every start). A model directory (config.json) still goes
    through AutoTokenizer."""
    import subprocess
    import sys

    ours.hf.save_pretrained(str(tmp_path))
    code = ("import sys, json; from jaxinfer.loading.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_saved({str(tmp_path)!r}, [2], {ours.vocab_size}); "
            "print(json.dumps([type(t.hf).__name__, 'torch' in sys.modules, "
            f"[t.encode(x) for x in {CORPUS[:12]!r}]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cls, torch_imported, ids = json.loads(out.stdout.strip().splitlines()[-1])
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert cls == type(auto).__name__ and not torch_imported
    assert ids == [ours.encode(x) for x in CORPUS[:12]]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    from jaxinfer.loading.tokenizer import _import_transformers, _tokenizer_class

    assert _tokenizer_class(_import_transformers(), str(tmp_path)) is None


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_hf_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]: missing 'content'"),
    ([{"content": "x"}], r"messages\[0\]: missing 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": ["x"]}],
     r"messages\[1\]\.content: must be a string, got list"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content: must be a string"),
    (["user: hi"], r"messages\[0\]: must be a dict"),
    ([{"role": "", "content": "x"}], r"messages\[0\]\.role"),
])
def test_chat_messages_validated(ours, messages, match):
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages)


# ------------------------------------------------------------------ synthetic vocabularies
def _bpe_meta(pre: str, **extra) -> dict:
    """A tiny byte-level BPE vocabulary: all 256 byte symbols, a few merges, two controls."""
    from jaxinfer.loading.tokenizer import byte_alphabet

    symbols = list(byte_alphabet().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġ 1", "1 2", "12 3"]
    tokens = ["<bos>", "<eos>"] + symbols + [m.replace(" ", "") for m in merges] + ["<think>"]
    types = [3, 3] + [1] * (len(tokens) - 3) + [4]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1}
    meta.update(extra)
    return meta


def test_pre_tokenizer_choice_changes_digits():
    gpt2 = Tokenizer.from_gguf_metadata(_bpe_meta("gpt2"))
    smol = Tokenizer.from_gguf_metadata(_bpe_meta("smollm"))
    llama3 = Tokenizer.from_gguf_metadata(_bpe_meta("llama-bpe"))
    t = gpt2.convert_ids_to_tokens
    assert t(gpt2.encode(" 1234")) == ["Ġ1", "2", "3", "4"]       # GPT-2 keeps digit runs
    assert t(smol.encode(" 1234")) == ["Ġ", "1", "2", "3", "4"]   # SmolLM: digits alone
    assert t(llama3.encode("1234")) == ["123", "4"]               # Llama 3: up to 3 digits
    for tok in (gpt2, smol, llama3):
        assert tok.convert_ids_to_tokens(tok.encode("hello <think> world")) == [
            "hello", "Ġ", "<think>", "Ġwo", "r", "l", "d"]
        assert tok.decode(tok.encode("<bos>hi<eos>")) == "hi"


def test_bos_eos_flags_and_end_of_turn():
    tok = Tokenizer.from_gguf_metadata(_bpe_meta(
        "gpt2", **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.eot_token_id": 5}))
    assert tok.encode("hello")[0] == 0 and tok.add_bos_token
    assert tok.encode("hello", add_special_tokens=False)[0] != 0
    assert tok.eos_token_ids == (1, 5)


def test_unsupported_tokenizers_named():
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'weird'.*smollm"):
        Tokenizer.from_gguf_metadata(_bpe_meta("weird"))
    with pytest.raises(ValueError, match="unsupported tokenizer 'rwkv'"):
        Tokenizer.from_gguf_metadata(_bpe_meta("gpt2", **{"tokenizer.ggml.model": "rwkv"}))
    with pytest.raises(ValueError, match="no vocabulary"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def _write_tokenizer_gguf(path, fill) -> None:
    """A GGUF file with a one-layer llama header and no tensors; ``fill(writer)`` adds the
    tokenizer fields."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                 ("feed_forward_length", 16), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{k}", v)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _spm_gguf(path) -> None:
    """A SentencePiece-style vocabulary (like Llama 2 / Mistral GGUFs: no merges, scores,
    <0xNN> byte tokens) built from frequent substrings of the corpus."""
    import collections

    text = "▁" + "▁".join(t for t in CORPUS if t.isascii()).replace(" ", "▁")
    counts = collections.Counter(text[i:i + n] for n in range(2, 7) for i in range(len(text) - n))
    pieces = [p for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1] * len(kv[0]), kv[0]))[:400]]
    chars = sorted(set(text))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(chars))] + [-float(i) for i in range(len(pieces))]

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(pieces)))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    _write_tokenizer_gguf(path, fill)


@pytest.mark.slow
def test_sentencepiece_vocab_matches_transformers(tmp_path):
    path = tmp_path / "spm.gguf"
    _spm_gguf(path)
    ours = Tokenizer.from_gguf_reader(open_gguf(str(path)))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.add_bos_token and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in CORPUS:   # non-ASCII text exercises the <0xNN> byte fallback
        ids = ref.encode(text)
        assert ours.encode(text) == ids, repr(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), repr(text)
    ours.hf.save_pretrained(str(tmp_path / "saved"))     # what `jaxinfer convert` keeps
    again = Tokenizer.from_hf_dir(str(tmp_path / "saved"))
    assert again.add_bos_token and again.encode("Hello world") == ours.encode("Hello world")
    for text in CORPUS[::4]:
        assert again.decode(ours.encode(text)) == ours.decode(ours.encode(text)), repr(text)


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_split_regex_pre_tokenizers_match_transformers(default_gguf_path, tmp_path, pre):
    """SmolLM2's vocabulary and merges under Qwen2's / Llama 3's split regex: the regexes
    are the part of those tokenizers that differs, and transformers knows both."""
    reader = open_gguf(default_gguf_path)
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    path = tmp_path / f"{pre}.gguf"

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(field("tokenizer.ggml.tokens"))
        w.add_token_types(field("tokenizer.ggml.token_type"))
        w.add_token_merges(field("tokenizer.ggml.merges"))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    _write_tokenizer_gguf(path, fill)
    ours = Tokenizer.from_gguf_reader(open_gguf(str(path)))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in CORPUS:
        assert ours.encode(text) == ref.encode(text), repr(text)


def test_token_bytes_for_logprobs_are_the_pieces_bytes(ours):
    """serving.token_texts.TokenTexts.bytes (chat logprobs' "bytes"): a token holding part of
    a multi-byte character reports its real bytes, read from the byte-level BPE piece (its
    text alone would be U+FFFD), and the pieces of a string add up to its UTF-8."""
    from serving.token_texts import TokenTexts

    texts = TokenTexts(ours)
    s = "é日本 naïve"
    ids = ours.encode(s, add_special_tokens=False)
    pieces = [texts.bytes(i) for i in ids]
    assert b"".join(pieces) == s.encode()
    assert any("\ufffd" in texts(i) for i in ids), "the string should split a character across tokens"
