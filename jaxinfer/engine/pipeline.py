"""Pipeline parallelism: a replica's layers cut into P stages over the mesh's "stage" axis.

Layout. Stage s owns layers [s*L/P, (s+1)*L/P). Every stage runs the same program (one
SPMD step under ``jax.shard_map``), so the weights of the j-th layer of every stage are
stacked into one array [P, ...] split over "stage" (and over "model" as under tensor
parallelism): each device holds only its stage's layers. The KV pages are stacked the
same way, per stage-local layer [P, num_pages, page, KV heads, head dim]: a layer's pages
live on the stage that owns it. Embedding, final norm and LM head are kept by every stage
(replicated over "stage"), so no stage waits for another's vocabulary matmul.

The step. The bucket's sequences are cut into M micro-batches of equal shape (slices of
its decode slots and of its prefill slots; ``micro_batches``; a decode-only step is one),
and the stages run a
forward-only GPipe schedule over M + P - 1 ticks: at tick t stage s runs its layers on
micro-batch t - s, then hands its activations to stage s + 1 with one
``lax.ppermute`` (a collective-permute). So stage s works on micro-batch i while stage
s + 1 works on micro-batch i - 1; the bubble is (P - 1) / (M + P - 1) of the ticks.
The last stage keeps each micro-batch's hidden states at its sampled rows; one psum over
"stage" (an all-reduce of [S, D]) gives them to every stage, which computes the logits.

Exact. Within a micro-batch each token attends exactly as in the unsplit step (the pages
its sequence wrote at earlier ticks of the same stage, and its micro-batch's own), and
every matmul is row-invariant, so a request's tokens and logprobs are the single-device
engine's bits (tests/test_pipeline.py).

Not combined (refused with the reason by engine_config.py / ``check``): LoRA, quantized weights,
multi-step decode, the host KV tier, families whose forward is not the Llama one (the
GPT-style families), and models whose layers differ between stages (a layer pattern that
the stage length does not repeat).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxinfer import sharding as shd
from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine.batch import Bucket, BucketLadders


def check(model: Any, pp: int) -> None:
    """Raise ValueError naming why ``model`` cannot be cut into ``pp`` stages."""
    from jaxinfer.models.llama import LlamaForCausalLM

    cfg = model.cfg
    if cfg.num_layers % pp:
        raise ValueError(f"pipeline_parallel_size={pp} must divide the model's {cfg.num_layers} layers "
                         f"(num_hidden_layers); sizes that work: "
                         f"{', '.join(str(p) for p in range(1, cfg.num_layers + 1) if cfg.num_layers % p == 0)}")
    if not isinstance(model, LlamaForCausalLM) or type(model).__call__ is not LlamaForCausalLM.__call__:
        raise ValueError(f"pipeline_parallel_size={pp}: {cfg.architecture} is not supported (stages "
                         "follow the Llama family's forward: Llama, Mistral, Qwen, Gemma 3)")
    per = cfg.num_layers // pp
    for j in range(per):
        opts = {repr((cfg.attention_kwargs(s * per + j), cfg.layer_rope(s * per + j))) for s in range(pp)}
        if len(opts) > 1:
            raise ValueError(f"pipeline_parallel_size={pp}: layer {j} of each stage has different "
                             "attention options or rope on different stages (the model's layer pattern "
                             f"does not repeat every {per} layers)")


def pipeline_ladders(ladders: BucketLadders, pp: int) -> BucketLadders:
    """Prefill shapes whose slot count P divides, so a prefill step cuts into P equal
    micro-batches: (n, c) -> (n * P, c / P) where P does not divide n (a chunk longer
    than a slot fills consecutive slots: the same tokens, cut finer)."""
    shapes = sorted({(n, c) if n % pp == 0 or c % pp else (n * pp, c // pp) for n, c in ladders.prefill_shapes})
    return dataclasses.replace(ladders, prefill_shapes=tuple(shapes))


@dataclass(frozen=True)
class MicroBatches:
    """A bucket cut into ``num`` micro-batches of one shape (``bucket``): static index tables."""

    num: int
    bucket: Bucket                 # one micro-batch's layout: decode slots, then prefill slots
    tokens: np.ndarray             # i32[M, Tm]: each micro-batch's tokens in the step's T axis
    slots: np.ndarray              # i32[M, Sm]: each micro-batch's slots in the step's S axis
    local_token: np.ndarray        # i32[T]: a token's index within its micro-batch
    slot_order: np.ndarray         # i32[S]: slot g's row in the micro-batches' [M * Sm] outputs


@functools.lru_cache(maxsize=None)
def micro_batches(b: Bucket, pp: int) -> MicroBatches:
    """Cut ``b`` into the most micro-batches (at most ``pp``) that split both its decode
    slots and its prefill slots evenly; micro-batch m takes the m-th slice of each.
    A decode-only step is one micro-batch: memory-bound, it would read every stage's
    weights once per micro-batch (benchmarks/RESULTS.md, "Pipeline parallelism")."""
    D, NP, c = b.num_decode, b.num_prefill, b.prefill_chunk
    M = 1 if NP == 0 else max(m for m in range(1, pp + 1) if D % m == 0 and NP % m == 0)
    d, n = D // M, NP // M
    tokens, slots = [], []
    for m in range(M):
        dec = list(range(m * d, (m + 1) * d))
        pre = list(range(D + m * n, D + (m + 1) * n))
        slots.append(dec + pre)
        tokens.append(dec + [D + (g - D) * c + k for g in pre for k in range(c)])
    tokens_a, slots_a = np.asarray(tokens, np.int32), np.asarray(slots, np.int32)
    local = np.zeros(b.num_tokens, np.int32)
    local[tokens_a.reshape(-1)] = np.tile(np.arange(tokens_a.shape[1], dtype=np.int32), M)
    order = np.zeros(b.num_seqs, np.int32)
    order[slots_a.reshape(-1)] = np.arange(slots_a.size, dtype=np.int32)
    return MicroBatches(M, Bucket.of(d, n, c, b.max_pages), tokens_a, slots_a, local, order)


def stage_model(model: Any, mesh: Any) -> tuple[Any, Any]:
    """(graphdef, state) of a model of L/P layers whose every parameter has a leading stage
    axis split over "stage": layer j's weights of stage s are the full model's layer
    s*L/P + j; embedding, norms and head are the same on every stage. ``model`` is placed
    on ``mesh`` as for tensor parallelism (replicated over "stage"); each device keeps its
    stage's part (the other layers' copies are freed with ``model``)."""
    pp = shd.pp_size(mesh)
    cfg = model.cfg
    per = cfg.num_layers // pp
    scfg = dataclasses.replace(cfg, num_layers=per)
    abstract = nnx.eval_shape(lambda: type(model)(scfg, model.dtype, rngs=nnx.Rngs(0)))
    graphdef, astate = nnx.split(abstract)
    src = dict(nnx.to_flat_state(nnx.state(model)))
    flat = []
    for path, var in nnx.to_flat_state(astate):
        if path[0] == "layers":
            parts = [src[("layers", s * per + path[1], *path[2:])] for s in range(pp)]
        else:
            parts = [src[path]] * pp
        value = jax.tree.map(lambda *xs: _stack_on_stages(xs, mesh), *[v.get_value() for v in parts])
        flat.append((path, var.replace(value=value)))
    return graphdef, nnx.from_flat_state(flat)


def _stack_on_stages(xs: tuple, mesh: Any) -> jax.Array:
    """P arrays of one shape, each on the mesh split over "model" (and so replicated over
    "stage") -> [P, ...] split over "stage" too. Device d of stage s already holds its
    model-axis shard of xs[s]: that shard, with a leading axis, is its block (no copy
    between devices or processes)."""
    sharding = shd.stage_sharding(mesh, getattr(xs[0].sharding, "spec", shd.P()))
    shape = (len(xs), *xs[0].shape)
    blocks = []
    for d, idx in sharding.addressable_devices_indices_map(shape).items():
        src = next(sh.data for sh in xs[idx[0].start or 0].addressable_shards if sh.device == d)
        blocks.append(src[None])
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


def allocate_kv_cache(spec: kvc.KVCacheSpec, mesh: Any) -> kvc.KVCache:
    """Zero pages for each stage-local layer: a list over L/P of (k_pages, v_pages) with a
    leading stage axis, each device allocating its stage's part (split by KV head over
    "model" as kv_cache.allocate_kv_cache does)."""
    pp = shd.pp_size(mesh)
    per_stage = dataclasses.replace(spec, num_layers=spec.num_layers // pp)
    one = jax.eval_shape(lambda: kvc.allocate_kv_cache(per_stage)[0][0])

    def make():
        shapes = jax.tree.map(lambda x: jnp.zeros((pp, *x.shape), x.dtype), one)
        if isinstance(one, kvc.QuantizedPages):
            return kvc.QuantizedPages(shapes.q, jnp.ones_like(shapes.scale))
        return shapes

    out = jax.tree.map(lambda x: shd.stage_sharding(mesh, shd.kv_pages_spec(x.ndim - 1)), jax.eval_shape(make))
    make = jax.jit(make, out_shardings=out)
    return [(make(), make()) for _ in range(per_stage.num_layers)]


def stage_body(graphdef, state, kv, arrays: dict[str, jax.Array], lora_arrays=None, *, bucket: Bucket,
               attention: Callable, mm: Callable, tp_axis: str | None, paged_attention_fn: Callable,
               lora_shape=None) -> tuple[jax.Array, Any]:
    """The pipelined model over the ragged batch -> (logits f32[S, V], kv), per device under
    shard_map over ("stage", "model"); runner.model_body's counterpart (its arguments, and
    runner.paged_attention_fn, which builds a micro-batch's attention callback)."""
    pp = lax.axis_size(shd.STAGE)
    s = lax.axis_index(shd.STAGE)
    squeeze = functools.partial(jax.tree.map, lambda x: x[0])
    model = nnx.merge(graphdef, squeeze(state))
    kv = squeeze(kv)
    cfg = model.cfg
    mb = micro_batches(bucket, pp)
    M, Tm = mb.tokens.shape
    x0 = model.embed_tokens(arrays["tokens"], tp_axis)[mb.tokens]                   # [M, Tm, D]
    positions, slot_mapping = arrays["positions"][mb.tokens], arrays["slot_mapping"][mb.tokens]
    kv_lens, q_lens = arrays["kv_lens"][mb.slots], arrays["q_lens"][mb.slots]      # [M, Sm]
    page_table = arrays["page_table"][mb.slots]                                    # [M, Sm, P]
    rows = jnp.asarray(mb.local_token)[arrays["logits_index"][mb.slots]]           # [M, Sm]
    sink = jnp.zeros(Tm, jnp.int32)         # idle ticks write into page 0, the padding sink

    def tick(t, carry):
        buf, kv, out = carry
        i = t - s
        valid = (i >= 0) & (i < M)
        i = jnp.clip(i, 0, M - 1)
        x = jnp.where(s == 0, x0[i], buf)                                          # [Tm, D]
        attn = paged_attention_fn(attention, mb.bucket, jnp.where(valid, slot_mapping[i], sink),
                                  kv_lens[i], q_lens[i], page_table[i], cfg)
        new_kv = []
        for layer, (cos, sin), c in zip(model.layers, model.rope(positions[i]), kv):
            x, c = layer(x, cos, sin, attn, c, mm, tp_axis)
            new_kv.append(c)
        keep = valid & (s == pp - 1)
        out = lax.dynamic_update_index_in_dim(out, jnp.where(keep, x[rows[i]], out[i]), i, 0)
        buf = lax.ppermute(x, shd.STAGE, [(k, k + 1) for k in range(pp - 1)])
        return buf, new_kv, out

    D = x0.shape[-1]
    carry = (jnp.zeros((Tm, D), x0.dtype), kv, jnp.zeros((M, mb.slots.shape[1], D), x0.dtype))
    _, kv, out = lax.fori_loop(0, M + pp - 1, tick, carry)
    hidden = lax.psum(out, shd.STAGE).reshape(-1, D)[mb.slot_order]                # [S, D]
    logits = model.final_logits(hidden, mm)                                        # [S, V_local]
    if tp_axis is not None:
        logits = lax.all_gather(logits, tp_axis, axis=1, tiled=True)
    return logits, jax.tree.map(lambda x: x[None], kv)
