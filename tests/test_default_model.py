"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): our float32 model vs HF
transformers loading the same GGUF (it dequantizes with the same `gguf` package).
Greedy 64 tokens identical on varied prompts, through the reference generator and the
continuous-batching engine."""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import pytest

import torch
import transformers

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from jaxinfer.reference import ReferenceGenerator  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from hf_greedy import greedy_mismatch, hf_generate_greedy  # noqa: E402

pytestmark = pytest.mark.slow

LONG = (" ".join(f"Clause {i}: the licensee shall keep every notice intact, and redistribution "
                 "in source or binary form must retain this list of conditions." for i in range(1, 24)))

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Give me three tips for writing clean Python code."}],
    [{"role": "user", "content": "Écris un court poème sur la mer."}],
    [{"role": "user", "content": "用一句话解释什么是机器学习。"}],
]
RAW = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,",
    "Summarize the following text.\n\n" + LONG + "\n\nSummary:",
    "Wie spät ist es? Ich glaube, es ist",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, "float32")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    out = [tok.apply_chat_template(m, add_generation_prompt=True) for m in CHATS]
    out += [tok.encode(t) for t in RAW]
    return out


@pytest.fixture(scope="module")
def hf_model():
    return hf_default_model()


def hf_default_model():
    """transformers' own GGUF reader (what ``from_pretrained(gguf_file=...)`` uses, minus its
    `accelerate` requirement): its config, its dequantized, un-permuted tensors (the
    benchmarks' HF peer, benchmarks/common.py). Read once per process (~12 s: five test
    files use it); each caller gets its own copy (test_lora wraps it in PEFT layers)."""
    import copy

    return copy.deepcopy(_hf_default_model())


@functools.cache
def _hf_default_model():
    """transformers' GGUF reader takes ~23 s on a 2-core VM (its metadata parse, not the
    dequantization): under pytest the first process to need the model reads it and keeps
    its tensors as safetensors in the run's cache directory (tests/conftest.py), and every
    other process of the run (the other xdist worker) loads those (~0.2 s) instead. The
    tensors are transformers' own either way."""
    import fcntl

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from common import TORCH_THREADS, hf_llama_from_tensors, load_hf_model
    from safetensors.torch import load_file, save_file

    run_cache = os.environ.get("JAXINFER_TEST_CACHE_DIR")
    if not run_cache:
        model, _ = load_hf_model()
    else:
        d = os.path.join(run_cache, "hf_default_twin")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)        # one reader; the others wait and load its file
            done = os.path.join(d, "model.safetensors")
            if os.path.exists(done):
                torch.set_num_threads(TORCH_THREADS)           # as load_hf_model does
                model = hf_llama_from_tensors(
                    transformers.LlamaConfig.from_json_file(os.path.join(d, "config.json")), load_file(done))
            else:
                model, _ = load_hf_model()
                model.config.to_json_file(os.path.join(d, "config.json"))
                save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
                          done + ".tmp")
                os.replace(done + ".tmp", done)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model


def test_prompt_set_is_varied(prompts):
    lens = [len(p) for p in prompts]
    assert len(prompts) >= 8
    assert max(lens) >= 380, lens          # the ~400-token prompt


def test_logits_match_transformers(loaded, hf_model, prompts):
    gen = ReferenceGenerator(loaded.model)
    for ids in prompts[:3]:
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        got = gen.logits(ids)
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, rel


def test_greedy_64_tokens_identical_to_transformers(loaded, hf_model, prompts):
    """transformers' ``generate()`` itself on the first prompt; on every prompt its greedy
    choice at each of the 64 positions in one forward (tests/hf_greedy.py: 8 generate()
    calls took ~35 s of a core, these forwards ~4 s)."""
    gen = ReferenceGenerator(loaded.model)
    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # the ~650-token prompt alone, the short ones together: one batch would pad all eight
    # to 1024 positions (5x the prefill work)
    short = [i for i, ids in enumerate(prompts) if len(ids) <= 128]
    ours = [None] * len(prompts)
    for i, row in zip(short, gen.generate([prompts[i] for i in short], [p] * len(short), [0] * len(short))):
        ours[i] = row
    for i in set(range(len(prompts))) - set(short):
        ours[i] = gen.generate([prompts[i]], [p], [0])[0]
    assert ours[0].token_ids == hf_generate_greedy(hf_model, prompts[0], 64)
    for i, (ids, row) in enumerate(zip(prompts, ours)):
        assert len(row.token_ids) == 64
        err = greedy_mismatch(hf_model, ids, row.token_ids)
        assert err is None, f"prompt {i}: {err}"
