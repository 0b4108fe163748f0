"""Draft-model proposers for speculative decoding: ``self`` and ``draft`` (engine/speculative.py
verifies what they propose, exactly as it verifies prompt lookup).

The draft is a second, cheaper model with the target's vocabulary. ``self``: the target's own
weights, quantized (``speculative_quantization``; "auto": int4 on the CPU kernel's 4-bit panels
or for a quantized target, else int8) and/or cut to their first
``speculative_draft_layers`` layers, so the user needs no second checkpoint. ``draft``: a
separate small model (``speculative_model``) sharing the tokenizer.

One page allocator for both models. The draft's runner owns a KV pool with the target's
``num_pages`` and ``page_size``, so the target's block manager serves both: a sequence's
page ids, page table and slot mapping index the draft's pool too, and speculative.py's
rollback (``BlockManager.trim``) frees a rejected page in both at once. No second block
manager, no page copies between the pools.

``self`` shares the target's KV pool (``own_pool``; it then allocates no pool at all): the
draft is the target's own weights (quantized, maybe fewer layers), so the target's exact
K/V of every computed position is context the draft can read as its own, and the draft
needs no pool and no catch-up at all. Its multi-step decode writes its approximate K/V
only at positions the target has not computed yet (num_computed_tokens and after), and the
verification step that follows writes the target's K/V at every position it feeds before
any slot attends; a position a step never verifies is past num_computed_tokens and is
written by the target step that computes it, again before it is read. So the target never
reads a draft-written slot: its tokens stay the plain path's bits. Measured: no prompt
catch-up (a whole prompt through the draft after the first token) and no one-token
catch-up per fully accepted round (RESULTS.md, "Speculative decoding: self with a shared
KV pool").

``draft`` (another model: its K/V are not the target's) keeps a pool of its own, kept in
step lazily. Per sequence the proposer remembers how many
positions the draft has seen; before proposing it feeds those it has not (catch-up): the
whole prompt the first time a sequence speculates, one token after a step that accepted
every draft (the last draft token was never fed to the draft), the tokens decoded while
speculation was paused or off. Mirroring every target step on the draft instead (prefill
chunks, plain decodes) would also keep it in step, but pays draft work in steps that never
speculate: at batch 32, where speculation is off, every step would cost the draft's forward
on top (see benchmarks/RESULTS.md, "Speculative decoding"). A position's draft KV is trusted
only below the sequence's ``num_computed_tokens`` (the target accepted the tokens there) and
only while the sequence was not preempted since (its pages were freed, and a prefix-cache hit
may bring back pages whose draft KV nobody wrote).

Proposing: the draft's multi-step decode executable (runner.multi_decode_fn) samples a
token greedily and feeds it back on the device, k times: one device call and one copy back
for the k proposals of every speculating sequence.

Exactness never depends on the draft: speculative.py emits at every position the token the
target samples there from the same context with the plain path's key, so the draft decides
only how many tokens one step yields. At temperature > 0 a greedy draft is a one-hot
proposal q (all mass on d): Leviathan et al.'s rejection rule accepts d with probability
min(1, p(d) / q(d)) = p(d), exactly the acceptance of "sample t ~ p, accept iff t == d", and
on rejection samples from norm(max(p - q, 0)) = p restricted to t != d, which is the law of
the sampled t given t != d. So sampling and comparing is that rule, and nothing in
acceptance is lost against it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

from flax import nnx

from jaxinfer.engine_config import EngineConfig, draft_quantization
from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine.batch import Bucket, BucketLadders, build_step, step_args
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler
from jaxinfer.engine.sequence import Sequence


# The draft samples greedily and has no penalties: every slot uses penalty-state row 0.
_ROWS: collections.defaultdict = collections.defaultdict(int)


def first_layers(model: nnx.Module, num_layers: int) -> nnx.Module:
    """A module of ``model``'s embedding, first ``num_layers`` layers, final norm and LM
    head (sharing their arrays; ``model`` is untouched): an early-exit draft."""
    cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    out = nnx.merge(*nnx.split(model))
    out.layers = nnx.List(list(out.layers)[:num_layers])
    for _, module in nnx.iter_modules(out):
        if hasattr(module, "cfg"):
            module.cfg = cfg
    return out


def draft_model(config: EngineConfig, target: nnx.Module, target_tokenizer: Any, max_model_len: int) -> nnx.Module:
    """The draft model of ``config.speculative_method`` ("self" | "draft"), laid out for this
    backend. ``target``: the target model before the engine quantizes it (float weights)."""
    from jaxinfer.matmul import int4_kernel_available
    from jaxinfer.quantization import prepare_float_for_cpu, quantize_model

    q = draft_quantization(config, int4_kernel_available())
    if config.speculative_method == "self":
        n, keep = target.cfg.num_layers, config.speculative_draft_layers
        if keep is not None and keep > n:
            raise ValueError(f"speculative_draft_layers: {keep} exceeds the model's {n} layers")
        if (keep is None or keep == n) and q == config.quantization:
            raise ValueError(f"speculative_method: 'self' with all {n} layers and speculative_quantization="
                             f"{q!r} would draft with the target itself; choose fewer layers or a "
                             "cheaper speculative_quantization")
        model = first_layers(target, keep) if keep is not None and keep < n else target
    else:
        from jaxinfer.loading import load_model
        from jaxinfer.models.base import fit_context

        loaded = load_model(config.speculative_model, config.dtype)
        check_draft(loaded.config, loaded.tokenizer, target.cfg, target_tokenizer, max_model_len)
        model = fit_context(loaded.model, max_model_len)
    # int4 on CPU: the C++ kernel's 4-bit panels (affine per 32 rows: a Q4_1 checkpoint's
    # own codes, so the draft proposes what the target would). Weights they do not fit
    # keep the symmetric int4 (XLA's slow path).
    model = quantize_model(model, q)
    return model if q else prepare_float_for_cpu(model)


def check_draft(cfg: Any, tokenizer: Any, target_cfg: Any, target_tokenizer: Any, max_model_len: int) -> None:
    """ValueError unless a draft model can propose for the target: the same vocabulary
    (size and token strings) and room for the engine's context."""
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_model: its vocabulary has {cfg.vocab_size} tokens, the model's "
                         f"{target_cfg.vocab_size}: a draft must share the model's tokenizer")
    vocab, want = (getattr(getattr(t, "hf", None), "get_vocab", dict)() for t in (tokenizer, target_tokenizer))
    if vocab != want:
        raise ValueError("speculative_model: its tokenizer maps tokens to different ids than the model's: "
                         "a draft must share the model's tokenizer")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_model: holds {cfg.max_position_embeddings} positions, fewer than "
                         f"max_model_len={max_model_len}")


