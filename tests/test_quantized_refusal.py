"""Pre-quantized HF checkpoints are refused at load, naming their format and scheme
(jaxinfer/models/prequantized.py), through ``load_model``, ``Engine(path)`` and
``jaxinfer serve``: before this, a compressed-tensors W8A8 checkpoint loaded without a word
(its int8 codes read as the weights, the scales ignored) and a W4A16 one failed naming a
"missing" weight.

The compressed-tensors checkpoints are written by the format's own library from a tiny
random Llama. Not llm-compressor: ``pip install llmcompressor`` would downgrade the pinned
transformers (5.24 -> 5.17) and huggingface_hub, so its ``oneshot`` is replaced here by what
it does for a data-free weight scheme: per-channel / per-group min-max scales
(compressed_tensors' own ``calculate_qparams``), then ``ModelCompressor`` to compress and
write the config. The GPTQ checkpoint's tensors are written by hand (shapes of GPTQ's
4-bit packing).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

# Required test dependencies (pyproject's test extra): a missing one fails, never skips.
import compressed_tensors  # noqa: E402,F401
import torch  # noqa: E402
import transformers  # noqa: E402

from test_hf_oracle import FAMILIES, TINY, tiny_tokenizer_files  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from jaxinfer.loading.lazy import LazyTensors  # noqa: E402
from jaxinfer.models.prequantized import quantized_tensor_format  # noqa: E402

# in-features a multiple of 128: W4A16 and GPTQ quantize in groups of 128 inputs
TINY_Q = dict(TINY, hidden_size=128, intermediate_size=256)
GROUP = 128
NOT_SUPPORTED = "pre-quantized checkpoints are not supported yet"


def float_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_Q)).eval()


def save_compressed_tensors(scheme: str, out: str) -> None:
    """A compressed-tensors checkpoint of ``scheme`` (a preset: "W8A8", "W4A16") in ``out``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStrategy,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = float_llama()
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.data
        if args.strategy == QuantizationStrategy.GROUP:
            w = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = w.amin(-1, keepdim=args.strategy != QuantizationStrategy.GROUP), \
            w.amax(-1, keepdim=args.strategy != QuantizationStrategy.GROUP)
        scale, zero_point = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


