"""Per-layer attention options (ModelConfig.attention_kwargs): sliding/full layers, the
softmax scale and soft-capping, read in one place by every attention path."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.registry import config_from_hf  # noqa: E402
from jaxinfer.attention.contiguous import contiguous_attention
from jaxinfer.models.config import ModelConfig
from jaxinfer.reference import paged_contiguous_attention

BASE = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8)


def test_layer_types_pick_each_layers_window_scale_and_cap():
    cfg = ModelConfig(**BASE, sliding_window=5, attn_scale=0.25, attn_soft_cap=20.0,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    assert cfg.attention_kwargs(1) == {"sm_scale": 0.25, "sliding_window": None, "soft_cap": 20.0}
    plain = ModelConfig(**BASE, sliding_window=7)
    assert plain.attention_kwargs(2) == {"sm_scale": 8 ** -0.5, "sliding_window": 7, "soft_cap": None}


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=("full_attention",)), "layer_types"),
    (dict(layer_types=("full_attention", "chunked_attention", "full_attention")), "layer_types"),
    (dict(layer_types=("sliding_attention",) * 3), "sliding_window"),
    (dict(attn_soft_cap=0.0), "attn_soft_cap"),
    (dict(attn_scale=-1.0), "attn_scale"),
])
def test_bad_layer_options_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ModelConfig(**{**BASE, **change})


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="unsupported architecture 'NopeForCausalLM'.*LlamaForCausalLM"):
        config_from_hf({"architectures": ["NopeForCausalLM"]})


def test_paged_and_dense_paths_agree_per_layer():
    """The engine's attention (paged, xla/cpp) and the dense oracle read the same options:
    a sliding layer, a full layer, soft-capping and a custom scale give the same outputs."""
    cfg = ModelConfig(**BASE, sliding_window=4, attn_scale=0.3, attn_soft_cap=2.0,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    n, H, KVH, D = 20, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, D)), jnp.float32) for h in (H, KVH, KVH))
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    dense = contiguous_attention(positions, 1, n, cfg)
    paged = paged_contiguous_attention(positions, jnp.array([n], jnp.int32), 128, cfg)
    outs = []
    for layer in (0, 1):
        od, _ = dense(layer, q, k, v, (jnp.zeros((1, n, KVH, D)), jnp.zeros((1, n, KVH, D))))
        pages = jnp.zeros((128 // 16, 16, KVH, D))
        op, _ = paged(layer, q, k, v, (pages, pages))
        np.testing.assert_allclose(np.asarray(op), np.asarray(od), rtol=1e-5, atol=1e-6)
        outs.append(np.asarray(od))
    # the window matters: the sliding layer differs from the full one past the window
    assert np.abs(outs[0][:4] - outs[1][:4]).max() < 1e-6 < np.abs(outs[0][4:] - outs[1][4:]).max()
    nocap = dataclasses.replace(cfg, attn_soft_cap=None)
    o2, _ = contiguous_attention(positions, 1, n, nocap)(1, q, k, v, (jnp.zeros((1, n, KVH, D)),) * 2)
    assert np.abs(np.asarray(o2) - outs[1]).max() > 1e-3
