"""One tokenizer interface over an HF checkpoint directory and a GGUF vocabulary.

Both end up as a ``transformers.PreTrainedTokenizerFast`` (``Tokenizer.hf``), so encoding,
decoding and chat templates behave exactly as transformers does. For an HF directory
transformers reads ``tokenizer.json``; for a GGUF file we build the ``tokenizers.Tokenizer``
ourselves from the vocabulary llama.cpp stored in the metadata (``tokenizer.ggml.*``):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` + ``merges``, with the
  pre-tokenizer (the split regex) picked by ``tokenizer.ggml.pre``;
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE with byte fallback; merges
  come from the file or, when absent, are derived from the token scores.

Tokens marked CONTROL (type 3) become special added tokens (never split, skipped by
``decode(skip_special_tokens=True)``); USER_DEFINED ones (type 4) become plain added tokens.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import threading
from functools import lru_cache
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# `tokenizer.ggml.pre` -> how text is split before BPE. These mirror the regexes llama.cpp
# applies for each pre-tokenizer type (and the HF tokenizer.json the GGUF was converted from).
# GPT-2's split: ByteLevel's built-in regex.
_GPT2_PRE = ("default", "gpt2", "gpt-2")
# StarCoder-style: every digit on its own, then GPT-2's split (SmolLM, StarCoder, Refact).
_DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama 3's tokenizer.json sets `ignore_merges` (a word already in the vocab is one token),
# and llama.cpp does the same for these pre-tokenizer types.
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")
SUPPORTED_GGUF_PRE = _GPT2_PRE + _DIGITS_GPT2_PRE + tuple(_SPLIT_PRE)

# Names a chat template's extra variables (``template_kwargs``) may not take: transformers'
# apply_chat_template arguments (``tokenize`` would return ids, ``chat_template`` swap the
# template), the variables it passes itself, and the special tokens it fills in.
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs", "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens"))

# Chat end-of-turn markers: when the chat template emits one and the vocabulary marks it
# CONTROL, generation must stop on it even if the file names a different EOS.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
                "<|END_OF_TURN_TOKEN|>")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE spells tokens in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class _NoTorchAdvice(logging.Filter):
    """transformers warns "PyTorch was not found ..." on import when torch is absent; we only
    use its tokenizers, which need no torch, so a user should not read that warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


_prefetch: threading.Thread | None = None


def import_transformers_in_background() -> None:
    """Import transformers' tokenizer classes in a daemon thread (a start calls this before
    compiling its sampler): ~1 s of one core that the tokenizer would otherwise spend inside
    the load, on the critical path of every start, cold or warm, while the sampler compile
    leaves the other core idle."""
    global _prefetch
    if "transformers" not in sys.modules and _prefetch is None:
        thread = threading.Thread(target=_prefetch_tokenizer_classes, name="jaxinfer-import", daemon=True)
        thread.start()
        _prefetch = thread          # only a started thread is ever joined


def _prefetch_tokenizer_classes() -> None:
    try:
        _import_transformers().PreTrainedTokenizerFast      # noqa: B018  (a lazy attribute: imports it)
    except BaseException:       # noqa: BLE001 - the load imports it again and says what is wrong
        pass


def _import_transformers() -> Any:
    # transformers' lazy module is not safe to use from one thread while another is still
    # importing it (seen: "module 'transformers' has no attribute 'AutoTokenizer'"): wait
    # for the background import to finish first
    if _prefetch is not None and _prefetch is not threading.current_thread():
        _prefetch.join()
    log = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in log.filters):
        log.addFilter(_NoTorchAdvice())
    import transformers

    return transformers


def _tokenizer_class(transformers: Any, path: str) -> Any:
    """transformers' generic fast tokenizer class when ``path`` is a tokenizer-only directory
    that declares it (tokenizer_config.json's ``tokenizer_class`` "TokenizersBackend" or
    "PreTrainedTokenizerFast", no ``auto_map``, no config.json): what the weight cache saves
    and loads on every warm start, and what AutoTokenizer returns for it. Loaded directly,
    without importing transformers' auto module, which imports torch whenever torch is
    installed (~3 s of every start; a tokenizer needs none of it). None otherwise: a model
    directory's class is AutoTokenizer's choice (it weighs config.json's model type)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    name = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    if "auto_map" in cfg or name not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return None
    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast) else None


def _fast_tokenizer(path: str) -> Any:
    """transformers' fast tokenizer from a directory holding tokenizer.json."""
    transformers = _import_transformers()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(
            f"{path}: no tokenizer.json (a fast tokenizer is required; slow/sentencepiece-only "
            "tokenizers are not supported)")
    cls = _tokenizer_class(transformers, path)
    if cls is not None:
        hf = cls.from_pretrained(path, local_files_only=True)
    else:
        hf = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    if not isinstance(hf, transformers.PreTrainedTokenizerFast):
        raise ValueError(f"{path}: expected a fast tokenizer, got {type(hf).__name__}")
    return hf