def _ceil_in(ladder: tuple[int, ...], n: int) -> int:
    return next((v for v in ladder if v >= n), ladder[-1])


def draft_kv_spec(model: nnx.Module, target_spec: kvc.KVCacheSpec) -> kvc.KVCacheSpec:
    """The draft's KV layout: the target's page count and size (one block manager serves
    both), the draft's layers and heads; quantized pages where the target's are."""
    cfg = model.cfg
    dtype = target_spec.dtype if target_spec.quantized else model.dtype
    return kvc.KVCacheSpec(cfg.num_layers, target_spec.num_pages, target_spec.page_size,
                           cfg.num_kv_heads, cfg.head_dim, dtype)


def pages_match(draft: kvc.KVCacheSpec, target: kvc.KVCacheSpec) -> bool:
    """Whether a draft of KV layout ``draft`` can step on the pages of the target's first
    layers: the same page arrays (count, size, heads, dtype), no more layers than it has."""
    return (draft.num_layers <= target.num_layers
            and dataclasses.replace(draft, num_layers=target.num_layers) == target)


def own_pool(method: str, single_device: bool, draft: nnx.Module, target: kvc.KVCacheSpec
             ) -> kvc.KVCacheSpec | None:
    """The KV pool a draft keeps beside the target's (same page count), or None where it
    steps on the target's pages instead: 'self' on one device in one process, when the
    pages match. The engine sizes the KV budget by this, DraftProposer builds by it."""
    spec = draft_kv_spec(draft, target)
    return None if method == "self" and single_device and pages_match(spec, target) else spec


