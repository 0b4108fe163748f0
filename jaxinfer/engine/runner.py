"""The model runner: one replica's device state and its table of executables per bucket,
compiled ahead of time (``StepCompiler``), executed on a step's host arrays (engine/batch.py).

One step = two executables back to back, both on device: the forward over the ragged
batch (one per bucket; KV pages, penalty state and the logits buffer donated, updated in
place) and the sampler (one per slot count S, by default one for every bucket), which
returns one packed i32[S, 2 + 2K] array: a single device->host copy per step.

Tensor parallelism: with a mesh whose "model" axis is > 1 the forward's model body runs
under ``jax.shard_map`` (weights and KV pages sharded as sharding.py says, the step's
arrays replicated, the logits all-gathered); the sampler runs replicated on every device
of the mesh. With several processes (jax.distributed), process 0 publishes every step's
host arrays (engine/multihost.py) and the others replay them: all run the same step.

After ``compile_all`` the runner only calls ``Compiled`` objects: a compile after warm-up
is impossible by construction for a known bucket, and an unknown bucket raises.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxinfer import matmul as M
from jaxinfer import quantization
from jaxinfer.models.config import ModelConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer import sharding as shd
from jaxinfer.attention import dispatch
from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine import resources
from jaxinfer.engine import sampler as S
from jaxinfer.engine import scoring
from jaxinfer.engine.batch import Bucket, StepBatch, as_device_args, step_args, step_array_shapes
from jaxinfer.models import layer_loop as layer_loop_mod
from jaxinfer.models import layers as L
from jaxinfer.models.llama import LlamaForCausalLM

log = logging.getLogger("jaxinfer")

NUM_LOGPROBS = SamplingParams.MAX_LOGPROBS   # top-K capacity of every executable


def paged_attention_fn(attention: Callable, bucket: Bucket, slot_mapping, kv_lens, q_lens,
                       page_table, cfg: ModelConfig, alibi_slopes=None, layer_loop: bool = False):
    """AttentionFn for the model: write this step's K/V into the pages, then attend with
    the layer's options (scale, sliding window, soft-cap: ModelConfig.attention_kwargs).
    ``alibi_slopes`` f32[this device's heads] for ALiBi models (the jnp and C++ paths take them)."""
    extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}

    def attn(layer: int, q, k, v, cache):
        k_pages, v_pages = kvc.write_kv(cache[0], cache[1], k, v, slot_mapping)
        o = attention(q, k_pages, v_pages, kv_lens, q_lens, page_table,
                      num_decode=bucket.num_decode, prefill_chunk=bucket.prefill_chunk,
                      **cfg.attention_kwargs(layer), **extra)
        return o, (k_pages, v_pages)

    if layer_loop:
        # The layer loop's form (models/layer_loop.py): ``cache`` is (every layer's K pages,
        # every layer's V pages) and ``layer`` a traced index; the indexed forms
        # (attention/dispatch.py) write and read that layer's pages in place. Uniform
        # attention options (layer_loop.plan checks), so layer 0's.
        def attn_loop(layer, q, k, v, cache):
            ks, vs = kvc.write_kv_layer(cache[0], cache[1], k, v, slot_mapping, layer)
            o = dispatch.ragged_paged_attention_layer(
                q, ks, vs, layer, kv_lens, q_lens, page_table, num_decode=bucket.num_decode,
                prefill_chunk=bucket.prefill_chunk, **cfg.attention_kwargs(0), **extra)
            return o, (ks, vs)

        attn.layer_loop = attn_loop
    return attn


def _update_penalty_state(pen, t: S.SamplingTensors, a: dict[str, jax.Array]):
    """Fold this step's fed tokens into the per-row penalty state (bool/i32 [R, V]).

    Prompt presence and output counts are rebuilt from the tokens as they are fed, so a
    sequence resumed after preemption (which re-feeds prompt + outputs) gets them back
    exactly. Skipped entirely (lax.cond) when no row has a penalty.
    """

    def update(pen):
        pm, oc = pen
        reset = jnp.where(a["reset_rows"], a["rows"], 0)          # row 0 is the padding sink
        pm = pm.at[reset].set(False)
        oc = oc.at[reset].set(0)
        # a speculating sequence's accepted drafts of its previous step (fed uncounted)
        oc = S.add_counts(oc, a["rows"], t.counts_add[:a["rows"].shape[0]])
        is_out = a["token_is_output"]
        pm = pm.at[a["token_rows"], a["tokens"]].max(~is_out)
        oc = oc.at[a["token_rows"], a["tokens"]].add(is_out.astype(jnp.int32))
        return pm, oc

    return lax.cond(S.any_penalty(t), update, lambda p: p, pen)


