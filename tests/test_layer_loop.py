"""The layer loop (jaxinfer/models/layer_loop.py, EngineConfig.layer_loop, on by default):
an engine whose identical layers run as one lax.fori_loop gives the unrolled engine's
tokens and logprobs bit for bit (greedy and seeded sampling, float32 and int8 weights,
alone and batched), its step executables really hold a loop (and are smaller), nothing
compiles after warm-up, and the layers unroll where the loop does not apply. The suite's
other engine tests (engine vs the unrolled reference generator) run the loop too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.models.config import ModelConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine.engine import Engine
from jaxinfer.loading import LoadedModel
from jaxinfer.models import layer_loop
from jaxinfer.models.llama import LlamaForCausalLM

V = 64
KW = dict(progress=False, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_pages=40,
          min_sampler_rows=16, decode_buckets=(1, 4), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 64),))


def _tiny_model(num_layers: int = 3) -> LlamaForCausalLM:
    # qkv biases and q/k norms: vector weights the loop reads from their stacks
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=V, hidden_size=64, intermediate_size=128,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_ids=(2,), qkv_bias=True, qk_norm=True)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(11))
    rng = np.random.RandomState(num_layers)
    for layer in model.layers:      # vectors differ per layer (they init to ones / zeros)
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "bq", "bk", "bv"):
            v = getattr(layer, name)
            v.set_value(jnp.asarray(1.0 + 0.3 * rng.standard_normal(v[...].shape), v[...].dtype))
    return model


@pytest.fixture(scope="module")
def tiny():
    from jaxinfer.loading import load_model

    model = _tiny_model()
    return LoadedModel(model.cfg, model, load_model(None, "float32").tokenizer, {}, "tiny-random-llama-loop")


def _outputs(eng: Engine, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_loop_gives_the_unrolled_bits(tiny, quantization):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, V, size=n).tolist() for n in (5, 17, 40, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)
    unrolled = Engine(loaded=tiny, layer_loop=False, quantization=quantization, **KW)
    looped = Engine(loaded=tiny, quantization=quantization, **KW)
    ru, rl = unrolled.replicas[0].runner, looped.replicas[0].runner
    assert rl.layer_loop and not ru.layer_loop
    for params in (greedy, seeded):
        want = _outputs(unrolled, prompts, params)
        assert _outputs(looped, prompts, params) == want                   # batched
        assert [_outputs(looped, [p], params)[0] for p in prompts] == want  # alone
    for b, exe in rl.executables.items():
        text, unrolled_text = exe.as_text(), ru.executables[b].as_text()
        assert " while(" in text and len(text) < len(unrolled_text), b
        # every layer weight's array and every kind of KV page is one stacked operand, not one per layer
        per_layer = len(jax.tree.leaves(rl.state["layers"][0]))
        L = len(rl.state["layers"])
        kv_per_layer = len(jax.tree.leaves(ru.kv)) // L
        assert _entry_parameters(text) == _entry_parameters(unrolled_text) - (L - 1) * (per_layer + kv_per_layer)
    assert isinstance(rl.kv, kvc.StackedKV) and isinstance(ru.kv, list)
    assert rl.kv.num_layers == len(ru.kv) and len(jax.tree.leaves(rl.kv)) == kv_per_layer
    _layers_are_views_of_their_stacks(rl.state)
    assert not hasattr(tiny.model, "layer_stacks")     # the runner's copy holds them
    compiled = (len(rl.executables), len(rl.samplers))
    _outputs(looped, prompts, greedy)
    assert (len(rl.executables), len(rl.samplers)) == compiled              # nothing compiled after warm-up
    bm = looped.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages


def _entry_parameters(hlo_text: str) -> int:
    entry = hlo_text[hlo_text.index("ENTRY"):]
    return entry[:entry.index("\n}\n")].count(" parameter(")


def _layers_are_views_of_their_stacks(state) -> None:
    """Each layer's arrays lie inside their stack's buffer, at row i (no second copy)."""
    for name, stack in state["layer_stacks"].items():
        for j, st in enumerate(jax.tree.leaves(stack)):
            row = st.nbytes // st.shape[0]
            for i in range(st.shape[0]):
                leaf = jax.tree.leaves(state["layers"][i][name])[j]
                assert leaf.unsafe_buffer_pointer() == st.unsafe_buffer_pointer() + i * row, (name, i)


class _Cfg:
    """attention_kwargs / layer_rope per layer, as ModelConfig answers them."""

    def __init__(self, windows):
        self.windows = windows

    def attention_kwargs(self, i):
        return {"sm_scale": 0.25, "sliding_window": self.windows[i], "soft_cap": None}

    def layer_rope(self, i):
        return (10000.0, None)


def test_plan_unrolls_what_it_cannot_loop():
    layers = list(_tiny_model().layers)
    assert layer_loop.plan(layers, _Cfg([None] * 3), lambda w: True) is not None
    assert layer_loop.plan(layers, _Cfg([None, 4, None]), lambda w: True) is None      # sliding + global layers
    assert layer_loop.plan(layers, _Cfg([None] * 3), lambda w: False) is None          # a weight no kernel indexes
    assert layer_loop.plan(layers[:1], _Cfg([None]), lambda w: True) is None           # one layer: nothing to loop
    other = list(_tiny_model(2).layers)
    del other[1].bq                                                                    # layers with other weights
    assert layer_loop.plan(other, _Cfg([None] * 2), lambda w: True) is None
    from jaxinfer.models.gemma3 import Gemma3DecoderLayer
    from jaxinfer.models.mixtral import MoeDecoderLayer

    assert not MoeDecoderLayer.loopable
    assert not Gemma3DecoderLayer.loopable      # (1 + w) norms: not the unrolled bits in a loop
