"""Engine construction: an EngineConfig and a model -> the parts ``Engine.__init__`` holds,
in the order they are made:

1. ``configure``: the configuration (vLLM's speculative_config, auto tensor parallelism),
   the process set up for it, the meshes;
2. ``samplers_first``: the sampler executables, compiled before the weights load (why:
   there);
3. ``load_models``: the models as the engine runs them (quantized or laid out for the
   kernels, fitted to max_model_len) and a speculative draft made from them;
4. ``kv_pool_spec``, ``bucket_ladders``, ``make_replicas``, ``make_speculator``: the KV
   pool's layout (a draft's own pool counted in), the bucket ladders, one replica per mesh
   (scheduler, pages, runner) and the speculator;
5. ``warm_up``: the buckets compiled (engine/warmup.py decides when).

Where the engine runs and how much it holds is resources.py's; this module puts the
parts together. Nothing here runs per step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxinfer.engine import resources as R
from jaxinfer.engine import speculative
from jaxinfer.engine.batch import BucketLadders, default_ladders
from jaxinfer.engine.replica import Replica, make_replica
from jaxinfer.engine.speculative import Speculator, spec_decode_sizes
from jaxinfer.engine.warmup import BucketCompiler
from jaxinfer.engine_config import DRAFT_METHODS, EngineConfig, with_speculative_config
from jaxinfer.host_memory import map_large_blocks, release_host_memory

log = logging.getLogger("jaxinfer")


@dataclasses.dataclass
class Models:
    """``load_models``'s result: the models as the engine runs them."""

    loaded: Any                  # loading.LoadedModel kept by the engine; its model is replicas[0]
    replicas: list[Any]          # each replica's model, fitted to max_model_len
    draft: Any                   # speculative decoding's draft model (DRAFT_METHODS), or None
    max_model_len: int
    name: str                    # the model's name in the API (loading.default.model_name)


def configure(config: EngineConfig | None, overrides: dict[str, Any], model: str | None,
              loaded: Any) -> tuple[EngineConfig, list[Any]]:
    """(the engine's configuration, each replica's mesh: [] for one default device).
    ``overrides``: EngineConfig fields over ``config``; tensor_parallel_size 0 is resolved
    here, once the process is set up (host memory, compilation cache)."""
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"config: expected an EngineConfig, got {type(config).__name__}")
    if "speculative_config" in overrides:      # vLLM's form of the speculative_* fields
        overrides = with_speculative_config(overrides)
    config = dataclasses.replace(config, **overrides) if config else EngineConfig(**overrides)
    map_large_blocks()          # freed large buffers go back to the system (host_memory.py)
    R.use_compilation_cache(config.compilation_cache_dir)
    if config.tensor_parallel_size == 0:
        config = R.resolve_auto_tp(config, loaded.config if loaded else None, model)
        if config.quantization and config.tensor_parallel_size > 1:     # re-check, now known
            config = dataclasses.replace(config, tensor_parallel_size=1)
            log.warning("tensor_parallel_size auto: 1 (quantized weights do not shard yet)")
    meshes = R.replica_meshes(config)
    R.start_background_work(config.quantization)
    return config, meshes


def max_model_len(config: EngineConfig, mc: Any) -> int:
    """The engine's longest sequence: the configured one (default: the model's, at most
    4096), never past the model's positions."""
    return min(config.max_model_len or min(mc.max_position_embeddings, 4096), mc.max_position_embeddings)