def model_body(graphdef, state, kv, arrays: dict[str, jax.Array], lora_arrays=None, *, bucket: Bucket,
               attention: Callable, mm: Callable, tp_axis: str | None, lora_shape=None,
               offload_layers: tuple[int, ...] = (), layer_loop: bool = False):
    """The model over the ragged batch -> (logits f32[S, V], kv); a scoring bucket's
    logits are every token position's, f32[T, V]. Per device under shard_map.
    ``lora_arrays`` / ``lora_shape`` (slots, rank): the LoRA slot arrays (lora_device.py);
    ``offload_layers``: layers whose weights are in host memory (offload.py)."""
    model: LlamaForCausalLM = nnx.merge(graphdef, state)
    if lora_shape is not None:
        from jaxinfer.engine.lora_device import bind

        bind(model, lora_arrays, arrays["lora_slots"], *lora_shape)
    cfg = model.cfg
    alibi = L.model_alibi_slopes(cfg)
    attn = paged_attention_fn(attention, bucket, arrays["slot_mapping"], arrays["kv_lens"],
                              arrays["q_lens"], arrays["page_table"], cfg,
                              None if alibi is None else L.local_heads(alibi, tp_axis),
                              layer_loop=layer_loop and lora_shape is None and not offload_layers)
    if offload_layers:
        from jaxinfer.engine import offload

        attn = offload.bind(model, attn, offload_layers)
    index = None if bucket.score else arrays["logits_index"]
    return model(arrays["tokens"], arrays["positions"], kv, attn, index, mm, tp_axis)


def feed_kept(arrays: dict[str, jax.Array], last_tokens: jax.Array) -> dict[str, jax.Array]:
    """The step's tokens with each ``feed_rows`` position (>= 0) taken from ``last_tokens``
    i32[R] (the token the previous step sampled for that penalty-state row, kept on the
    device): the overlapped loop dispatches a step before the last one's tokens reach the
    host, and they go from one step to the next without a host round trip."""
    feed = arrays["feed_rows"]
    tokens = jnp.where(feed >= 0, last_tokens[jnp.maximum(feed, 0)], arrays["tokens"])
    return dict(arrays, tokens=tokens)


def keep_fn(last_tokens: jax.Array, packed: jax.Array, keep_rows: jax.Array) -> jax.Array:
    """``last_tokens`` i32[R] with each sampler row's token (packed i32[S', 2 + 2K], column
    0) stored at its ``keep_rows`` entry (-1: not kept)."""
    R = last_tokens.shape[0]
    return last_tokens.at[jnp.where(keep_rows >= 0, keep_rows, R)].set(packed[:, 0], mode="drop")


def forward_fn(graphdef, state_def, state_leaves, kv, pen, logits_buf, last_tokens, arrays: dict[str, jax.Array],
               t: S.SamplingTensors, lora_arrays=None, *, bucket: Bucket, attention: Callable, mm: Callable,
               mesh=None, state_specs=None, kv_specs=None, lora_shape=None, lora_specs=None,
               body_fn: Callable = model_body, **body_opts):
    """One executable per bucket: the model over the ragged batch -> logits f32[S', V],
    kv, penalty state (and a scoring bucket's prompt scores, packed i32[T, 2 + 2K]:
    engine/scoring.py). The weights come as a flat list (``state_leaves`` of the treedef
    ``state_def``): flattening the nnx State on every call is Python work on every step.

    The logits go into rows [0, S) of ``logits_buf`` f32[S', V] (donated: written in
    place), S' = ``bucket.sample_rows``: the sampler's width, by default the same for every
    bucket (one sampler executable, ~26 MiB resident each on CPU). Rows [S, S') keep what
    an earlier step left there; they are padding rows to the sampler, which reads them
    only in blocks it never returns (each row's result depends on that row alone), so
    padding a batch-1 step to S' rows costs no [S', V] write per step."""
    state = jax.tree.unflatten(state_def, state_leaves)
    arrays = feed_kept(arrays, last_tokens)
    body = functools.partial(body_fn, graphdef, bucket=bucket, attention=attention,
                             mm=mm, tp_axis=None if mesh is None else shd.MODEL, lora_shape=lora_shape,
                             **body_opts)
    if mesh is not None:
        # check_vma off: the logits leave replicated by construction (all-gathered), which
        # the varying-axes checker cannot see through the attention's index arithmetic.
        body = jax.shard_map(body, mesh=mesh, in_specs=(state_specs, kv_specs, shd.P(), lora_specs),
                             out_specs=(shd.P(), kv_specs), check_vma=False)
    logits, kv = body(state, kv, arrays, lora_arrays)
    scores = None
    if bucket.score:
        scores = scoring.score_rows(logits, arrays["score_targets"], arrays["score_k"], NUM_LOGPROBS)
        logits = logits[arrays["logits_index"]]
    logits = lax.dynamic_update_slice(logits_buf, logits.astype(logits_buf.dtype), (0, 0))   # [S', V]
    out = (logits, kv, _update_penalty_state(pen, t, arrays))
    return out + (scores,) if bucket.score else out


