"""The model runner: builds the step function, compiles every bucket ahead of time, executes.

One step = two executables back to back, both on device: the forward over the ragged
batch (one per bucket; KV pages and penalty state donated, updated in place) and the
sampler (one per slot count S), which returns one packed i32[S, 2 + 2K] array: a single
device->host copy per step.

After ``compile_all`` the runner only calls ``Compiled`` objects: a compile after warm-up
is impossible by construction for a known bucket, and an unknown bucket raises.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxinfer.attention import dispatch
from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine import sampler as S
from jaxinfer.engine.batch import Bucket, StepBatch, as_device_args
from jaxinfer.models import layers as L
from jaxinfer.models.llama import LlamaForCausalLM

NUM_LOGPROBS = 20   # top-K capacity of every executable (SamplingParams.MAX_LOGPROBS)


def paged_attention_fn(attention: Callable, bucket: Bucket, slot_mapping, kv_lens, q_lens,
                       page_table, scale: float, window: int | None):
    """AttentionFn for the model: write this step's K/V into the pages, then attend."""

    def attn(layer: int, q, k, v, cache):
        k_pages, v_pages = kvc.write_kv(cache[0], cache[1], k, v, slot_mapping)
        o = attention(q, k_pages, v_pages, kv_lens, q_lens, page_table,
                      num_decode=bucket.num_decode, prefill_chunk=bucket.prefill_chunk,
                      sm_scale=scale, sliding_window=window)
        return o, (k_pages, v_pages)

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
        is_out = a["token_is_output"]
        pm = pm.at[a["token_rows"], a["tokens"]].max(~is_out)
        oc = oc.at[a["token_rows"], a["tokens"]].add(is_out.astype(jnp.int32))
        return pm, oc

    return lax.cond(_any_penalty(t), update, lambda p: p, pen)


def _any_penalty(t: S.SamplingTensors) -> jax.Array:
    return ((t.repetition_penalty != 1) | (t.presence_penalty != 0) | (t.frequency_penalty != 0)).any()


def forward_fn(graphdef, state, kv, pen, arrays: dict[str, jax.Array], t: S.SamplingTensors, *,
               bucket: Bucket, attention: Callable, invariant: bool):
    """One executable per bucket: the model over the ragged batch -> logits f32[S, V]."""
    model: LlamaForCausalLM = nnx.merge(graphdef, state)
    cfg = model.cfg
    attn = paged_attention_fn(attention, bucket, arrays["slot_mapping"], arrays["kv_lens"],
                              arrays["q_lens"], arrays["page_table"], cfg.head_dim ** -0.5,
                              cfg.sliding_window)
    mm = L.tiled_matmul if invariant else L.matmul
    logits, kv = model(arrays["tokens"], arrays["positions"], kv, attn, arrays["logits_index"], mm)
    logits = jnp.pad(logits, ((0, bucket.sample_rows - bucket.num_seqs), (0, 0)))   # [S', V]
    return logits, kv, _update_penalty_state(pen, t, arrays)


def sample_fn(logits, pen, rows, t: S.SamplingTensors):
    """One executable per sampler width S' (Bucket.sample_rows), not per bucket: the
    sampler is slow to compile. logits [S', V], rows i32[S'] (each slot's penalty-state
    row) -> packed i32[S', 2 + 2K]."""
    out = S.sample(logits, t, NUM_LOGPROBS, prompt_mask=pen[0], output_counts=pen[1], penalty_rows=rows)
    return S.pack(out)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, spec: kvc.KVCacheSpec, num_rows: int,
                 attention: str = "auto", batch_invariant: bool = True):
        self.cfg = model.cfg
        self.spec = spec
        self.graphdef, self.state = nnx.split(model)
        self.attention_name, attn_impl = dispatch.select(attention)
        self.kv = kvc.allocate_kv_cache(spec)
        V = self.cfg.vocab_size
        self.pen = (jnp.zeros((num_rows, V), bool), jnp.zeros((num_rows, V), jnp.int32))
        self.num_rows = num_rows
        self._forward = jax.jit(functools.partial(forward_fn, self.graphdef, attention=attn_impl,
                                                  invariant=batch_invariant),
                                static_argnames=("bucket",), donate_argnums=(1, 2))
        self._sample = jax.jit(sample_fn)
        self.executables: dict[Bucket, Any] = {}
        self.samplers: dict[int, Any] = {}
        self.compile_seconds = 0.0

    def _abstract_args(self, b: Bucket):
        T, Sn, P = b.num_tokens, b.num_seqs, b.max_pages
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)   # noqa: E731
        arrays = {"tokens": i32(T), "positions": i32(T), "slot_mapping": i32(T),
                  "kv_lens": i32(Sn), "q_lens": i32(Sn), "page_table": i32(Sn, P),
                  "logits_index": i32(Sn), "rows": i32(Sn),
                  "reset_rows": jax.ShapeDtypeStruct((Sn,), bool), "token_rows": i32(T),
                  "token_is_output": jax.ShapeDtypeStruct((T,), bool)}
        t = S.sampling_tensors_from_params([], [], [], b.sample_rows)
        t = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        return (jax.tree.map(shape, self.state), jax.tree.map(shape, self.kv),
                jax.tree.map(shape, self.pen), arrays, t)

    def compile_all(self, buckets: list[Bucket], progress: Callable[[int, int, Bucket], None] | None = None) -> float:
        """AOT-compile one executable per bucket; returns the seconds it took."""
        t0 = time.perf_counter()
        for i, b in enumerate(buckets):
            if b not in self.executables:
                args = self._abstract_args(b)
                self.executables[b] = self._forward.lower(*args, bucket=b).compile()
            if b.sample_rows not in self.samplers:
                _, _, pen, _, t = self._abstract_args(b)
                logits = jax.ShapeDtypeStruct((b.sample_rows, self.cfg.vocab_size), jnp.float32)
                rows = jax.ShapeDtypeStruct((b.sample_rows,), jnp.int32)
                self.samplers[b.sample_rows] = self._sample.lower(logits, pen, rows, t).compile()
            if progress:
                progress(i + 1, len(buckets), b)
        self.compile_seconds += time.perf_counter() - t0
        return time.perf_counter() - t0

    def execute(self, batch: StepBatch, t: S.SamplingTensors) -> np.ndarray:
        """Run one step; returns the packed sampler output (host numpy, i32[S, 2 + 2K])."""
        exe = self.executables.get(batch.bucket)
        if exe is None:
            raise RuntimeError(f"bucket {batch.bucket} was not compiled at start-up")
        b = batch.bucket
        sample_rows = np.zeros(b.sample_rows, np.int32)
        sample_rows[:b.num_seqs] = batch.rows
        arrays, t, sample_rows = jax.device_put((as_device_args(batch), t, sample_rows))
        logits, self.kv, self.pen = exe(self.state, self.kv, self.pen, arrays, t)
        packed = self.samplers[batch.bucket.sample_rows](logits, self.pen, sample_rows, t)
        return np.asarray(packed)