def bucket_ladders(config: EngineConfig, max_len: int) -> BucketLadders:
    """The bucket ladders: EngineConfig's, or the defaults for its sizes (decode sizes
    widened for speculation, prefill shapes cut for pipeline micro-batches)."""
    c = config
    auto = default_ladders(c.max_num_seqs, max_len, c.page_size, c.max_num_batched_tokens)
    if c.speculative_method is not None:
        auto = dataclasses.replace(auto, decode_sizes=spec_decode_sizes(
            auto.decode_sizes, c.num_speculative_tokens, c.speculative_tree_width))
    if c.pipeline_parallel_size > 1:     # prefill steps that cut into equal micro-batches
        from jaxinfer.engine.pipeline import pipeline_ladders
        auto = pipeline_ladders(auto, c.pipeline_parallel_size)
    lad = BucketLadders(c.decode_buckets or auto.decode_sizes,
                        c.mixed_decode_buckets or auto.mixed_decode_sizes,
                        c.prefill_buckets or auto.prefill_shapes,
                        c.page_buckets or auto.page_sizes, c.enable_prompt_logprobs,
                        c.min_sampler_rows)
    # The scheduler lets a prompt's chunks run beside every other sequence's decode, so
    # a step can carry max_num_seqs - 1 decodes and a prefill: say so now, not mid-run.
    if (c.speculative_method is None and c.max_num_seqs > 1
            and lad.mixed_decode_sizes[-1] < c.max_num_seqs - 1):
        raise ValueError(f"mixed_decode_buckets: the largest ({lad.mixed_decode_sizes[-1]}) must hold "
                         f"the decodes that can run beside a prefill chunk (max_num_seqs - 1 = "
                         f"{c.max_num_seqs - 1})")
    return lad


def samplers_first(config: EngineConfig, model: str | None, loaded: Any, meshes: list
                   ) -> tuple[int | None, dict[int, Any]]:
    """The sampler executables, compiled before the weights load (runner.compile_sampler:
    the largest transient of a cold start, with nothing else resident yet): (the
    vocabulary size they were compiled for, width -> executable); a runner takes them
    if its model's vocabulary is the same. None with a mesh, several processes or lazy
    warm-up (each compiles as before)."""
    from jaxinfer.engine.warmup import default_mode

    if meshes or R.num_processes() > 1 or (config.warmup or default_mode()) == "lazy":
        return None, {}
    from jaxinfer.engine.runner import compile_sampler
    from jaxinfer.loading import read_config

    try:
        mc = loaded.config if loaded is not None else read_config(model)
    except (OSError, ValueError):
        return None, {}                 # the load says what is wrong with the model
    widths = sorted({b.sample_rows for b in bucket_ladders(config, max_model_len(config, mc)).all_buckets()})
    options = R.compiler_options()
    samplers = {w: compile_sampler(mc.vocab_size, config.max_num_seqs + 1, w, options) for w in widths}
    release_host_memory()           # the compiler's freed scratch (~300 MiB) before the load
    return mc.vocab_size, samplers


def load_models(config: EngineConfig, model: str | None, loaded: Any, meshes: list) -> Models:
    """The models as the engine runs them (resources.engine_models), fitted to
    max_model_len, and speculative decoding's draft ('self': made from the float weights,
    loaded here if the caller gave none). The float model is not kept: only the quantized
    / kernel-laid-out one (the caller's ``loaded`` is left as it was)."""
    from jaxinfer.engine import spec_draft
    from jaxinfer.loading.default import model_name
    from jaxinfer.models.base import fit_context

    float_target = None
    if config.speculative_method == "self":      # its draft is made from the float weights
        if loaded is None:
            from jaxinfer.loading import load_model
            loaded = load_model(model, config.dtype, meshes[0] if meshes else None)
        float_target = loaded.model
    kept, models = R.engine_models(config, model, loaded, meshes)
    del loaded
    release_host_memory()
    max_len = max_model_len(config, kept.config)
    # the rotary set-up for max_model_len (weights untouched: after preparation)
    models = [fit_context(m, max_len) for m in models]
    kept = dataclasses.replace(kept, model=models[0])
    draft = None
    if config.speculative_method in DRAFT_METHODS:
        target = models[0] if float_target is None else fit_context(float_target, max_len)
        draft = spec_draft.draft_model(config, target, kept.tokenizer, max_len)
        del target
    del float_target
    release_host_memory()
    return Models(kept, models, draft, max_len, model_name(model, kept.source))


def kv_pool_spec(config: EngineConfig, models: Models, meshes: list) -> tuple[Any, bool]:
    """(the KV pool's layout, whether the draft steps on the target's pool). A draft that
    cannot step on the target's pages keeps a pool of its own with as many pages
    (spec_draft.own_pool): the KV budget pays for both; a 'self' draft may step on the
    target's pool (its first layers: the per-layer form). The running model's KV heads:
    tensor parallelism may repeat them."""
    from jaxinfer.engine import spec_draft

    single = not meshes and R.num_processes() == 1
    draft = models.draft
    own_pool = None if draft is None else (
        lambda spec: spec_draft.own_pool(config.speculative_method, single, draft, spec))
    spec = R.kv_cache_spec(config, models.loaded.config, models.replicas[0].cfg.num_kv_heads,
                           models.loaded.model.dtype, models.max_model_len, also=own_pool)
    return spec, draft is not None and own_pool(spec) is None