def multi_decode_fn(graphdef, state_def, state_leaves, kv, pen, arrays: dict[str, jax.Array],
                    t: S.SamplingTensors, num_steps: jax.Array, sample_rows: jax.Array,
                    lora_arrays=None, *, bucket: Bucket, max_steps: int, page_size: int,
                    attention: Callable, mm: Callable, lora_shape=None, offload_layers: tuple[int, ...] = (),
                    greedy_only: bool = False, layer_loop: bool = False):
    """Multi-step decode (``EngineConfig.num_scheduler_steps``): up to ``max_steps`` decode
    steps of a decode-only bucket in one executable, each step's sampled tokens fed to the
    next on the device -> packed i32[max_steps, S'', 2 + 2K] (S'' = num_decode rounded up to
    a power of two; rows past ``num_steps`` are zeros), kv, penalty state.

    Why: at batch 1 the host's share of a step (scheduling, batch building, the call with
    its ~400 arguments, post-processing) is a large fraction of the step (figures in
    benchmarks/RESULTS.md); here it is paid once per ``num_steps`` tokens.

    Step i is exactly step 0 of the single-step path for the sequence's next position:
    the same forward, penalty update and sampler, so the tokens are the same as
    ``num_steps`` separate steps (tests/test_multi_step.py). The host allocated pages for
    every position up to ``num_steps`` ahead (the page table covers them); padding slots
    keep writing into the sink page 0.

    ``greedy_only`` (a speculative draft's runner, ``samples=False``): each step's token is
    the argmax (``sampler.greedy_output``: the bits ``t``'s all-greedy rows would give), no
    logprobs, no penalty-state update; the sampler is not compiled into the loop.
    """
    state = jax.tree.unflatten(state_def, state_leaves)
    # The sampler inside the loop is this executable's own: it samples num_decode rounded
    # up to a power of two, not the single-step sampler's (possibly wider) shared width.
    D, Sp = bucket.num_decode, bucket.natural_sample_rows
    t = jax.tree.map(lambda a: a[:Sp], t)
    sample_rows = sample_rows[:Sp]
    live = arrays["q_lens"] > 0                                     # bool[D]
    width = 2 + 2 * NUM_LOGPROBS

    def body(i, carry):
        kv, pen, tokens, out = carry
        a, ti = _decode_step_inputs(arrays, t, tokens, i, live, page_size, Sp - D)
        logits, kv = model_body(graphdef, state, kv, a, lora_arrays, bucket=bucket, attention=attention,
                                mm=mm, tp_axis=None, lora_shape=lora_shape, offload_layers=offload_layers,
                                layer_loop=layer_loop)
        logits = jnp.pad(logits, ((0, Sp - D), (0, 0)))
        if greedy_only:        # a draft: no penalty state to keep, no sampler in the loop
            res = S.greedy_output(logits, NUM_LOGPROBS)
        else:
            pen = _update_penalty_state(pen, ti, a)
            res = S.sample(logits, ti, NUM_LOGPROBS, prompt_mask=pen[0], output_counts=pen[1],
                           penalty_rows=sample_rows)
        out = lax.dynamic_update_index_in_dim(out, S.pack(res), i, 0)
        return kv, pen, res.token_ids[:D], out

    out = jnp.zeros((max_steps, Sp, width), jnp.int32)
    kv, pen, _, out = lax.fori_loop(0, jnp.minimum(num_steps, max_steps), body,
                                    (kv, pen, arrays["tokens"], out))
    return out, kv, pen