class Tokenizer:
    """Text <-> token ids, chat templates, and the ids that end generation.

    Build with ``from_hf_dir`` or ``from_gguf_reader`` / ``from_gguf_metadata``.
    """

    def __init__(self, hf: Any, eos_token_ids: Sequence[int] = (), vocab_size: int | None = None):
        self.hf = hf
        ids: list[int] = []
        for t in ([hf.eos_token_id] if hf.eos_token_id is not None else []) + list(eos_token_ids):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
        self._eos_token_ids = tuple(ids)
        self._vocab_size = int(vocab_size) if vocab_size is not None else len(hf)
        self._adds_bos: bool | None = None

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """A checkpoint directory with tokenizer.json (+ tokenizer_config.json, chat template)."""
        hf = _fast_tokenizer(path)
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            fn = os.path.join(path, name)
            if os.path.isfile(fn):
                with open(fn, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token_id")
                extra += eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return cls(hf, extra)

    @classmethod
    def from_saved(cls, path: str, eos_token_ids: Sequence[int], vocab_size: int) -> "Tokenizer":
        """A tokenizer that ``self.hf.save_pretrained(path)`` wrote, with the end ids and
        vocabulary size the saved one had (loading/weight_cache.py)."""
        return cls(_fast_tokenizer(path), eos_token_ids, vocab_size)

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> "Tokenizer":
        """From an open ``gguf.GGUFReader`` (only its ``tokenizer.*`` fields are read)."""
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        return cls.from_gguf_metadata(meta)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """From GGUF metadata values keyed by their GGUF names (``tokenizer.ggml.tokens``, ...)."""
        PreTrainedTokenizerFast = _import_transformers().PreTrainedTokenizerFast

        g = lambda k, d=None: meta.get(f"tokenizer.ggml.{k}", d)  # noqa: E731
        tokens = g("tokens")
        if not tokens:
            raise ValueError("GGUF has no vocabulary (tokenizer.ggml.tokens)")
        tokens = [str(t) for t in tokens]
        types = [int(t) for t in (g("token_type") or [_NORMAL] * len(tokens))]
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
        kind = g("model")
        if kind == "gpt2":
            tk = _byte_level_bpe(tokens, types, g("merges") or [], g("pre") or "default")
            add_bos_default = False
        elif kind == "llama":
            tk = _sentencepiece_bpe(tokens, g("merges"), g("scores"),
                                    add_prefix=bool(g("add_space_prefix", True)),
                                    unk_id=g("unknown_token_id"))
            add_bos_default = True   # llama.cpp adds BOS for SentencePiece vocabularies
        else:
            raise ValueError(f"tokenizer.ggml.model: unsupported tokenizer {kind!r} "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        _add_marked_tokens(tk, tokens, types)

        def tok(key: str) -> str | None:
            i = g(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        hf = PreTrainedTokenizerFast(
            tokenizer_object=tk,
            bos_token=tok("bos_token_id"), eos_token=tok("eos_token_id"),
            unk_token=tok("unknown_token_id"), pad_token=tok("padding_token_id"),
            add_bos_token=bool(g("add_bos_token", add_bos_default)),
            add_eos_token=bool(g("add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            clean_up_tokenization_spaces=False,
        )
        return cls(hf, _gguf_end_ids(meta, tokens, types), vocab_size=len(tokens))

    # ----------------------------------------------------------------- interface
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.hf.convert_ids_to_tokens(ids)
        return self.hf.convert_ids_to_tokens([int(i) for i in ids])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None,
                    tools: list[dict] | None = None) -> str:
        """The chat template's text for ``messages`` (validated), special tokens spelled out.
        ``template_kwargs``: more variables for the template (e.g. ``enable_thinking``); none
        may be one of ``apply_chat_template``'s own arguments (``RESERVED_TEMPLATE_KWARGS``).
        ``tools``: OpenAI tool objects, for a template that renders them."""
        _validate_messages(messages)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        kw = dict(template_kwargs or {})
        clash = sorted(set(kw) & (RESERVED_TEMPLATE_KWARGS | _template_call_args(type(self.hf))))
        if clash:
            raise ValueError(f"template_kwargs: {', '.join(clash)} cannot be set (an argument of the template call)")
        if tools is not None:
            kw["tools"] = tools
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kw)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        # The template writes BOS/control tokens itself, so none are added on top (as HF does).
        text = self.render_chat(messages, add_generation_prompt, template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(text)`` puts BOS first (read off the post-processor's behaviour:
        a tokenizer reloaded from tokenizer.json can add BOS while ``hf.add_bos_token`` is False)."""
        if self._adds_bos is None:
            bos = self.bos_token_id
            self._adds_bos = bos is not None and self.hf.encode("", add_special_tokens=True)[:1] == [bos]
        return self._adds_bos

    @property
    def all_special_ids(self) -> list[int]:
        ids = set(self.hf.all_special_ids)
        ids.update(i for i, t in self.hf.added_tokens_decoder.items() if t.special)
        return sorted(ids)

    @property
    def chat_template(self) -> str | None:
        t = self.hf.chat_template
        return t if isinstance(t, str) and t else None

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, chat_template={self.chat_template is not None})")


# --------------------------------------------------------------------- GGUF builders
def _byte_level_bpe(tokens: list[str], types: list[int], merges: Sequence[str],
                    pre: str) -> RustTokenizer:
    """GPT-2-style byte-level BPE (SmolLM, Llama 3, Qwen2/3 GGUFs)."""
    if pre in _GPT2_PRE:
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_GPT2_PRE:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLIT_PRE:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ValueError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre!r} "
                         f"(supported: {', '.join(SUPPORTED_GGUF_PRE)})")
    alphabet = byte_alphabet()
    chars = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        # A normal token must be spelled in the byte alphabet for BPE to ever produce it; a
        # few converters store raw text instead. Added (control/user) tokens match raw text.
        if ty in (_NORMAL, _UNUSED) and not set(t) <= chars:
            t = "".join(alphabet[b] for b in t.encode("utf-8"))
        vocab[t] = i   # a duplicate maps to its last id, as in llama.cpp
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise ValueError(f"tokenizer.ggml.merges: malformed merge {m!r} (want 'left right')")
        pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in _IGNORE_MERGES_PRE)
    tk = RustTokenizer(bpe)
    tk.pre_tokenizer = pre_tok
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(tokens: list[str], merges: Sequence[str] | None,
                       scores: Sequence[float] | None, add_prefix: bool,
                       unk_id: int | None) -> RustTokenizer:
    """SentencePiece BPE (Llama 2, Mistral v0.x): '▁' for spaces, <0xNN> byte fallback.

    The '▁' prefix goes on the start of the text only (Metaspace ``prepend_scheme="first"``,
    as transformers' Llama tokenizer does), not after every special token."""
    vocab = {t: i for i, t in enumerate(tokens)}   # a duplicate maps to its last id, as in llama.cpp
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        if scores is None or len(scores) != len(tokens):
            raise ValueError("SentencePiece GGUF has neither tokenizer.ggml.merges nor one "
                             "tokenizer.ggml.scores entry per token")
        pairs = _merges_from_scores(tokens, [float(s) for s in scores])
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=unk, fuse_unk=True,
                     byte_fallback=True)
    tk = RustTokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(dec)
    return tk


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Rebuild BPE merges from SentencePiece scores.

    SentencePiece merges, at each step, the adjacent pair whose concatenation is the
    best-scoring vocabulary piece; as a BPE merge list that is every split (a, b) of a piece
    into two pieces, ranked by the piece's score. Equal scores: longer left part, then
    longer right part, then vocabulary order -- the order transformers' converter uses, so
    both agree on ties."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, i in index.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in index and b in index:
                found.append((-scores[i], -len(a), -len(b), i, index[a], index[b], a, b))
    found.sort()
    return [(f[6], f[7]) for f in found]


def _add_marked_tokens(tk: RustTokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL/UNKNOWN tokens -> special added tokens; USER_DEFINED -> plain added tokens.
    They already have vocabulary ids, so adding them reuses those ids."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def _gguf_end_ids(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> list[int]:
    """Ids that end generation besides EOS: the file's EOT/EOM ids and, for chat models, the
    end-of-turn control token its chat template writes."""
    out = [int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if meta.get(k) is not None]
    template = meta.get("tokenizer.chat_template") or ""
    if template:
        index = {t: i for i, t in enumerate(tokens) if types[i] == _CONTROL}
        out += [index[m] for m in _END_OF_TURN if m in index and m in template]
    return out


@lru_cache(maxsize=None)
def _template_call_args(cls: type) -> frozenset[str]:
    """apply_chat_template's named arguments in this transformers version (a newer one may
    add some that ``RESERVED_TEMPLATE_KWARGS`` does not list yet)."""
    try:
        params = inspect.signature(cls.apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD and n != "self")


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}]: missing {key!r}")
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key}: must be a string, got {type(m[key]).__name__}")
        if not m["role"]:
            raise ValueError(f"messages[{i}].role: must be a non-empty string")