def step_publisher(meshes: list) -> Any:
    """Process 0's step broadcaster under jax.distributed (engine/multihost.py), else None."""
    if meshes and R.num_processes() > 1 and R.process_index() == 0:
        from jaxinfer.engine.multihost import StepPublisher
        return StepPublisher()
    return None


def make_replicas(config: EngineConfig, models: Models, meshes: list, kv_spec: Any, ladders: BucketLadders,
                  num_host_pages: int, loras: Any, publisher: Any, attention: str, stack_kv: bool,
                  samplers: tuple[int | None, dict[int, Any]]) -> list[Replica]:
    """One replica per mesh (one for the default device). ``samplers``: samplers_first's
    (vocabulary, executables), taken by a replica whose model has that vocabulary."""
    vocab, compiled = samplers
    return [make_replica(config, kv_spec, ladders, models.max_model_len, num_host_pages, m, mesh, attention,
                         publisher, models.loaded.config, loras, stack_kv=stack_kv,
                         samplers=compiled if m.cfg.vocab_size == vocab else None)
            for m, mesh in zip(models.replicas, meshes or [None])]


def make_speculator(config: EngineConfig, draft: Any, kv_spec: Any, ladders: BucketLadders, attention: str,
                    steps_on: Any = None) -> Speculator | None:
    """Speculative decoding (engine/speculative.py), or None; a draft model gets its own
    runner (spec_draft.DraftProposer), stepping on ``steps_on``'s pool when it shares it."""
    from jaxinfer.engine import spec_draft

    return speculative.make_speculator(config, None if draft is None else spec_draft.DraftProposer(
        draft, kv_spec, ladders, config, attention, target=steps_on))


def overlap_blocker(config: EngineConfig, speculator: Any, publisher: Any) -> str | None:
    """Why this engine runs synchronous steps instead of the overlapped loop (None: it
    overlaps): each of these needs the host between every two steps of every sequence."""
    if not config.async_scheduling:
        return "EngineConfig.async_scheduling is off"
    if speculator is not None:
        return "speculative decoding proposes and verifies drafts on the host between steps"
    if config.num_scheduler_steps > 1:
        return "multi-step decode (num_scheduler_steps > 1) runs its steps in one device call"
    if publisher is not None or R.num_processes() > 1:
        return "several processes: followers replay each step's host arrays"
    return None


def warm_up(config: EngineConfig, replicas: list[Replica], ladders: BucketLadders, speculator: Any,
            progress: bool) -> BucketCompiler:
    """Compile the buckets a first request needs, then the rest: here, or in a background
    thread while the engine serves, or when a step first needs them
    (``EngineConfig.warmup``; engine/warmup.py). Returns the compiler; its ``seconds`` are
    those spent compiling before the engine can serve."""
    from jaxinfer.engine.warmup import default_mode

    draft = getattr(speculator, "proposer", None)
    compiler = BucketCompiler([r.runner for r in replicas], ladders,
                              [(draft.runner, draft.buckets)] if hasattr(draft, "runner") else ())
    # followers replay any bucket
    mode = (config.warmup or default_mode()) if R.num_processes() == 1 else "full"
    if progress:
        _progress_bar(compiler, compiler.first_total if mode == "lazy" else compiler.total)
    compiler.compile_first()
    if mode == "background":
        compiler.start()
        log.info("ready after %.1fs of compiling; %d more buckets compile in the background",
                 compiler.seconds, compiler.total - compiler.num_compiled)
    elif mode == "full":
        compiler.compile_rest()
        if compiler.error is not None:
            raise compiler.error
    return compiler


def _progress_bar(compiler: BucketCompiler, total: int) -> None:
    """A tqdm bar of ``total`` buckets on ``compiler``, closed once they are compiled."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="compiling buckets", unit="bucket", leave=False)

    def show(done: int, _: int) -> None:
        bar.n = min(done, bar.total)
        bar.refresh()
        if bar.n == bar.total:
            bar.close()
            compiler.progress = None

    compiler.progress = show