def _decode_step_inputs(arrays: dict[str, jax.Array], t: S.SamplingTensors, tokens: jax.Array, i: jax.Array,
                        live: jax.Array, page_size: int, pad: int) -> tuple[dict[str, jax.Array], S.SamplingTensors]:
    """Step ``i`` of a multi-step decode from step 0's inputs: each live slot fed the
    token step i - 1 sampled (``tokens``), one position further on (its KV slot from the
    page table); penalty rows reset and accepted drafts' counts folded in at step 0 only.
    ``pad``: the sampler's rows past the D slots."""
    step = jnp.where(live, i, 0)
    pos = arrays["positions"] + step                             # i32[D]
    page = jnp.take_along_axis(arrays["page_table"], (pos // page_size)[:, None], axis=1)[:, 0]
    a = dict(arrays, tokens=tokens, positions=pos, kv_lens=arrays["kv_lens"] + step,
             slot_mapping=jnp.where(live, page * page_size + pos % page_size, arrays["slot_mapping"]),
             reset_rows=arrays["reset_rows"] & (i == 0),
             token_is_output=jnp.where(i == 0, arrays["token_is_output"], live))
    ti = dataclasses.replace(t, step=t.step + jnp.pad(step, (0, pad)),
                             prev_token=jnp.pad(tokens, (0, pad)),     # the watermark's seed
                             counts_add=jnp.where(i == 0, t.counts_add, -1))     # folded once
    return a, ti


def _jit(fn: Callable, **kw: Any) -> Any:
    """``jax.jit`` of a fresh wrapper of ``fn``: the traces and lowered modules JAX caches
    under the function are freed with the wrapper once the compile is done."""
    return jax.jit(functools.partial(fn), **kw)


def sample_fn(logits, pen, rows, t: S.SamplingTensors, mask: S.TokenMask):
    """One executable per sampler width S' (Bucket.sample_rows), not per bucket: the
    sampler is slow to compile. logits [S', V], rows i32[S'] (each slot's penalty-state
    row), mask: the step's TokenMask (always passed, all-allowed when no row is
    constrained, so one executable serves both) -> packed i32[S', 2 + 2K]."""
    out = S.sample(logits, t, NUM_LOGPROBS, prompt_mask=pen[0], output_counts=pen[1], penalty_rows=rows,
                   token_mask=mask)
    return S.pack(out)


def compile_sampler(vocab_size: int, num_rows: int, width: int, options: dict | None,
                    device: Any = None) -> Any:
    """``sample_fn``'s executable for ``width`` rows over a vocabulary of ``vocab_size``,
    with ``num_rows`` penalty-state rows, on ``device`` (None: the default one). From shapes
    alone: it holds no weights, so an engine compiles it before it loads them (why: its
    compile is the largest transient of a cold start, ~+290 MiB for the default model's,
    and with no weights resident yet that peak stays under the later ones; RESULTS.md "The
    KV pool stacked")."""
    from jaxinfer.engine.guided import empty_mask

    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)   # noqa: E731
    like = lambda tree: jax.tree.map(lambda x: spec(np.shape(x), x.dtype), tree)         # noqa: E731
    pen = (spec((num_rows, vocab_size), np.bool_), spec((num_rows, vocab_size), np.int32))
    t = like(S.sampling_tensors_from_params([], [], [], width))
    m = empty_mask(width, vocab_size)
    mask = like(S.TokenMask(m.bits, m.bias_ids, m.bias_vals, m.active))
    return _jit(sample_fn).lower(spec((width, vocab_size), np.float32), pen, spec((width,), np.int32), t,
                                 mask).compile(options)


def _zeros(shape: tuple[int, ...], dtype: Any, mesh: Any) -> jax.Array:
    """A zero-filled array: on the default device, or replicated over ``mesh``."""
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return _jit(lambda: jnp.zeros(shape, dtype), out_shardings=shd.replicated(mesh))()


def _body_opts(lora: Any, offload_layers: tuple[int, ...], layer_loop: bool, pipelined: bool) -> dict[str, Any]:
    """The options ``model_body`` takes (through forward_fn and multi_decode_fn)."""
    opts: dict[str, Any] = {} if lora is None else {"lora_shape": (lora.num_slots, lora.rank)}
    if offload_layers:   # weights in host memory, streamed a layer ahead (offload.py)
        opts["offload_layers"] = tuple(offload_layers)
    if layer_loop:
        opts["layer_loop"] = True
    if pipelined:        # each stage's layers attend through the pipeline's own loop
        opts["paged_attention_fn"] = paged_attention_fn
    return opts


class ModelRunner:
    """One engine replica's device side: its state (weights, KV pages, penalty state) and
    a table of executables per bucket, which a step only reads:

    * ``executables``: each bucket's forward (``forward_fn``);
    * ``multi_executables``: each decode-only bucket's multi-step decode
      (``multi_decode_fn``; runners with num_scheduler_steps > 1);
    * ``samplers``: the sampler of each width S' (``sample_fn``), shared by the buckets of
      that width, and ``logits_bufs``: the f32[S', V] logits its forwards rewrite.

    ``compile_bucket`` fills a bucket's entries (``StepCompiler``, from abstract
    arguments; engine/warmup.py decides when); ``dispatch`` / ``dispatch_multi`` run a
    step's host arrays (engine/batch.py) through them, and a bucket not there raises.

    ``mesh``: the replica's ("data"=1, "model"=tp) mesh, or None for the default device.
    ``publisher``: process 0's step broadcaster under jax.distributed.
    A draft model's runner (engine/spec_draft.py) never samples through the sampler
    executables (``samples=False``: none compiled; its multi-step decode takes argmax
    tokens) and needs multi-step executables only for decode buckets of at most
    ``multi_decode_seqs`` slots (None: every one)."""

    def __init__(self, model: LlamaForCausalLM, spec: kvc.KVCacheSpec, num_rows: int,
                 attention: str = "auto", batch_invariant: bool = True, mesh=None,
                 publisher: Any = None, num_scheduler_steps: int = 1, lora: Any = None,
                 offload_layers: tuple[int, ...] = (), samples: bool = True,
                 multi_decode_seqs: int | None = None, layer_loop: bool = False, kv_pool: bool = True,
                 stack_kv: bool = True):
        """``kv_pool`` False: no KV pool of its own (a draft that steps on the target's
        pages, engine/spec_draft.py, sets ``kv`` before each call). ``stack_kv`` False: keep
        the per-layer pool even where the layers loop (a draft steps on its first layers)."""
        if num_scheduler_steps > 1 and (mesh is not None or publisher is not None):
            raise ValueError("num_scheduler_steps > 1: multi-step decode runs on a single device "
                             "(no mesh, one process) for now")
        self.cfg, self.spec, self.mesh, self.publisher, self.num_rows = model.cfg, spec, mesh, publisher, num_rows
        self.num_scheduler_steps = num_scheduler_steps
        self.lora = lora          # lora_device.LoraSlots of this replica (multi-LoRA), or None
        self.samples, self.multi_decode_seqs = samples, multi_decode_seqs
        # False: the runner steps only through its multi-step decode (a draft that shares
        # the target's KV pool: engine/spec_draft.py), so no single-step forwards compile
        self.forwards = True
        pipelined = shd.pp_size(mesh) > 1
        self.attention_name, attn_impl = dispatch.select(attention, kv_quantized=spec.quantized,
                                                         kv_dtype=spec.dtype,
                                                         alibi=L.model_alibi_slopes(self.cfg) is not None)
        # EngineConfig.layer_loop: the C++ paged attention (float32 or int8 pages),
        # no LoRA, offload or pipeline stages; the model unrolls when its layers do not fit
        # (models/layer_loop.py)
        self.layer_loop = bool(layer_loop and dispatch.can_index(self.attention_name) and not pipelined
                               and lora is None and not offload_layers)
        model = self._stack_layers(model, stack_kv)
        self._place_weights(model, offload_layers, pipelined)
        V = self.cfg.vocab_size
        self.pen = (_zeros((num_rows, V), bool, mesh), _zeros((num_rows, V), jnp.int32, mesh))
        # i32[num_rows]: each row's last sampled token, kept on the device (feed_kept)
        self.last_tokens = _zeros((num_rows,), jnp.int32, mesh)
        self.kv = self._allocate_kv(kv_pool, pipelined)
        # With a mesh the sampler runs on one device of this process (the logits are
        # replicated, so any copy will do): sampling on every device would repeat the same
        # work, and XLA:CPU's TopkDecomposer crashes compiling the sampler's barrier-wrapped
        # top-k for several devices. Followers (multi-process) do not sample at all.
        self.sample_device = None if mesh is None else next(
            d for d in mesh.devices.flat if d.process_index == jax.process_index())
        self.step_compiler = StepCompiler(self, model, attn_impl, batch_invariant,
                                          _body_opts(lora, offload_layers, self.layer_loop, pipelined))
        self.executables: dict[Bucket, Any] = {}
        self.multi_executables: dict[Bucket, Any] = {}     # decode-only buckets, multi-step
        self.samplers: dict[int, Any] = {}
        self.keepers: dict[int, Any] = {}     # keep_fn per sampler width
        # f32[S', V] per sampler width S': the forwards' logits, donated and rewritten in place
        self.logits_bufs: dict[int, jax.Array] = {}
        self._empty_masks: dict[int, S.TokenMask] = {}
        self.compile_seconds = 0.0
        self.last_logits: jax.Array | None = None
        self.last_scores: jax.Array | None = None
        self.page_mover: Any = None       # kv_offload.PageMover, with a host tier or poisoning

    def _stack_layers(self, model: LlamaForCausalLM, stack_kv: bool) -> LlamaForCausalLM:
        """The model with the layer loop's weight stacks (models/layer_loop.py): on one
        device every layer's weights stacked once (one loop operand per array, not per
        layer: ~4 MiB less per step executable), held by this runner's copy of the model.
        Sets ``stacked_kv``: the pool as one [L, ...] array per kind where the loop runs on
        one device (the same reason, engine/kv_cache.py StackedKV); the unrolled model takes
        per-layer pages."""
        stacks = None
        if self.layer_loop and self.mesh is None:
            # Before the model is split: nothing here may hold the layers' old buffers
            # while their stacks are made.
            stacks = layer_loop_mod.stack_weights(model, M.can_index)
            if stacks:
                model = nnx.merge(*nnx.split(model))
                model.layer_stacks = nnx.Dict(stacks)
        self.stacked_kv = bool(stacks and stack_kv)
        return model

    def _place_weights(self, model: LlamaForCausalLM, offload_layers: tuple[int, ...], pipelined: bool) -> None:
        """``graphdef`` and ``state`` (the weights), cut into stages over the mesh's "stage"
        axis where the layers are pipelined, the layers of ``offload_layers`` in host memory
        (offload.py); ``state_leaves``: the flat list every step passes."""
        if pipelined:
            from jaxinfer.engine import pipeline

            pipeline.check(model, shd.pp_size(self.mesh))
            self.graphdef, self.state = pipeline.stage_model(model, self.mesh)
        else:
            self.graphdef, self.state = nnx.split(model)
        if offload_layers:
            from jaxinfer.engine import offload

            self.state = offload.place(self.state, offload_layers)
        self.state_leaves, self.state_def = jax.tree.flatten(self.state)

    def _allocate_kv(self, kv_pool: bool, pipelined: bool) -> Any:
        """The KV pool: on the default device (None without a pool of its own), sharded over
        the mesh, or cut into the pipeline's stages."""
        if self.mesh is None:
            return kvc.allocate_kv_cache(self.spec, untouched=True, stacked=self.stacked_kv) if kv_pool else None
        if pipelined:
            from jaxinfer.engine import pipeline

            return pipeline.allocate_kv_cache(self.spec, self.mesh)
        return kvc.allocate_kv_cache(self.spec, self.mesh)

    def enable_page_moves(self, num_host_slots: int, host: bool = True) -> float:
        """A host pool of ``num_host_slots`` pages and the page-copy executables, compiled
        now (start-up); ``host`` False: only the device-to-device copy (beam search).
        Returns the seconds compiling took."""
        from jaxinfer.engine.kv_offload import PageMover

        self.page_mover = PageMover(self.kv, num_host_slots, self.mesh)
        secs = self.page_mover.compile(self.kv, host)
        self.compile_seconds += secs
        return secs

    def apply_page_ops(self, ops: list, poison: bool = False) -> None:
        """Run the block manager's page moves (block_manager.PageOp, in order) on the cache,
        before the next forward; "poison" ops only when ``poison`` (tests)."""
        if ops:
            self.kv = self.page_mover.apply(self.kv, ops, poison)

    def _lora_arrays(self) -> dict:
        """The LoRA slot arrays the executables take ({} without LoRA)."""
        return {} if self.lora is None else self.lora.arrays

    # ---- the table ----------------------------------------------------------------
    def compile_all(self, buckets: list[Bucket], progress: Callable[[int, int, Bucket], None] | None = None) -> float:
        """AOT-compile one executable per bucket; returns the seconds it took."""
        t0 = time.perf_counter()
        for i, b in enumerate(buckets):
            self.compile_bucket(b)
            if progress:
                progress(i + 1, len(buckets), b)
        return time.perf_counter() - t0

    def is_compiled(self, b: Bucket) -> bool:
        """Every executable a step in ``b`` may call is there (read by the batch builder
        while a background thread compiles: each is stored once it is complete)."""
        return (not self.forwards or b in self.executables) and (
            not self.samples or (b.sample_rows in self.samplers and b.sample_rows in self.keepers)) and (
            not self._has_multi(b) or b in self.multi_executables)

    def _has_multi(self, b: Bucket) -> bool:
        """Bucket ``b`` gets a multi-step executable (decode-only buckets, multi-step runners)."""
        return self.num_scheduler_steps > 1 and b.num_prefill == 0 and (
            self.multi_decode_seqs is None or b.num_decode <= self.multi_decode_seqs)

    def compile_bucket(self, b: Bucket) -> None:
        """Compile what a step in bucket ``b`` needs and is not there yet: its forward, the
        sampler of its width, and (multi-step engines, decode-only buckets) its multi-step
        executable. Callers serialize calls (engine/warmup.py holds one lock)."""
        t0 = time.perf_counter()
        if self.forwards and b not in self.executables:
            if b.sample_rows not in self.logits_bufs:
                self.logits_bufs[b.sample_rows] = _zeros((b.sample_rows, self.cfg.vocab_size), jnp.float32,
                                                         self.mesh)
            self.executables[b] = self.step_compiler.forward(b)
        if self.samples and b.sample_rows not in self.samplers:
            self.samplers[b.sample_rows] = self.step_compiler.sampler(b.sample_rows)
        if self.samples and b.sample_rows not in self.keepers:
            self.keepers[b.sample_rows] = self.step_compiler.keeper(b.sample_rows)
        if self._has_multi(b) and b not in self.multi_executables:
            self.multi_executables[b] = self.step_compiler.multi_decode(b, self.num_scheduler_steps)
        self.compile_seconds += time.perf_counter() - t0

    def lower_forward(self, b: Bucket) -> Any:
        """Bucket ``b``'s forward, lowered (jax.stages.Lowered) from abstract arguments."""
        return self.step_compiler.lower_forward(b)

    # ---- a step -------------------------------------------------------------------
    def empty_mask(self, rows: int) -> S.TokenMask:
        """The all-allowed TokenMask of ``rows`` rows, made once per width and kept on the
        device, so unconstrained steps pass it without a host->device copy."""
        if rows not in self._empty_masks:
            from jaxinfer.engine.guided import empty_mask

            m = empty_mask(rows, self.cfg.vocab_size)
            dev = self.sample_device or jax.local_devices()[0]
            self._empty_masks[rows] = jax.device_put(S.TokenMask(m.bits, m.bias_ids, m.bias_vals, m.active), dev)
        return self._empty_masks[rows]

    def dispatch(self, batch: StepBatch) -> jax.Array:
        """Enqueue one step on the device and return at once (JAX dispatch is asynchronous),
        so several data-parallel replicas' steps run concurrently; ``fetch`` waits. The
        step's token mask (``batch.token_mask``) is built after the forward is enqueued,
        so the host computes grammar masks while the device runs."""
        if batch.bucket not in self.executables:
            raise RuntimeError(f"bucket {batch.bucket} was not compiled at start-up")
        b = batch.bucket
        host = step_args(batch)
        if self.publisher is not None:
            self.publisher.publish(b, host)       # followers do not sample: no mask for them
        return self.run_host_step(b, host, mask_fn=batch.token_mask)

    def dispatch_multi(self, batch: StepBatch, num_steps: int) -> jax.Array:
        """Enqueue ``num_steps`` (2..num_scheduler_steps) decode steps of a decode-only batch
        (multi_decode_fn); ``fetch`` returns i32[num_scheduler_steps, S', 2 + 2K]."""
        b = batch.bucket
        if b not in self.multi_executables:
            raise RuntimeError(f"bucket {b} has no multi-step executable (decode-only buckets with "
                               f"num_scheduler_steps > 1 are compiled at start-up)")
        if not 1 <= num_steps <= self.num_scheduler_steps:
            raise ValueError(f"num_steps: must be in [1, {self.num_scheduler_steps}], got {num_steps}")
        out, self.kv, self.pen = self.multi_executables[b](
            self.state_leaves, self.kv, self.pen, as_device_args(batch), batch.sampling, np.int32(num_steps),
            batch.sample_rows, self._lora_arrays())
        return out

    def run_host_step(self, b: Bucket, host: dict[str, Any], sample: bool = True,
                      mask_fn: Callable[[], S.TokenMask | None] | None = None) -> jax.Array:
        """The step from its host arrays (followers replay it under jax.distributed, with
        ``sample=False``: they return the logits, only to wait on them)."""
        if self.mesh is None:
            # Host numpy goes straight into the executables: they copy their arguments in
            # C++, where jax.device_put of the ~25 small arrays is Python per array, a
            # visible share of a batch-1 step (RESULTS.md, "Design measurements").
            dev = host
        else:
            rep = shd.replicated(self.mesh)
            dev = jax.tree.map(lambda x: shd.put(x, rep), host)
        logits, self.kv, self.pen, *scores = self.executables[b](
            self.state_leaves, self.kv, self.pen, self.logits_bufs[b.sample_rows], self.last_tokens,
            dev["arrays"], dev["t"], self._lora_arrays())
        self.logits_bufs[b.sample_rows] = logits
        # f32[S', V] on device (rows >= the bucket's num_seqs: stale), for tests and
        # debugging (no copy); the next step in a bucket of this width donates it
        self.last_logits = logits
        self.last_scores = scores[0] if scores else None   # a scoring bucket's i32[T, 2 + 2K]
        if not sample:
            return logits
        mask = (mask_fn() if mask_fn else None) or self.empty_mask(b.sample_rows)
        if self.mesh is not None:
            mask = jax.device_put(mask, self.sample_device)
        args = (logits, self.pen, dev["sample_rows"], dev["t"])
        if self.mesh is not None:
            args = jax.tree.map(self._on_sample_device, args)
        packed = self.samplers[b.sample_rows](*args, mask)
        self._keep(b.sample_rows, packed, dev["keep_rows"])
        return packed

    def _keep(self, width: int, packed: jax.Array, keep_rows: Any) -> None:
        """Keep the step's sampled tokens on the device for the next step (keep_fn): on
        the sampling device, then replicated over the mesh again for the forward."""
        if self.mesh is None:
            self.last_tokens = self.keepers[width](self.last_tokens, packed, keep_rows)
            return
        if self.publisher is not None:
            # several processes run synchronous steps (nothing is fed from the device), and
            # the mesh spans hosts the sampling device cannot send to
            return
        last = self._on_sample_device(self.last_tokens)
        kept = self.keepers[width](last, packed, self._on_sample_device(keep_rows))
        self.last_tokens = shd.put(kept, shd.replicated(self.mesh))

    def _on_sample_device(self, x: jax.Array) -> jax.Array:
        """This device's copy of a replicated array (no transfer)."""
        return next(s.data for s in x.addressable_shards if s.device == self.sample_device)

    def state_alive(self) -> bool:
        """Whether the device state the next step needs (KV pages, penalty state) is intact:
        after a failed step, a call that was handed them (donated) and raised leaves them
        deleted or holding the device's error."""
        leaves = jax.tree.leaves((self.kv, self.pen))
        try:
            if any(x.is_deleted() for x in leaves):
                return False
            jax.block_until_ready(leaves)
        except Exception:   # noqa: BLE001 - the device's own error: the state is gone
            log.exception("device state check failed")
            return False
        return True

    @staticmethod
    def fetch(packed: jax.Array) -> np.ndarray:
        return np.asarray(packed)

    def fetch_scores(self) -> np.ndarray:
        """The last step's prompt scores (a scoring bucket's; engine/scoring.py), on the host."""
        if self.last_scores is None:
            raise RuntimeError("fetch_scores: the last step did not run in a scoring bucket")
        return np.asarray(self.last_scores)


class StepCompiler:
    """The compile side of a runner: its step functions, with the model's structure, the
    attention and the matmul bound, lowered from abstract arguments (shapes, dtypes,
    shardings) and compiled. It never reads the live device state: the KV pool's and
    penalty state's abstract forms are taken once, from the arrays as allocated, so a
    background compile runs while steps donate them.

    Each compile jits its step function afresh (``_jit``): JAX caches a function's traces
    and lowered modules for as long as its jit object lives, ~3 MiB per forward and ~9 MiB
    per sampler on the default model that nothing reads after the compile (measured: 92
    MiB once every bucket had compiled)."""

    def __init__(self, runner: ModelRunner, model: LlamaForCausalLM, attn_impl: Callable, batch_invariant: bool,
                 body_opts: dict[str, Any]):
        """From ``runner``'s placed weights and allocated state (``model``: its copy, for
        the matmul and the compiler options its quantized path needs)."""
        mesh, lora, pipelined = runner.mesh, runner.lora, shd.pp_size(runner.mesh) > 1
        mm = M.select(batch_invariant, quantized=quantization.is_quantized(model))
        if lora is not None:
            from jaxinfer.engine.lora_device import with_lora

            mm = with_lora(mm)
        self.options = resources.compiler_options(model)
        self.sampler_options = resources.compiler_options()      # no weights in it
        self.mesh, self.lora, self.cfg = mesh, lora, runner.cfg
        self.num_rows, self.sample_device = runner.num_rows, runner.sample_device
        specs = lambda tree: None if mesh is None else jax.tree.map(lambda x: x.sharding.spec, tree)  # noqa: E731
        body_fn = model_body
        if pipelined:
            from jaxinfer.engine import pipeline

            body_fn = pipeline.stage_body
        self.forward_fn = functools.partial(forward_fn, runner.graphdef, runner.state_def, attention=attn_impl,
                                            mm=mm, mesh=mesh, state_specs=specs(runner.state),
                                            kv_specs=specs(runner.kv), lora_specs={} if lora is None else lora.specs(),
                                            body_fn=body_fn, **body_opts)
        self.multi_fn = functools.partial(multi_decode_fn, runner.graphdef, runner.state_def, attention=attn_impl,
                                          mm=mm, page_size=runner.spec.page_size, greedy_only=not runner.samples,
                                          **body_opts)
        # (no pool of its own: the layout of the pages it is lent, one device)
        kv = kvc.abstract_kv_cache(runner.spec, runner.stacked_kv) if runner.kv is None else runner.kv
        self.state = [self._abstract(x) for x in runner.state_leaves]
        self.kv, self.pen = jax.tree.map(self._abstract, kv), jax.tree.map(self._abstract, runner.pen)

    def _abstract(self, x, sharding=None):
        """ShapeDtypeStruct of x: with x's own sharding (device arrays) or the given one."""
        if self.mesh is None:
            kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
            # weights offloaded to host memory (offload.py) keep their memory kind
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if kind not in (None, "device") else None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)

    def _step_args(self, b: Bucket) -> tuple:
        """The abstract step arrays, sampling tensors and LoRA slot arrays of bucket ``b``."""
        rep = None if self.mesh is None else shd.replicated(self.mesh)
        host = lambda shape, dt: self._abstract(np.empty(shape, dt), rep)   # noqa: E731
        arrays = {k: host(shape, dt) for k, (shape, dt) in step_array_shapes(b).items()}
        t = S.sampling_tensors_from_params([], [], [], b.sample_rows)
        t = jax.tree.map(lambda x: self._abstract(x, rep), t)
        lora = {} if self.lora is None else jax.tree.map(self._abstract, self.lora.arrays)
        return arrays, t, lora

    def lower_forward(self, b: Bucket) -> Any:
        """Bucket ``b``'s forward, lowered (jax.stages.Lowered)."""
        arrays, t, lora = self._step_args(b)
        buf = self._abstract(np.empty((b.sample_rows, self.cfg.vocab_size), np.float32),
                             None if self.mesh is None else shd.replicated(self.mesh))
        last = self._abstract(np.empty((self.num_rows,), np.int32),
                              None if self.mesh is None else shd.replicated(self.mesh))
        fwd = _jit(self.forward_fn, static_argnames=("bucket",), donate_argnums=(1, 2, 3))
        return fwd.lower(self.state, self.kv, self.pen, buf, last, arrays, t, lora, bucket=b)

    def forward(self, b: Bucket) -> Any:
        """Bucket ``b``'s forward, compiled."""
        return self.lower_forward(b).compile(self.options)

    def multi_decode(self, b: Bucket, max_steps: int) -> Any:
        """Decode-only bucket ``b``'s multi-step decode of up to ``max_steps`` steps, compiled."""
        arrays, t, lora = self._step_args(b)
        scalar = jax.ShapeDtypeStruct((), np.int32)
        rows = jax.ShapeDtypeStruct((b.sample_rows,), np.int32)
        multi = _jit(self.multi_fn, static_argnames=("bucket", "max_steps"), donate_argnums=(1, 2))
        return multi.lower(self.state, self.kv, self.pen, arrays, t, scalar, rows, lora, bucket=b,
                           max_steps=max_steps).compile(self.options)

    def keeper(self, width: int) -> Any:
        """``keep_fn`` for ``width`` sampler rows, on the runner's sampling device."""
        dev = None if self.sample_device is None else jax.sharding.SingleDeviceSharding(self.sample_device)
        spec = lambda shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=dev)   # noqa: E731
        return _jit(keep_fn).lower(spec((self.num_rows,)), spec((width, 2 + 2 * NUM_LOGPROBS)),
                                   spec((width,))).compile(self.sampler_options)

    def sampler(self, width: int) -> Any:
        """The sampler of ``width`` rows (compile_sampler), on the runner's sampling device."""
        return compile_sampler(self.cfg.vocab_size, self.num_rows, width, self.sampler_options, self.sample_device)