class DraftProposer:
    """Proposals from a draft model: ``propose(sched, wanted, ensure)`` -> {seq_id: tokens}."""

    def __init__(self, model: nnx.Module, target_spec: kvc.KVCacheSpec, ladders: BucketLadders,
                 config: EngineConfig, attention: str = "auto", target: Any = None):
        """``target``: the target's ModelRunner when the draft steps on its KV pool (the
        engine asks ``own_pool``, the decision its KV budget used), or None for a pool of
        the draft's own; a draft on the target's pages never allocates one (on an
        accelerator the target's pool already holds most of the free memory)."""
        from jaxinfer.engine.runner import ModelRunner

        self.spec = draft_kv_spec(model, target_spec)
        self.ladders = ladders
        # Decode buckets up to the most sequences that speculate at once serve the proposing
        # multi-step decode and short catch-ups (consecutive slots, as verification uses);
        # prefill-only buckets serve long ones (a prompt).
        self.max_decode = _ceil_in(ladders.decode_sizes,
                                   min(config.speculative_disable_by_batch_size, config.max_num_seqs))
        self.chunk = max(n * c for n, c in ladders.prefill_shapes)
        share = target is not None
        self.runner = ModelRunner(model, self.spec, 1, attention, config.batch_invariant,
                                  num_scheduler_steps=max(2, config.num_speculative_tokens), samples=False,
                                  multi_decode_seqs=self.max_decode, layer_loop=config.layer_loop,
                                  kv_pool=not share, stack_kv=not share)
        self.buckets: list[Bucket] = [
            b for b in ladders.all_buckets()
            if (b.num_prefill == 0 and b.num_decode <= self.max_decode)
            or (b.num_prefill > 0 and b.num_decode == ladders.mixed_decode_sizes[0])]
        self._seen: dict[int, tuple[int, int]] = {}     # seq_id -> (num_preemptions, positions the draft saw)
        self.num_catch_up_tokens = 0
        self.target: Any = None     # the target's ModelRunner once the draft shares its KV pool
        if share:
            # Only the multi-step decode runs: no catch-up buckets, no single-step forwards.
            self.target, self.runner.forwards = target, False
            self.buckets = [b for b in self.buckets if b.num_prefill == 0]

    def propose(self, sched: Scheduler, wanted: list[tuple[Sequence, int]],
                ensure: Callable[[Any, Bucket], None] | None = None) -> dict[int, list[int]]:
        """``wanted``: (decoding sequence, tokens to propose). Allocates the pages the draft
        writes (positions up to the last proposal's; the verification step needs them too),
        catches the draft up, and runs its multi-step decode."""
        bm = sched.bm
        live = {s.seq_id for s in sched.running}
        self._seen = {i: v for i, v in self._seen.items() if i in live}
        steps = max(k for _, k in wanted)
        spare = bm.num_free_pages - len(sched.running)     # a page each stays for the step itself
        go: list[tuple[Sequence, int]] = []
        for seq, k in wanted:
            last = seq.num_tokens - 1
            # every row runs ``steps`` steps: its positions must stay inside the page table
            if last + steps > sched.max_model_len:
                continue
            need = max(0, bm.pages_for(last + k) - len(seq.page_ids))
            if need > spare or not bm.allocate_for(seq, last + k):
                continue
            spare -= need
            go.append((seq, k))
        if not go:
            return {}
        if self.target is None:
            self._catch_up([seq for seq, _ in go], ensure)
        batch = build_step([ScheduledSeq(seq, seq.num_tokens - 1, 1, True) for seq, _ in go],
                           self.ladders, self.spec.page_size, _ROWS, lookahead=steps - 1)
        if ensure is not None:
            ensure(self.runner, batch.bucket)
        if self.target is None:             # (the batch's sampler rows: all greedy padding)
            handle = self.runner.dispatch_multi(batch, steps)
        else:       # the target's pages, donated through the draft's step and handed back
            n = self.spec.num_layers
            self.runner.kv = list(self.target.kv[:n])
            handle = self.runner.dispatch_multi(batch, steps)
            self.target.kv = list(self.runner.kv) + list(self.target.kv[n:])
            self.runner.kv = None
        packed = self.runner.fetch(handle)                                          # i32[max_steps, S', 2 + 2K]
        out = {}
        for (slot, _), (seq, k) in zip(batch.entries, go):
            out[seq.seq_id] = packed[:k, slot, 0].tolist()
            # the draft fed positions last .. last + k - 1 (the rest of its row went to the sink page)
            self._seen[seq.seq_id] = (seq.num_preemptions, seq.num_tokens - 1 + k)
        return out

    def _catch_up(self, seqs: list[Sequence], ensure: Callable[[Any, Bucket], None] | None) -> None:
        """Feed the draft every position before each sequence's last token that it has not
        seen (the multi-step decode feeds the last one)."""
        short: list[ScheduledSeq] = []
        for seq in seqs:
            preemptions, seen = self._seen.get(seq.seq_id, (seq.num_preemptions, 0))
            done = min(seen, seq.num_computed_tokens) if preemptions == seq.num_preemptions else 0
            end = seq.num_tokens - 1
            self.num_catch_up_tokens += end - done
            while end - done > self.max_decode:         # long: prefill chunks
                n = min(end - done, self.chunk)
                self._forward([ScheduledSeq(seq, done, n, False)], ensure)
                done += n
            if end > done:                              # short: consecutive decode slots
                short.append(ScheduledSeq(seq, done, end - done, False, tuple(seq.token_ids_slice(done + 1, end))))
        step: list[ScheduledSeq] = []
        for e in short:
            if sum(x.num_new_tokens for x in step) + e.num_new_tokens > self.max_decode:
                self._forward(step, ensure)
                step = []
            step.append(e)
        if step:
            self._forward(step, ensure)

    def _forward(self, entries: list[ScheduledSeq], ensure: Callable[[Any, Bucket], None] | None) -> None:
        """The draft's forward over ``entries`` for their KV only (its logits are dropped;
        nothing waits for it: the multi-step decode queues behind it on the device)."""
        batch = build_step(entries, self.ladders, self.spec.page_size, _ROWS)
        if ensure is not None:
            ensure(self.runner, batch.bucket)
        self.runner.run_host_step(batch.bucket, step_args(batch), sample=False)
