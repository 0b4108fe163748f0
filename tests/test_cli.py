"""The command line: convert an HF checkpoint to orbax, generate from it (streamed), and
clear errors for bad input. Uses a tiny random Llama saved as safetensors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import torch
import transformers

from serving.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    from safetensors.torch import save_file

    from jaxinfer.loading.default import default_model_path
    from jaxinfer.loading.gguf import load_gguf

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(out / "model.safetensors"))
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(d))
    load_gguf(default_model_path()).tokenizer.hf.save_pretrained(str(out))
    return out


def test_convert_then_generate(tiny_hf_dir, tmp_path, capsys):
    conv = tmp_path / "converted"
    common = ["--max-num-seqs", "1", "--max-model-len", "128", "--compilation-cache", ""]
    assert main(["convert", "--model", str(tiny_hf_dir), "--output", str(conv)]) == 0
    assert (conv / "jaxinfer_checkpoint.json").exists()
    assert "converted" in capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_hf_dir), "Hello there", "--max-tokens", "6",
                 "--ignore-eos", *common]) == 0
    from_hf = capsys.readouterr()
    assert main(["generate", "--model", str(conv), "Hello there", "--max-tokens", "6",
                 "--ignore-eos", *common]) == 0
    from_orbax = capsys.readouterr()
    assert from_hf.out == from_orbax.out and from_hf.out.strip()
    assert "6 tokens" in from_orbax.err and "finish_reason=length" in from_orbax.err

    # A converted checkpoint restores to exactly the same weights.
    from jaxinfer.loading import load_model
    from jaxinfer.models.llama import flat_params

    a, b = flat_params(load_model(str(tiny_hf_dir)).model), flat_params(load_model(str(conv)).model)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_cli_errors_name_the_problem(tiny_hf_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_hf_dir), "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_hf_dir), "hi", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_hf_dir), "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    # an architecture nobody serves: the error names it and lists what is supported
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    assert main(["generate", "--model", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert "NoSuchModelForCausalLM" in err and "LlamaForCausalLM" in err and "GPT2LMHeadModel" in err
    # a supported architecture whose config lacks a required field: the field is named
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert main(["generate", "--model", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert "n_embd" in err and "GPT2LMHeadModel" in err
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    assert main(["generate", "--model", str(tmp_path / "x.gguf"), "hi"]) == 2
    assert "x.gguf" in capsys.readouterr().err
    assert main(["convert", "--model", str(tiny_hf_dir), "--output", str(tmp_path / "c")]) == 0
    assert main(["convert", "--model", str(tiny_hf_dir), "--output", str(tmp_path / "c")]) == 2
    assert "already" in capsys.readouterr().err
