"""Engine: add_request / step / abort / generate over the continuous-batching core.

``step()`` per replica: schedule (scheduler + the replica's page moves and rows) -> build
the step's host arrays (engine/batch.py) -> dispatch forward + sampling on the device ->
fetch the packed tokens -> postprocess (engine/output.py: append, detokenize, stop, free).
The engine is built once at start-up (engine/build.py: its parts; engine/resources.py:
where it runs and how much it holds).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterator, Sequence as Seq

import numpy as np

from jaxinfer.bounds import PRIORITY
from jaxinfer.engine_config import EngineConfig
from jaxinfer.outputs import RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine import resources as R
from jaxinfer.engine import build
from jaxinfer.engine.batch import build_step
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine import search
from jaxinfer.engine.output import OutputProcessor, RequestState, replay_runs
from jaxinfer.engine.replica import Replica
from jaxinfer.engine.scheduler import Scheduler, SchedulerOutput
from jaxinfer.engine.sequence import Sequence, derive_seed, make_sequences
from jaxinfer.engine.speculative import speculable
from jaxinfer.engine.step_clock import CallTimer, Launched, StepClock

from jaxinfer.errors import EngineDeadError, StepFailedError

log = logging.getLogger("jaxinfer")

Prompt = str | list[int] | list[dict]


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
        """Build the engine (engine/build.py: the parts, in the order they are made), then
        compile its buckets (``EngineConfig.warmup``)."""
        from jaxinfer.engine.guided import GrammarCompiler     # its threads start on the first compile
        from jaxinfer.engine.lora import make_registry

        self.config, meshes = build.configure(config, overrides, model, loaded)
        samplers = build.samplers_first(self.config, model, loaded, meshes)
        models = build.load_models(self.config, model, loaded, meshes)
        del loaded
        self.loaded, self.model_name, self.max_model_len = models.loaded, models.name, models.max_model_len
        self.model_config, self.tokenizer = self.loaded.config, self.loaded.tokenizer
        self.kv_spec, shares = build.kv_pool_spec(self.config, models, meshes)
        self.ladders = build.bucket_ladders(self.config, self.max_model_len)
        self.loras = make_registry(self.model_config, self.config, R.num_processes())   # multi-LoRA, or None
        self.num_host_pages = R.host_kv_pages(self.config, self.kv_spec.bytes_per_page, max(1, len(meshes)))
        self.publisher = build.step_publisher(meshes)
        self.replicas = build.make_replicas(self.config, models, meshes, self.kv_spec, self.ladders,
                                            self.num_host_pages, self.loras, self.publisher, attention,
                                            stack_kv=not shares, samplers=samplers)
        self.speculator = build.make_speculator(self.config, models.draft, self.kv_spec, self.ladders, attention,
                                                steps_on=self.replicas[0].runner if shares else None)
        del models
        self._ids = itertools.count()
        self._rng = np.random.default_rng(self.config.seed)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or tuple(self.model_config.eos_token_ids)
        self.output = OutputProcessor(self.eos_token_ids, self.max_model_len, self._finish, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._stepping: set[str] = set()     # request ids of this call's steps (_step_failed)
        self.num_failed_steps = 0
        # tests: called with each scheduled step before its batch is built; what it raises
        # fails that step (the engine aborts its requests and goes on)
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self.clock = StepClock()
        # The overlapped loop (EngineConfig.async_scheduling), unless a part of this engine
        # needs the host between every two steps (build.overlap_blocker says which)
        self.overlap_blocker = build.overlap_blocker(self.config, self.speculator, self.publisher)
        self.overlap = self.overlap_blocker is None
        self._in_flight: list[list[Launched]] = []     # dispatched, not yet resolved, in order
        self.compiler = build.warm_up(self.config, self.replicas, self.ladders, self.speculator, progress)
        self.compile_seconds = self.compiler.seconds

    # ---- LoRA adapters (engine/lora.py) ---------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter in directory ``path`` as ``name`` (vLLM's
        /v1/load_lora_adapter); thread-safe: another thread may be stepping. Raises
        lora.LoraError (a ValueError) naming what is wrong."""
        self._lora_registry().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``: new requests for it are refused; running ones finish."""
        self._lora_registry().remove(name)

    def lora_names(self) -> list[str]:
        """The loaded adapters' names ([] when LoRA is off)."""
        return [] if self.loras is None else self.loras.names()

    def _lora_registry(self) -> Any:
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
        return self.publisher is None and bool(R.replica_meshes(self.config)) and R.num_processes() > 1

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

    # ---- warm-up (engine/warmup.py) ---------------------------------------------
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
                    request_id: str | None = None, priority: int = 0, lora: str | None = None,
                    grammar: Any = None) -> str:
        """Queue a request; raises ValueError (bad input, too long, unknown adapter) or
        QueueFullError. ``priority``: lower runs first under ``scheduling_policy="priority"``;
        non-zero is refused under "fcfs" (``check_priority``). ``lora``: the name of a
        loaded LoRA adapter to run it with.
        ``grammar``: ``params.guided`` already compiled (``self.grammars.compile``, as
        AsyncEngine does off the engine thread); without it this call compiles it, waiting
        at most the compile budget (GrammarCompiler.time_budget)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        self.check_priority(priority)
        self._check_for_model(params)
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("prompt: tokenizes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                             f"max_model_len={self.max_model_len}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.output.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if params.prompt_logprobs is not None and not self.ladders.score:
            raise ValueError("prompt_logprobs: this engine has no scoring buckets "
                             "(EngineConfig.enable_prompt_logprobs, `--enable-prompt-logprobs`)")
        constraints = self._constraints(params, grammar) if params.constrained else None
        if lora is not None and params.beam_width > 1:
            raise ValueError("lora: beam search with a LoRA adapter is not supported yet")
        # one adapter reference per sequence, released as each finishes (_finish, abort)
        num_seqs = params.best_of or params.n
        lora_id = 0 if lora is None else self._lora_registry().acquire(lora, num_seqs)
        try:
            seqs = make_sequences(request_id, ids, params, priority=priority, lora_id=lora_id)
            beam = search.start(params, seqs, self.eos_token_ids, self.max_model_len)
            replica = self._pick_replica(seqs[0])
            self.replicas[replica].scheduler.add(seqs)     # validates capacity; may raise QueueFullError
        except BaseException:
            if lora_id:
                self.loras.release(lora_id, num_seqs)
            raise
        seeds = [derive_seed(params.seed, i) if params.seed is not None
                 else int(self._rng.integers(0, 2**32)) for i in range(len(seqs))]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                         params.include_stop_str_in_output) for _ in seqs]
        lps = None if params.logprobs is None else [[] for _ in seqs]
        self.output.requests[request_id] = RequestState(
            request_id, text, ids, params, seqs, detoks, seeds, lps, RequestMetrics(arrival_time=time.monotonic()),
            replica, constraints=constraints, beam=beam,
            prompt_logprobs=search.prompt_logprob_list(params, len(ids)))
        return request_id

    def check_priority(self, priority: Any) -> None:
        """A request's priority: an integer in int64 (vLLM's bound), and 0 unless the
        engine runs the "priority" scheduling policy (vLLM refuses one under "fcfs")."""
        if not PRIORITY.ok(priority.item() if isinstance(priority, np.integer) else priority):
            raise ValueError(f"priority: must be {PRIORITY.text()}, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: got {priority}, but this engine schedules first-come first-served "
                             f"(scheduling_policy='fcfs'); only 'priority' serves request priorities "
                             f"(`--scheduling-policy priority`)")

    def _check_for_model(self, p: SamplingParams) -> None:
        """The bounds SamplingParams cannot know: those of this model's vocabulary."""
        V = self.model_config.vocab_size
        if p.top_k > V:
            raise ValueError(f"top_k: must be <= the vocabulary size {V}, got {p.top_k}")
        bad = [t for t in p.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is out of range (vocabulary of {V})")

    def _constraints(self, p: SamplingParams, grammar: Any = None) -> list[Any]:
        """One guided.SequenceConstraints per sample; raises ValueError (GuidedDecodingError
        for a grammar the library refuses or one over a budget, with its message). A grammar
        compiles once per text (cached), in the compiler's threads; ``grammar``: compiled
        already (add_request)."""
        from jaxinfer.engine import guided as G

        V = self.model_config.vocab_size
        bad = [i for i, _ in p.logit_bias if i >= V]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is out of range (vocabulary of {V})")
        words = G.bad_word_sequences(self.tokenizer, p.bad_words)
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
        if grammar is None and p.guided is not None:
            grammar = self.grammars.compile(p.guided)
        if grammar is not None and (p.guided is None or grammar.key != p.guided.cache_key()):
            raise ValueError("grammar: compiled for another grammar than sampling_params.guided")
        first = grammar.matcher() if grammar is not None else None
        return [G.SequenceConstraints(first if i == 0 or first is None else first.deep_copy(),
                                      p.min_tokens, stop_ids, words, p.logit_bias) for i in range(p.best_of or p.n)]

    def _pick_replica(self, seq: Sequence) -> int:
        """Data parallelism: the replica whose prefix cache holds the longest prefix of the
        prompt (a hit skips that prefill), the least loaded (running + waiting) on a tie."""
        if len(self.replicas) == 1:
            return 0
        return min(range(len(self.replicas)),
                   key=lambda i: (-len(self.replicas[i].block_manager.lookup_prefix(seq)), self.replicas[i].load))

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if unknown or already finished."""
        req = self.output.requests.pop(request_id, None)
        if req is None:
            return False
        live = [s for s in req.seqs if not s.is_finished]
        self.replicas[req.replica].abort(request_id)
        if live and live[0].lora_id:
            self.loras.release(live[0].lora_id, len(live))
        return True

    def has_unfinished(self) -> bool:
        """Requests are running or waiting. (A step still in flight then holds only aborted
        requests' rows: the next step resolves it, and nothing waits for it.)"""
        return bool(self.output.requests)

    # The step clock's sums (engine/step_clock.py), as the benchmarks read them.
    @property
    def num_steps(self) -> int:
        return self.clock.steps

    @property
    def host_seconds(self) -> float:
        return self.clock.host

    @property
    def device_seconds(self) -> float:
        return self.clock.device

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix page no request holds, device and host tier (vLLM's
        ``LLM.reset_prefix_cache``): the next requests compute their prompts afresh."""
        for rep in self.replicas:
            rep.block_manager.reset_prefix_cache()

    # ---- the step -----------------------------------------------------------------
    def step(self, deltas: bool = False) -> list[RequestOutput]:
        """One iteration on every replica (their device steps run concurrently). Returns
        outputs of requests that changed (cumulative snapshots), finished ones included
        once, last. With ``deltas`` each output holds only what is new since the request's
        previous one (``RequestState.delta``): a step's host cost then does not grow with
        output length (AsyncEngine accumulates them). The overlapped loop returns step
        N's outputs from the call that dispatched step N+1 (``_step``)."""
        self._stepping.clear()
        try:
            return self._step(RequestState.delta if deltas else RequestState.snapshot)
        except Exception as e:   # noqa: BLE001 - one step's failure must not end the engine
            raise self._step_failed(e) from e

    def _step(self, emit: Callable[[RequestState], RequestOutput]) -> list[RequestOutput]:
        """Schedule, build and dispatch the next step on every replica, then resolve the
        steps before it: with ``overlap`` every step but the one just dispatched (the
        device runs it while the host fetches and post-processes the last one), else all."""
        with self.clock.call(self._in_flight) as timer:
            run = self._decode_run()
            if run is not None:
                return [emit(r) for r in self._multi_step(*run, timer) if r.visible]
            launched = self._launch()
            timer.dispatched = bool(launched)
            if launched:
                self._in_flight.append(launched)
            keep = 1 if self.overlap and launched and not self._beams_in(launched) else 0
            ready = self._in_flight[:len(self._in_flight) - keep]
            del self._in_flight[:len(ready)]
            timer.steps = len(ready)
            return [emit(r) for group in ready for r in self._resolve(group, timer) if r.visible]

    @staticmethod
    def _beams_in(launched: list[Launched]) -> bool:
        """A beam search's step resolves before the next is scheduled: its beams hold their
        pages while they wait for one another, and which beam to preempt (or fork) is only
        known once the step's candidates are on the host (the synchronous order)."""
        return any(e.seq.params.beam_width > 1 for f in launched for e in f.sched.scheduled)

    def _launch(self) -> list[Launched]:
        """Each replica's next step, scheduled (its tokens in flight counted as pending),
        built and dispatched ([] when no replica has work)."""
        out = []
        for rep in self.replicas:
            sched = rep.schedule(self._drafts(rep))
            if not sched.is_empty:
                self.clock.before_dispatch(self._in_flight + [out])
                out.append(self._dispatch(rep, self._held(sched)))
        return out

    def _resolve(self, group: list[Launched], timer: CallTimer) -> list[RequestState]:
        """A dispatched step's results to the host (waiting for the device) and through
        post-processing: tokens appended, stops checked (a sequence that stopped has its
        look-ahead token, sampled by the step after, dropped when that one resolves)."""
        with self.clock.waiting(timer):
            for f in group:
                f.packed = f.rep.runner.fetch(f.handle)
            if self.publisher is not None:
                self.publisher.step_done()
        self._prompt_logprobs(group)
        return [r for f in group for r in self._postprocess(f.rep, f.sched, f.batch.entries, f.packed, f.committed)]

    def _step_failed(self, e: Exception) -> Exception:
        """After a step raised: abort the requests it held (pages back, as a client's abort
        would) and return the StepFailedError to raise, so the engine serves on; or an
        EngineDeadError when the device state did not survive (its KV pages were donated
        to a call that failed) or followers replay this leader's steps (they may have run it)."""
        self.num_failed_steps += 1
        if self.publisher is not None or not all(rep.runner.state_alive() for rep in self.replicas):
            return EngineDeadError(f"a step failed and the device state cannot be trusted: {e!r}")
        # this call's steps (_held) and those still in flight from the calls before
        self._stepping.update(e.seq.request_id for g in self._in_flight for f in g for e in f.sched.scheduled)
        self._in_flight.clear()
        ids = sorted(self._stepping & set(self.output.requests)) or sorted(self.output.requests)
        log.error("step failed; aborting %d request(s): %s", len(ids), ", ".join(ids[:8]), exc_info=e)
        for rep in self.replicas:
            rep.scheduler.drop_branches()
        for rid in ids:
            self.abort(rid)
        return StepFailedError(ids, e)

    def _held(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Note the requests of ``sched`` (a failure aborts them); run the test fault hook."""
        self._stepping.update(e.seq.request_id for e in sched.scheduled)
        if self.fault_hook is not None:
            self.fault_hook(sched)
        return sched

    def _prompt_logprobs(self, group: list[Launched]) -> None:
        """Scoring steps (prompt logprobs, engine/scoring.py): each scored position's
        logprobs into its request, before the step's tokens are applied."""
        from jaxinfer.engine.scoring import collect

        for f in group:
            if f.batch.bucket.score:
                collect(f.batch, np.asarray(f.scores), lambda seq: getattr(
                    self.output.requests.get(seq.request_id), "prompt_logprobs", None))

    def _dispatch(self, rep: Replica, sched: SchedulerOutput) -> Launched:
        """Build the step's batch and enqueue it on the device (returns at once); the
        overlapped loop commits it to the scheduler now (Scheduler.commit: its tokens are
        pending until it resolves), so the next step can be scheduled before that."""
        now = time.monotonic()
        for e in sched.scheduled:
            m = self.output.requests[e.seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        batch = self._build(rep, sched)
        handle = rep.runner.dispatch(batch)
        if self.overlap:
            rep.scheduler.commit(sched)
        return Launched(rep, sched, batch, handle, rep.runner.last_scores if batch.bucket.score else None,
                        committed=self.overlap)

    def _drafts(self, rep: Replica) -> dict[int, list[int]] | None:
        """Speculative decoding's proposals for this step (engine/speculative.py)."""
        if self.speculator is None:
            return None
        def allowed(seq: Sequence, draft: list[int]) -> int:      # a grammar cuts a draft short
            cs = self.output.requests[seq.request_id].constraints
            return cs[seq.sample_index].valid_prefix(draft) if cs else len(draft)

        return self.speculator.propose(rep.scheduler, self.ladders.decode_sizes[-1], speculable,
                                       self.compiler.ensure, allowed)

    def _build(self, rep: Replica, sched: SchedulerOutput, lookahead: int = 0) -> Any:
        """The step's host arrays (batch.build_step); while buckets still compile, in a
        compiled bucket that holds it, else in its own bucket compiled now
        (engine/warmup.py). A multi-step decode (``lookahead``) needs its own bucket's
        multi-step executable."""
        lora = rep.runner.lora and rep.runner.lora.assign({e.seq.lora_id for e in sched.scheduled}, self.loras)
        warm = self.compiler.is_warm
        ready = None if warm or lookahead else rep.runner.is_compiled
        batch = build_step(sched.scheduled, self.ladders, self.config.page_size, rep.rows, lookahead, ready,
                           lora_slot_of=lora, requests=self.output.requests,
                           vocab_size=self.model_config.vocab_size)
        if not warm:
            self.compiler.ensure(rep.runner, batch.bucket)
        return batch

    def _decode_run(self) -> tuple[SchedulerOutput, int] | None:
        """A multi-step decode run (``num_scheduler_steps``), when one applies: a
        constrained sequence or a beam search needs the host between tokens, so none runs then."""
        if self.config.num_scheduler_steps <= 1 or any(r.constraints or r.beam for r in self.output.requests.values()):
            return None
        rep = self.replicas[0]
        run = rep.scheduler.schedule_decode_run(self.config.num_scheduler_steps)
        rep.apply_page_ops()
        return run if run is None else (self._held(run[0]), run[1])

    def _multi_step(self, sched: SchedulerOutput, k: int, timer: CallTimer) -> list[RequestState]:
        """``k`` decode steps in one device call (Scheduler.schedule_decode_run), then each
        step's tokens postprocessed in order, exactly as ``k`` single steps would be; a
        sequence that stops early drops the tokens it sampled after that."""
        rep = self.replicas[0]
        batch = self._build(rep, sched, lookahead=k - 1)
        self.clock.before_dispatch(self._in_flight)
        handle = rep.runner.dispatch_multi(batch, k)
        timer.dispatched = True
        with self.clock.waiting(timer):
            packed = rep.runner.fetch(handle)                      # i32[max_steps, S', 2 + 2K]
        timer.steps = k
        runs = [(slot, e.seq, k, 0) for slot, e in batch.entries]
        return replay_runs(lambda sc, en, i: self._postprocess(rep, sc, en, packed[i]),
                           (sched, batch.entries), runs)

    def _postprocess(self, rep: Replica, sched: SchedulerOutput, entries: list, packed: np.ndarray,
                     committed: bool = False) -> list[RequestState]:
        """A step's packed sampler output -> the requests that changed. Verified drafts
        (speculative decoding) are accepted first and their runs fed through token by token.
        ``committed``: the scheduler committed the step at dispatch (Scheduler.commit)."""
        from jaxinfer.engine import sampler as S

        res = S.unpack(packed)
        if self.speculator is not None and self.speculator.verifies(sched):
            outs = self.speculator.postprocess(lambda sc, en: self.output.apply(rep.scheduler, sc, en, res),
                                               sched, entries, res.token_ids, rep.block_manager)
            self.speculator.rollback(sched, rep)
            return outs
        return self.output.apply(rep.scheduler, sched, entries, res, committed)

    def _finish(self, seq: Sequence, reason: str, stop_reason: Any) -> None:
        self.replicas[self.output.requests[seq.request_id].replica].finish(seq, reason, stop_reason)
        if seq.lora_id:
            self.loras.release(seq.lora_id)

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
            "num_failed_steps_total": self.num_failed_steps,
            "prompt_tokens_total": self.output.prompt_tokens_total,
            "generation_tokens_total": self.output.generation_tokens_total,
            "num_steps": self.num_steps,
            "async_scheduling": self.overlap,
            "async_scheduling_off_because": self.overlap_blocker,
            **self.clock.stats(),
            **self._prefix_cache_stats(),
            **(self.speculator.stats() if self.speculator else {}),
            **self.warmup_status(),
            "kernels": self.kernels(),
            "kv_cache_dtype": np.dtype(self.runner.spec.dtype).name,   # "int8": quantized pages
        }

    def kernels(self) -> dict[str, str]:
        """The implementation serving each kind of op: {"attention": "cpp" | "xla" |
        "pallas-tpu" | ..., "matmul": "cpp-f32" | "cpp-int8" | "xla" | "pallas",
        "row_sum": "cpp" | "xla" (the norms' fixed-order sums, jaxinfer/reductions.py)}."""
        from jaxinfer import matmul, reductions

        return {"attention": self.runner.attention_name,
                "matmul": matmul.name(self.config.quantization, self.loaded.model.dtype),
                "row_sum": reductions.name()}

    def _prefix_cache_stats(self) -> dict[str, int]:
        per = [r.scheduler.prefix_cache_stats() for r in self.replicas]
        out = {k: sum(s[k] for s in per) for k in per[0]}
        out["host_cache_total_pages"] = sum(r.block_manager.host.num_slots for r in self.replicas)
        return out