def save_gptq(out: str) -> None:
    """A GPTQ-style 4-bit group-128 checkpoint: each projection's ``weight`` replaced by
    qweight / qzeros / scales / g_idx (GPTQ's packed shapes), the config declaring gptq."""
    import os

    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    model = float_llama()
    rng = np.random.default_rng(0)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("_proj.weight"):
            stem, (n_out, n_in) = name[: -len(".weight")], t.shape
            tensors[f"{stem}.qweight"] = rng.integers(0, 2**31, (n_in // 8, n_out), dtype=np.int32)
            tensors[f"{stem}.qzeros"] = rng.integers(0, 2**31, (n_in // GROUP, n_out // 8), dtype=np.int32)
            tensors[f"{stem}.scales"] = rng.random((n_in // GROUP, n_out), dtype=np.float32).astype(np.float16)
            tensors[f"{stem}.g_idx"] = (np.arange(n_in) // GROUP).astype(np.int32)
        else:
            tensors[name] = t.numpy()
    save_file(tensors, f"{out}/model.safetensors")
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                     "desc_act": False, "sym": True}
    with open(f"{out}/config.json", "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> checkpoint directory: the float model, its W8A8 / W4A16 compressed-tensors
    forms, a GPTQ one, and the W8A8 one with its quantization_config removed."""
    root = tmp_path_factory.mktemp("quantized")
    dirs = {name: root / name for name in ("float", "W8A8", "W4A16", "gptq", "undeclared")}
    float_llama().save_pretrained(str(dirs["float"]))
    save_compressed_tensors("W8A8", str(dirs["W8A8"]))
    save_compressed_tensors("W4A16", str(dirs["W4A16"]))
    save_gptq(str(dirs["gptq"]))
    shutil.copytree(dirs["W8A8"], dirs["undeclared"])
    config = json.loads((dirs["undeclared"] / "config.json").read_text())
    del config["quantization_config"]
    (dirs["undeclared"] / "config.json").write_text(json.dumps(config))
    for d in dirs.values():
        tiny_tokenizer_files(str(d))
    return {name: str(d) for name, d in dirs.items()}


@pytest.fixture
def no_weight_read(monkeypatch):
    """Any tensor read (not a header's names) fails the test: refusals come before."""
    def read(self, name):
        raise AssertionError(f"tensor {name!r} was read before the refusal")

    monkeypatch.setattr(LazyTensors, "__getitem__", read)


@pytest.mark.parametrize("scheme, words", [
    ("W8A8", "int-quantized W8A8 [weights int8 per channel, input activations int8 per token dynamic]"),
    ("W4A16", "pack-quantized W4A16 group 128 [weights int4 per group]"),
])
def test_compressed_tensors_refused_naming_format_and_scheme(ckpts, no_weight_read, scheme, words):
    for load in (load_model, Engine):
        with pytest.raises(ValueError) as e:
            load(ckpts[scheme])
        msg = str(e.value)
        assert msg.startswith("quantization_config.quant_method: 'compressed-tensors' checkpoint"), msg
        assert words in msg and NOT_SUPPORTED in msg, msg


def test_gptq_refused_naming_bits_and_group(ckpts, no_weight_read):
    with pytest.raises(ValueError) as e:
        Engine(ckpts["gptq"])
    msg = str(e.value)
    assert msg.startswith("quantization_config.quant_method: 'gptq' checkpoint, 4-bit group 128:"), msg
    assert NOT_SUPPORTED in msg


def test_quantized_tensors_without_config_refused_naming_the_tensor(ckpts, no_weight_read):
    # a checkpoint whose config.json lost its quantization_config: the tensor names say it
    with pytest.raises(ValueError) as e:
        # warm-up "lazy": no sampler compiles before the load (this config.json is fine)
        Engine(ckpts["undeclared"], warmup="lazy")
    msg = str(e.value)
    assert msg.startswith("tensor 'model.layers.0.mlp.down_proj.weight_scale' is a compressed-tensors"), msg
    assert "declares no quantization_config" in msg and NOT_SUPPORTED in msg


def test_float_checkpoint_still_loads(ckpts):
    from jaxinfer.models.llama import flat_params

    got = flat_params(load_model(ckpts["float"]).model)["layers.0.wq"]
    want = float_llama().state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(got), want.T)


def test_no_supported_family_tensor_looks_quantized():
    # every family's HF tensor names (the tests' tiny models, each variant): none is taken
    # for a quantized format's, so no float checkpoint of theirs is refused
    from test_gpt_families import CASES, build_hf

    models = [transformers.AutoModelForCausalLM.from_config(f.config()) for f in FAMILIES]
    models += [build_hf(case) for case in CASES]
    names = {n for m in models for n in m.state_dict()}
    assert [n for n in sorted(names) if quantized_tensor_format(n) is not None] == []


def test_serve_reports_the_refusal(ckpts):
    import httpx
    from mock_engine import free_port, serve_in_thread
    from serving.app import build_app

    # `jaxinfer serve`: listens, the load fails, it says why and exits 1 (in a process of its
    # own: a server whose load succeeds would serve on, so the timeout bounds it)
    argv = ["serve", "--model", ckpts["W8A8"], "--port", str(free_port())]
    code = f"from serving.cli import main; raise SystemExit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("the engine failed to load: ValueError: quantization_config.quant_method: 'compressed-tensors' "
            "checkpoint, int-quantized W8A8") in proc.stderr
    # a server that stays up: /health "failed", the reason kept for the log
    app = build_app(engine_factory=lambda: Engine(ckpts["W4A16"]))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        deadline = time.monotonic() + 30
        while (r := c.get("/health")).json()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 503 and r.json() == {"status": "failed"}
    assert "pack-quantized W4A16 group 128" in app.state.jx.load_error
