"""Engine: add_request / step / abort / generate over the continuous-batching core.

``step()`` is three calls (schedule -> run -> postprocess): the scheduler picks the
sequences and token counts, the batch builder pads them into a compiled bucket, the runner
executes forward + sampling, and postprocessing appends tokens, detokenizes, applies stop
conditions and frees finished sequences' pages.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

import numpy as np

from jaxinfer.config import (CompletionOutput, EngineConfig, Logprob, RequestMetrics,
                             RequestOutput, SamplingParams)
from jaxinfer.engine.batch import BucketLadders, build_step, default_ladders
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.memory import available_ram, release_host_memory
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxinfer.engine.sequence import Sequence, derive_seed, make_sequences
from jaxinfer.engine.speculative import speculable

log = logging.getLogger("jaxinfer")

Prompt = str | list[int] | list[dict]


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    seeds: list[int]
    logprobs: list[list[Logprob]] | None
    metrics: RequestMetrics
    replica: int = 0                    # data-parallel replica running it
    constraints: list[Any] | None = None   # guided.SequenceConstraints per sample, if constrained
    finished: bool = False
    stop_reasons: list[Any] = field(default_factory=list)
    sent: list[tuple[int, int]] = field(default_factory=list)   # per sample: tokens, chars in deltas so far

    def delta(self) -> RequestOutput:
        """What is new since this request's previous ``delta()``: per sample, the new token ids,
        text and logprobs. Costs O(new), where ``snapshot`` copies everything so far."""
        if not self.sent:
            self.sent = [(0, 0)] * len(self.seqs)
        outs = []
        for i, (seq, d) in enumerate(zip(self.seqs, self.detoks)):
            nt, nc = self.sent[i]
            toks = seq.output_token_ids
            outs.append(CompletionOutput(
                index=i, text=d.text_since(nc), token_ids=toks[nt:], finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=None if self.logprobs is None else self.logprobs[i][nt:]))
            self.sent[i] = (len(toks), d.text_len)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.metrics)

    def snapshot(self) -> RequestOutput:
        outs = []
        for i, (seq, d) in enumerate(zip(self.seqs, self.detoks)):
            outs.append(CompletionOutput(
                index=i, text=d.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=None if self.logprobs is None else list(self.logprobs[i])))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.metrics)


def normalize_prompts(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (a string, a token-id list, a chat message list) or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts: empty list")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompts):
            return [list(prompts)]
        if all(isinstance(x, dict) for x in prompts):
            return [list(prompts)]
        return list(prompts)
    raise ValueError(f"prompts: expected a string, token ids, chat messages or a list of those, "
                     f"got {type(prompts).__name__}")


class Engine:
    """The in-process API. ``Engine().generate("Hello")`` runs the embedded default model."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 loaded: Any = None, progress: bool = True, attention: str = "auto", **overrides: Any):
        from jaxinfer.engine import kv_cache as kvc
        from jaxinfer.loading import load_model

        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config: expected an EngineConfig, got {type(config).__name__}")
        config = dataclasses.replace(config, **overrides) if config else EngineConfig(**overrides)
        self.config = config
        _use_compilation_cache(config.compilation_cache_dir)
        if config.tensor_parallel_size == 0:
            config = self.config = _resolve_auto_tp(config, loaded.config if loaded else None, model)
            if config.quantization and config.tensor_parallel_size > 1:     # re-check, now known
                config = self.config = dataclasses.replace(config, tensor_parallel_size=1)
                log.warning("tensor_parallel_size auto: 1 (quantized weights do not shard yet)")
        meshes = _replica_meshes(config)
        _start_kernel_builds()
        if loaded is None:
            loaded = load_model(model, config.dtype, meshes[0] if meshes else None)
        self.loaded = loaded
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        from jaxinfer.loading.default import model_name
        self.model_name = model_name(model, self.loaded.source)
        self.max_model_len = min(config.max_model_len or min(mc.max_position_embeddings, 4096),
                                 mc.max_position_embeddings)
        from jaxinfer.quantization import prepare_float_for_cpu, quantize_model

        models = [quantize_model(m, config.quantization) for m in _place_replicas(loaded, meshes)]
        if not config.quantization and not meshes:
            models = [prepare_float_for_cpu(m) for m in models]
        # keep the quantized model, not the float one (the caller's LoadedModel is untouched);
        # a float model this engine loaded itself is garbage from here, not kept through warm-up
        self.loaded = dataclasses.replace(loaded, model=models[0])
        del loaded
        release_host_memory()
        run_cfg = models[0].cfg        # KV heads repeated where tensor parallelism needs it
        # KV pages in the model's dtype, or int8 values with per-token scales
        dtype = "int8" if config.kv_cache_dtype == "int8" else self.loaded.model.dtype
        probe = kvc.KVCacheSpec(mc.num_layers, 2, config.page_size, run_cfg.num_kv_heads, mc.head_dim, dtype)
        need = config.max_num_seqs * -(-self.max_model_len // config.page_size) + 1   # + the padding page
        num_pages = config.num_pages or max(2, kv_budget(config, need * probe.bytes_per_page)
                                            // probe.bytes_per_page)
        self.kv_spec = kvc.KVCacheSpec(mc.num_layers, num_pages, config.page_size, run_cfg.num_kv_heads,
                                       mc.head_dim, dtype)
        from jaxinfer.engine.speculative import make_speculator
        self.speculator = make_speculator(config)
        self.ladders = self._ladders()
        self.loras = self._lora_registry()
        self.num_host_pages = host_kv_pages(config, self.kv_spec.bytes_per_page, max(1, len(meshes)))
        self.publisher = None
        if meshes and _num_processes() > 1:
            from jaxinfer.engine.multihost import StepPublisher
            if _process_index() == 0:
                self.publisher = StepPublisher()
        self.replicas = [self._make_replica(m, mesh, attention)
                         for m, mesh in zip(models, meshes or [None])]
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or tuple(mc.eos_token_ids)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self._grammars: Any = None           # guided.GrammarCompiler, built on first use
        self.host_seconds = 0.0
        self.device_seconds = 0.0
        self.compile_seconds = self._warmup(progress)

    def _make_replica(self, model: Any, mesh: Any, attention: str) -> "_Replica":
        from jaxinfer.engine.runner import ModelRunner

        c = self.config
        bm = BlockManager(self.kv_spec.num_pages, c.page_size, c.enable_prefix_caching,
                          num_host_pages=self.num_host_pages, record_freed=c.debug_poison_freed_pages)
        sched = Scheduler(bm, c.max_num_seqs, c.max_num_batched_tokens, self.max_model_len, c.max_waiting,
                          prefill_shapes=self.ladders.prefill_shapes,
                          max_loras=c.max_loras if self.loras else None)
        lora = None
        if self.loras is not None:
            from jaxinfer.engine.lora_device import LoraSlots
            lora = LoraSlots(self.model_config, model.cfg, c.max_loras, c.max_lora_rank, model.dtype, mesh)
        runner = ModelRunner(model, self.kv_spec, c.max_num_seqs + 1, attention, c.batch_invariant,
                             mesh=mesh, publisher=self.publisher, num_scheduler_steps=c.num_scheduler_steps,
                             lora=lora)
        if bm.host.num_slots or c.debug_poison_freed_pages:
            runner.enable_page_moves(bm.host.num_slots)
        return _Replica(sched, bm, runner, list(range(c.max_num_seqs, 0, -1)), c.debug_poison_freed_pages)

    def _lora_registry(self) -> Any:
        """Multi-LoRA's adapter registry with ``lora_modules`` loaded, or None (LoRA off)."""
        if not self.config.enable_lora:
            return None
        if _num_processes() > 1:
            raise ValueError("enable_lora: LoRA adapters run in one process for now (followers "
                             "would not receive the adapters' weights)")
        from jaxinfer.engine.lora import LoraRegistry

        return LoraRegistry.from_config(self.model_config, self.config)

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter in directory ``path`` under ``name`` (vLLM's
        /v1/load_lora_adapter); thread-safe, callable while another thread steps.
        Raises lora.LoraError (a ValueError) naming what is wrong."""
        self._lora_registry_or_raise().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``: new requests for it are refused; running ones finish."""
        self._lora_registry_or_raise().remove(name)

    def lora_names(self) -> list[str]:
        """The loaded adapters' names ([] when LoRA is off)."""
        return [] if self.loras is None else self.loras.names()

    def _lora_registry_or_raise(self) -> Any:
        if self.loras is None:
            from jaxinfer.engine.lora import LoraError
            raise LoraError("lora: LoRA is not enabled (start with --enable-lora or --lora-modules)")
        return self.loras

    # The first replica's parts, for single-replica callers (benchmarks, tests).
    @property
    def scheduler(self) -> Scheduler:
        return self.replicas[0].scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.replicas[0].block_manager

    @property
    def runner(self) -> Any:
        return self.replicas[0].runner

    @property
    def is_follower(self) -> bool:
        """True on processes other than 0 under jax.distributed: they only replay steps."""
        return self.publisher is None and bool(_replica_meshes(self.config)) and _num_processes() > 1

    def follow(self) -> int:
        """A follower process's main loop (see engine/multihost.py); returns steps run."""
        from jaxinfer.engine.multihost import follow

        if not self.is_follower:
            raise RuntimeError("follow(): only processes other than 0 under jax.distributed follow")
        return follow(self.runner)

    def shutdown(self) -> None:
        """Release follower processes (multi-process engines); harmless otherwise."""
        self.compiler.stop()
        if self.publisher is not None:
            self.publisher.stop()
            self.publisher = None

    # ---- start-up -----------------------------------------------------------------
    def _ladders(self) -> BucketLadders:
        c = self.config
        auto = default_ladders(c.max_num_seqs, self.max_model_len, c.page_size, c.max_num_batched_tokens)
        if self.speculator is not None:
            from jaxinfer.engine.speculative import spec_decode_sizes
            auto = dataclasses.replace(auto, decode_sizes=spec_decode_sizes(auto.decode_sizes, c.num_speculative_tokens))
        return BucketLadders(c.decode_buckets or auto.decode_sizes,
                             c.mixed_decode_buckets or auto.mixed_decode_sizes,
                             c.prefill_buckets or auto.prefill_shapes,
                             c.page_buckets or auto.page_sizes)

    def _warmup(self, progress: bool) -> float:
        """Compile the buckets a first request needs, then the rest: here, or in a
        background thread while the engine serves, or when a step first needs them
        (``EngineConfig.warmup``; engine/warmup.py). Returns the seconds spent compiling
        before the engine can serve."""
        from jaxinfer.engine.warmup import BucketCompiler

        self.compiler = BucketCompiler([r.runner for r in self.replicas], self.ladders)
        mode = self.config.warmup if _num_processes() == 1 else "full"   # followers replay any bucket
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=self.compiler.first_total if mode == "lazy" else self.compiler.total,
                       desc="compiling buckets", unit="bucket", leave=False)

            def show(done: int, total: int) -> None:
                bar.n = min(done, bar.total)
                bar.refresh()
                if bar.n == bar.total:
                    bar.close()
                    self.compiler.progress = None

            self.compiler.progress = show
        self.compiler.compile_first()
        if mode == "background":
            self.compiler.start()
            log.info("ready after %.1fs of compiling; %d more buckets compile in the background",
                     self.compiler.seconds, self.compiler.total - self.compiler.num_compiled)
        elif mode == "full":
            self.compiler.compile_rest()
            if self.compiler.error is not None:
                raise self.compiler.error
        return self.compiler.seconds

    @property
    def is_warm(self) -> bool:
        """Every bucket is compiled: from now on no step compiles anything."""
        return self.compiler.is_warm

    def wait_until_warm(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled (``warmup="background"``); True if warm."""
        return self.compiler.wait(timeout)

    def warmup_status(self) -> dict[str, Any]:
        """{"warm": bool, "buckets_compiled": int, "buckets_total": int}."""
        return self.compiler.status()

    # ---- requests -----------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty string")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            return None, list(ids)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt: empty token list")
            V = self.model_config.vocab_size
            for t in prompt:
                if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < V:
                    raise ValueError(f"prompt: token id {t!r} is not an integer in [0, {V})")
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt: expected a string, token ids or chat messages, got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, lora: str | None = None) -> str:
        """Queue a request; raises ValueError (bad input, too long, unknown adapter) or
        QueueFullError. ``lora``: the name of a loaded LoRA adapter to run it with."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("prompt: tokenizes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                             f"max_model_len={self.max_model_len}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        constraints = self._constraints(params) if params.constrained else None
        lora_id = 0 if lora is None else self._lora_registry_or_raise().acquire(lora)
        try:
            seqs = make_sequences(request_id, ids, params, priority=priority, lora_id=lora_id)
            replica = self._pick_replica(seqs[0])
            self.replicas[replica].scheduler.add(seqs)     # validates capacity; may raise QueueFullError
        except BaseException:
            if lora_id:
                self.loras.release(lora_id)
            raise
        seeds = [derive_seed(params.seed, i) if params.seed is not None
                 else int(self._rng.integers(0, 2**32)) for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                         params.include_stop_str_in_output) for _ in seqs]
        lps = None if params.logprobs is None else [[] for _ in seqs]
        self._requests[request_id] = _Request(request_id, text, ids, params, seqs, detoks, seeds, lps,
                                              RequestMetrics(arrival_time=time.monotonic()), replica,
                                              constraints=constraints)
        return request_id

    def _constraints(self, p: SamplingParams) -> list[Any]:
        """One guided.SequenceConstraints per sample; raises ValueError (GuidedDecodingError
        for a grammar the library refuses, with its message). A grammar compiles once per
        text (cached); llguidance builds it lazily, so this costs about a millisecond here."""
        from jaxinfer.engine import guided as G

        V = self.model_config.vocab_size
        bad = [i for i, _ in p.logit_bias if i >= V]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is out of range (vocabulary of {V})")
        if p.guided is not None and self._grammars is None:
            self._grammars = G.GrammarCompiler(self.tokenizer, V, self.eos_token_ids)
        words = G.bad_word_sequences(self.tokenizer, p.bad_words)
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
        first = self._grammars.matcher(p.guided) if p.guided is not None else None
        return [G.SequenceConstraints(first if i == 0 or first is None else first.deep_copy(),
                                      p.min_tokens, stop_ids, words, p.logit_bias) for i in range(p.n)]

    def _pick_replica(self, seq: Sequence) -> int:
        """Data parallelism: the replica whose prefix cache holds the longest prefix of the
        prompt (a hit skips that prefill), the least loaded (running + waiting) on a tie."""
        if len(self.replicas) == 1:
            return 0
        return min(range(len(self.replicas)),
                   key=lambda i: (-len(self.replicas[i].block_manager.lookup_prefix(seq)), self.replicas[i].load))

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        rep = self.replicas[req.replica]
        for seq in rep.scheduler.abort(request_id):
            rep.release_row(seq)
        self._release_lora(req)
        return True

    def _release_lora(self, req: _Request) -> None:
        """The request is gone: its adapter reference too (an unloaded adapter dies with its last)."""
        if req.seqs[0].lora_id:
            self.loras.release(req.seqs[0].lora_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix page no request holds, device and host tier (vLLM's
        ``LLM.reset_prefix_cache``): the next requests compute their prompts afresh."""
        for rep in self.replicas:
            rep.block_manager.reset_prefix_cache()

    # ---- the step -----------------------------------------------------------------
    def step(self, deltas: bool = False) -> list[RequestOutput]:
        """One iteration: schedule -> run -> postprocess, on every replica (their device
        steps run concurrently). Returns outputs of requests that changed (cumulative
        snapshots), finished ones included once, last. With ``deltas`` each output holds
        only what is new since the request's previous one (``_Request.delta``): a step's
        host cost then does not grow with output length (AsyncEngine accumulates them)."""
        t0 = time.perf_counter()
        emit = _Request.delta if deltas else _Request.snapshot
        # A constrained sequence needs the host between tokens: no multi-step runs then.
        if self.config.num_scheduler_steps > 1 and not any(r.constraints for r in self._requests.values()):
            run = self.replicas[0].scheduler.schedule_decode_run(self.config.num_scheduler_steps)
            self.replicas[0].apply_page_ops()
            if run is not None:
                return [emit(r) for r in self._multi_step(self.replicas[0], *run, t0)]
        pending = []
        for rep in self.replicas:
            sched = rep.scheduler.schedule(self._drafts(rep))
            rep.apply_page_ops()
            for seq in sched.preempted:
                rep.release_row(seq)
            if sched.is_empty:
                continue
            now = time.monotonic()
            for e in sched.scheduled:
                if e.seq.seq_id not in rep.rows:
                    rep.rows[e.seq.seq_id] = rep.free_rows.pop()
                req = self._requests[e.seq.request_id]
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
            batch = self._build(rep, sched)
            t = self._sampling_tensors(batch)
            pending.append((rep, sched, batch, rep.runner.dispatch(batch, t, self._token_mask(batch))))
        if not pending:
            return []
        t1 = time.perf_counter()
        fetched = [(rep, sched, batch, rep.runner.fetch(h)) for rep, sched, batch, h in pending]
        if self.publisher is not None:
            self.publisher.step_done()
        t2 = time.perf_counter()
        outs = []
        for rep, sched, batch, packed in fetched:
            outs += map(emit, self._postprocess(rep, sched, batch.entries, packed))
        t3 = time.perf_counter()
        self.num_steps += 1
        self.host_seconds += (t1 - t0) + (t3 - t2)
        self.device_seconds += t2 - t1
        return outs

    def _drafts(self, rep: "_Replica") -> dict[int, list[int]] | None:
        """Speculative decoding's proposals for this step (engine/speculative.py)."""
        if self.speculator is None:
            return None
        return self.speculator.propose(rep.scheduler, self.ladders.decode_sizes[-1], lambda seq: speculable(
            seq, bool(self._requests[seq.request_id].constraints)))

    def _build(self, rep: "_Replica", sched: SchedulerOutput, lookahead: int = 0) -> Any:
        """The step's batch; while buckets still compile, in a compiled bucket that holds
        it, else in its own bucket compiled now (engine/warmup.py). A multi-step decode
        (``lookahead``) needs its own bucket's multi-step executable."""
        lora = rep.runner.lora and rep.runner.lora.assign({e.seq.lora_id for e in sched.scheduled}, self.loras)
        if self.compiler.is_warm:
            return build_step(sched.scheduled, self.ladders, self.config.page_size, rep.rows, lookahead,
                              lora_slot_of=lora)
        ready = None if lookahead else rep.runner.is_compiled
        batch = build_step(sched.scheduled, self.ladders, self.config.page_size, rep.rows, lookahead, ready,
                           lora_slot_of=lora)
        self.compiler.ensure(rep.runner, batch.bucket)
        return batch

    def _multi_step(self, rep: "_Replica", sched: SchedulerOutput, k: int, t0: float) -> list[_Request]:
        """``k`` decode steps in one device call (Scheduler.schedule_decode_run), then each
        step's tokens postprocessed in order, exactly as ``k`` single steps would be; a
        sequence that stops early drops the tokens it sampled after that."""
        batch = self._build(rep, sched, lookahead=k - 1)
        t = self._sampling_tensors(batch)
        handle = rep.runner.dispatch_multi(batch, t, k)
        t1 = time.perf_counter()
        packed = rep.runner.fetch(handle)                          # i32[max_steps, S', 2 + 2K]
        t2 = time.perf_counter()
        latest: dict[str, _Request] = {}
        for i in range(k):
            live = [(slot, e) for slot, e in batch.entries if not e.seq.is_finished]
            if not live:
                break
            entries = [(slot, e if i == 0 else ScheduledSeq(e.seq, e.seq.num_computed_tokens, 1, True))
                       for slot, e in live]
            step_sched = SchedulerOutput([e for _, e in entries], [], len(entries))
            for req in self._postprocess(rep, step_sched, entries, packed[i]):
                latest.pop(req.request_id, None)
                latest[req.request_id] = req
        t3 = time.perf_counter()
        self.num_steps += k
        self.host_seconds += (t1 - t0) + (t3 - t2)
        self.device_seconds += t2 - t1
        return sorted(latest.values(), key=lambda o: o.finished)

    def _sampling_tensors(self, batch):
        from jaxinfer.engine import sampler as S

        n = batch.bucket.sample_rows
        params: list[SamplingParams | None] = [None] * n
        seeds, steps = [0] * n, [0] * n
        for slot, e in batch.entries:
            req = self._requests[e.seq.request_id]
            for j in range(1 + len(e.draft)):      # a draft's slots sample output tokens j ahead
                params[slot + j] = e.seq.params
                seeds[slot + j] = req.seeds[e.seq.sample_index]
                steps[slot + j] = e.seq.num_output_tokens + j
        return S.sampling_tensors_from_params(params, seeds, steps, n)

    def _token_mask(self, batch) -> Callable[[], Any] | None:
        """The step's TokenMask builder for the runner (called while the device runs the
        forward), or None when no sampled row is constrained: those steps pay nothing."""
        rows = [(slot, req.constraints[e.seq.sample_index], e.seq.output_token_ids)
                for slot, e in batch.entries if e.samples
                for req in (self._requests[e.seq.request_id],) if req.constraints]
        if not rows:
            return None

        def build():
            from jaxinfer.engine import guided as G
            from jaxinfer.engine import sampler as S

            m = G.build_mask(batch.bucket.sample_rows, self.model_config.vocab_size, rows)
            return S.TokenMask(m.bits, m.bias_ids, m.bias_vals, m.active)

        return build

    def _postprocess(self, rep: "_Replica", sched: SchedulerOutput, entries: list[tuple[int, ScheduledSeq]],
                     packed: np.ndarray) -> list[_Request]:
        """Apply a step's sampled tokens -> the requests that changed (the caller turns them
        into outputs after the last step of a multi-step run)."""
        from jaxinfer.engine import sampler as S

        res = S.unpack(packed)
        if any(e.draft for e in sched.scheduled):
            # verify the drafts, feed each accepted run back through here token by token
            outs = self.speculator.postprocess(lambda sc, en: self._postprocess(rep, sc, en, packed),
                                               sched, entries, res.token_ids)
            self.speculator.rollback(sched, rep.block_manager)
            return outs
        sampled = {e.seq.seq_id: int(res.token_ids[slot]) for slot, e in entries if e.samples}
        slot_of = {e.seq.seq_id: slot for slot, e in entries}
        grew = rep.scheduler.postprocess(sched, sampled)
        self.prompt_tokens_total += sum(e.num_new_tokens for e in sched.scheduled
                                        if e.start_pos < e.seq.num_prompt_tokens)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for seq in grew:
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            touched[req.request_id] = req
            self.generation_tokens_total += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            tok = seq.output_token_ids[-1]
            slot = slot_of[seq.seq_id]
            if req.logprobs is not None:
                k = seq.params.logprobs or 0
                req.logprobs[seq.sample_index].append(Logprob(tok, float(res.logprobs[slot]), tuple(
                    (int(i), float(x)) for i, x in zip(res.top_ids[slot, :k], res.top_logprobs[slot, :k]))))
            c = req.constraints[seq.sample_index] if req.constraints else None
            if c is not None:
                c.advance(tok)
            self._check_stop(req, seq, tok)
            if c is not None and c.stopped and not seq.is_finished:
                # the grammar is complete (or refused the token: logged) and only EOS could follow
                if c.error:
                    log.warning("request %s: grammar stopped: %s", req.request_id, c.error)
                req.detoks[seq.sample_index].finish()
                self._finish(seq, "stop", None)
        for req in touched.values():
            if all(s.is_finished for s in req.seqs):
                req.finished = True
                req.metrics.finished_time = now
                del self._requests[req.request_id]
                self._release_lora(req)
        return list(touched.values())

    def _check_stop(self, req: _Request, seq: Sequence, tok: int) -> None:
        p = seq.params
        d = req.detoks[seq.sample_index]
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            d.finish()
            return self._finish(seq, "stop", tok)
        d.append(tok)
        if d.stopped_by is not None:
            return self._finish(seq, "stop", d.stopped_by)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            d.finish()
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: Any) -> None:
        rep = self.replicas[self._requests[seq.request_id].replica]
        rep.scheduler.finish(seq, reason, stop_reason)
        rep.release_row(seq)

    # ---- batch API ----------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora: str | None | Seq[str | None] = None) -> list[RequestOutput]:
        """Generate for every prompt, all batched together; outputs in prompt order.
        ``lora``: an adapter name for every prompt, or one per prompt (None: the base model)."""
        plist = normalize_prompts(prompts)
        loras = [lora] * len(plist) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(plist):
            raise ValueError(f"lora: {len(loras)} adapters given for {len(plist)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params: {len(params)} given for {len(plist)} prompts")
        ids = []
        try:
            for p, sp, name in zip(plist, params, loras):
                ids.append(self.add_request(p, sp, lora=name))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        return self.run_until_done(ids, use_tqdm)

    def run_until_done(self, ids: list[str], use_tqdm: bool = False,
                       on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generating", unit="req")
        want = set(ids)
        while want - final.keys():
            for out in self.step():
                if on_output:
                    on_output(out)
                if out.finished and out.request_id in want:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        reps = self.replicas
        total = sum(r.block_manager.num_usable_pages for r in reps)
        free = sum(r.block_manager.num_free_pages for r in reps)
        return {
            "num_running": sum(r.scheduler.num_running for r in reps),
            "num_waiting": sum(r.scheduler.num_waiting for r in reps),
            "kv_cache_usage": (total - free) / total if total else 0.0,
            "num_free_pages": free,
            "num_total_pages": total,
            "num_preemptions_total": sum(r.scheduler.num_preemptions_total for r in reps),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_steps": self.num_steps,
            **self._prefix_cache_stats(),
            **(self.speculator.stats() if self.speculator else {}),
            **self.warmup_status(),
            "kernels": self.kernels(),
        }

    def kernels(self) -> dict[str, str]:
        """The implementation serving each kind of op: {"attention": "cpp" | "xla" |
        "pallas-tpu" | ..., "matmul": "cpp-f32" | "cpp-int8" | "xla" | "pallas"}."""
        from jaxinfer.attention.dispatch import matmul_name

        return {"attention": self.runner.attention_name,
                "matmul": matmul_name(self.config.quantization, self.loaded.model.dtype)}

    def _prefix_cache_stats(self) -> dict[str, int]:
        per = [r.scheduler.prefix_cache_stats() for r in self.replicas]
        out = {k: sum(s[k] for s in per) for k in per[0]}
        out["host_cache_total_pages"] = sum(r.block_manager.host.num_slots for r in self.replicas)
        return out


@dataclass
class _Replica:
    """One data-parallel replica: its own scheduler, KV pages and device executables."""

    scheduler: Scheduler
    block_manager: BlockManager
    runner: Any                                   # engine.runner.ModelRunner
    free_rows: list[int]                          # penalty-state rows not in use
    poison_freed_pages: bool = False              # EngineConfig.debug_poison_freed_pages
    rows: dict[int, int] = field(default_factory=dict)   # seq_id -> penalty-state row

    def apply_page_ops(self) -> None:
        """The block manager's page moves (host tier, test poisoning), run by the runner
        before this replica's next forward."""
        ops = self.block_manager.take_page_ops()
        if ops:
            self.runner.apply_page_ops(ops, self.poison_freed_pages)

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def release_row(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free_rows.append(row)


def _num_processes() -> int:
    import jax

    return jax.process_count()


def _process_index() -> int:
    import jax

    return jax.process_index()


def _replica_meshes(config: EngineConfig) -> list[Any]:
    """One mesh per data-parallel replica; [] for the plain single-device engine."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    if tp == 1 and dp == 1 and _num_processes() == 1:
        return []
    from jaxinfer import sharding

    if _num_processes() > 1:
        import jax

        if dp > 1:
            raise ValueError("data_parallel_size > 1 with several processes is not supported: run "
                             "one engine per host instead, or use the hosts for tensor parallelism")
        if tp != jax.device_count():
            raise ValueError(f"tensor_parallel_size={tp}: with {_num_processes()} processes the model "
                             f"must span all {jax.device_count()} devices (every process runs the step)")
    return sharding.replica_meshes(sharding.make_mesh(tp, dp))


def _resolve_auto_tp(config: EngineConfig, model_config: Any, model: str | None) -> EngineConfig:
    """tensor_parallel_size=0: the largest size the model allows on the visible devices
    (all processes' under jax.distributed) divided among the data-parallel replicas."""
    import jax

    from jaxinfer import sharding
    from jaxinfer.loading import read_config

    cfg = model_config or read_config(model)
    tp = sharding.auto_tp_size(cfg, jax.device_count() // config.data_parallel_size)
    log.info("tensor_parallel_size auto: %d (%d devices)", tp, jax.device_count())
    return dataclasses.replace(config, tensor_parallel_size=tp)


def _place_replicas(loaded: Any, meshes: list[Any]) -> list[Any]:
    """The model for each replica: the loaded one (placed on the first mesh, re-placed from
    its host values if it was loaded elsewhere), copied shard by shard onto the others."""
    if not meshes:
        return [loaded.model]
    import jax
    from flax import nnx

    from jaxinfer.loading import build_model
    from jaxinfer.models.llama import flat_params

    first = loaded.model
    leaf = jax.tree.leaves(nnx.state(first))[0]
    if getattr(leaf.sharding, "mesh", None) != meshes[0]:
        from jaxinfer.sharding import host_value
        flat = {k: host_value(v) for k, v in flat_params(first).items()}
        first = build_model(loaded.config, flat, first.dtype, meshes[0])
    models = [first]
    graphdef, state = nnx.split(first)
    for mesh in meshes[1:]:
        moved = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, x.sharding.spec)),
                             state)
        models.append(nnx.merge(graphdef, moved))
    return models


def host_kv_pages(config: EngineConfig, bytes_per_page: int, num_replicas: int) -> int:
    """Host-tier pages per replica: ``host_kv_cache_memory`` split among the replicas; by
    default none on CPU (the device's memory is host memory already) and a fraction of RAM
    on accelerators. Only with prefix caching, and one process (followers would not
    replay the copies)."""
    mem = config.host_kv_cache_memory
    if not config.enable_prefix_caching or mem == 0:
        return 0
    if _num_processes() > 1:
        if mem is not None:
            raise ValueError("host_kv_cache_memory: the host KV tier runs in one process; "
                             "set it to 0 with jax.distributed")
        return 0
    if mem is None:
        import jax

        if jax.default_backend() == "cpu":
            return 0
        mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * config.HOST_KV_CACHE_RAM_FRACTION)
    return mem // num_replicas // bytes_per_page


def kv_budget(config: EngineConfig, need: int | None = None) -> int:
    """Bytes for the KV pages: the configured size, or a fraction of the device's free
    memory where the backend reports it (weights are already resident), else (CPU) what
    the configuration can use (``need``: every sequence at max_model_len) capped by
    DEFAULT_KV_CACHE_MEMORY and half the RAM available now: the pool is resident from the
    start (zero-filled), so a one-sequence engine should not hold a pool for 64."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        budget = int(free * config.kv_cache_memory_fraction)
        log.info("KV cache: %.2f GiB (%.0f%% of free device memory)", budget / 2**30,
                 100 * config.kv_cache_memory_fraction)
        return budget
    cap = EngineConfig.DEFAULT_KV_CACHE_MEMORY
    ram = available_ram()
    if ram:
        cap = min(cap, ram // 2)
    budget = min(need, cap) if need else cap
    log.info("KV cache: %.0f MiB (%s)", budget / 2**20,
             "all sequences at max_model_len" if need and need <= cap else "capped; --kv-cache-memory sets it")
    return budget


def _start_kernel_builds() -> None:
    """On CPU, compile the C++ kernels (pallas_kernels/cpu_build.py) while the model loads."""
    import jax

    if jax.default_backend() == "cpu":
        from pallas_kernels import cpu_build
        cpu_build.build_all_in_background()


def _use_compilation_cache(path: str | None) -> None:
    """EngineConfig.compilation_cache_dir: on by default, in the documented location unless
    the process already chose one (tests, an embedding application); None / "" = off."""
    from jaxinfer.config import DEFAULT_COMPILATION_CACHE

    if not path or (path == DEFAULT_COMPILATION_CACHE and _configured_cache_dir()):
        return
    enable_compilation_cache(os.path.expanduser(path))


def _configured_cache_dir() -> str | None:
    import jax

    return jax.config.jax_compilation_cache_dir


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a warm start loads executables from disk."""
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
