"""How the engine runs a model: ``EngineConfig``, validated once in ``__post_init__`` with
errors that name the offending field; the resolvers of its "auto" values
(``draft_quantization``, ``kv_cache_dtype``); and vLLM's ``speculative_config`` read as its
fields (``speculative_fields``, ``with_speculative_config``).

Nothing below the CLI reads environment variables; they all take this record instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from jaxinfer.bounds import require

DEFAULT_COMPILATION_CACHE = "~/.cache/jaxinfer/xla"
DEFAULT_WEIGHT_CACHE = "~/.cache/jaxinfer/weights"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a model: KV cache size, batching limits, buckets, mesh.

    Static (changes compiled shapes): page_size, num_pages, max_num_seqs, the bucket
    ladders (derived from the limits unless given), dtype, tensor/data parallel sizes.
    Everything else is host-side policy.
    """

    dtype: str = "float32"
    page_size: int = 16
    kv_cache_memory: int | None = None       # bytes for K and V pages, all layers
    # Without kv_cache_memory: this fraction of the device's free memory where the backend
    # reports it (GPU/TPU), else DEFAULT_KV_CACHE_MEMORY (CPU).
    kv_cache_memory_fraction: float = 0.9
    num_pages: int | None = None             # overrides kv_cache_memory (tests)
    max_num_seqs: int = 64                   # sequences in one step
    max_num_batched_tokens: int = 512        # tokens in one step (chunked prefill budget)
    # vLLM's: the most tokens a prefill chunk takes per step while other requests share the
    # engine (a lone prompt still gets the whole budget), so a long prompt does not stall
    # them (engine/scheduler.py). None = auto (max_num_batched_tokens // 16), 0 = no cap.
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None         # prompt + output; default min(model's, 4096)
    max_waiting: int | None = 4096           # waiting sequences before QueueFullError
    # vLLM's --scheduling-policy (engine/scheduler.py): "fcfs" serves requests in arrival
    # order and refuses a non-zero priority; "priority" serves lower priority values first
    # and preempts lower-priority running requests for a waiting one that lacks a seat or pages.
    scheduling_policy: str = "fcfs"
    # Admission control (engine/admission.py): a request whose predicted wait for its first
    # token (the prompt tokens queued ahead of it over the measured prefill rate) exceeds
    # this many ms is refused at once (QueueFullError: 503 + Retry-After). None: off.
    max_queue_delay_ms: int | None = None
    # Prefix caching (engine/block_manager.py): full computed KV pages are kept, found by
    # chain hash and shared by later requests with the same prefix; evicted LRU.
    enable_prefix_caching: bool = True
    # Host-memory tier behind the prefix cache: bytes of host RAM for cached pages evicted
    # from the device (0 = off). None = auto: off on CPU (device memory is host memory),
    # else HOST_KV_CACHE_RAM_FRACTION of the machine's RAM.
    host_kv_cache_memory: int | None = None
    # Tests: fill every page that loses its content (freed or evicted) with NaN / garbage
    # before the next step, so a read of a freed page shows in the outputs.
    debug_poison_freed_pages: bool = False
    # JAX's persistent compilation cache: a later start loads the compiled steps from here
    # instead of compiling them. None or "" turns it off; the default defers to a cache
    # the process already configured (jax.config.jax_compilation_cache_dir).
    compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE
    # The model as a single-device engine runs it (fused, panelled or quantized weights),
    # saved by a first start and memory-mapped by later ones (loading/weight_cache.py).
    # None or "" turns it off.
    weight_cache_dir: str | None = DEFAULT_WEIGHT_CACHE
    seed: int = 0                            # base of per-request seeds when none is given
    # Every weight matmul batch-invariant (the f32 C++ kernel, or XLA's dot on fixed 32-row
    # tiles: jaxinfer/matmul.py): a request's tokens are the same bits alone or in any
    # batch. Cost measured in benchmarks/RESULTS.md.
    batch_invariant: bool = True
    # Devices one model is split over (0 = auto: the largest size the model's head counts
    # allow on the visible devices / data_parallel_size) and independent replicas.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Pipeline parallelism (engine/pipeline.py): the layers cut into this many stages, each
    # on its own devices (x tensor_parallel_size), a step's sequences in micro-batches that
    # flow through the stages so they overlap.
    pipeline_parallel_size: int = 1
    # Weight offload (engine/offload.py): "host" keeps the layers whose weights do not fit
    # ``device_weight_memory`` bytes (after the embedding / head and the layers before
    # them) in host memory, streamed to the device a layer ahead; "none" keeps all resident.
    offload_weights: str = "none"
    device_weight_memory: int | None = None
    # Weight-only quantization of every matmul weight at load time: None | "int8" | "int4"
    # (jaxinfer/quantization.py).
    quantization: str | None = None
    # KV pages: "int8" = int8 values + an f32 scale per token and KV head
    # (engine/kv_cache.py QuantizedPages); "model" = the model's dtype; None ("auto") = int8
    # when the weights are quantized and nothing speculates, else the model's dtype
    # (``kv_cache_dtype`` below: why).
    kv_cache_dtype: str | None = None
    # Multi-step decode (vLLM's num_scheduler_steps): when every running sequence is
    # decoding and nobody waits for admission, run up to this many decode steps in one
    # device call, feeding sampled tokens back on the device. Amortizes the host's share of
    # a step (large at batch 1: RESULTS.md); outputs stream in runs of this many tokens. Same
    # tokens as 1 (tests/test_multi_step.py). Single device, one process.
    num_scheduler_steps: int = 1
    # The overlapped step loop (vLLM's async scheduling, SGLang's overlap scheduler;
    # engine/engine.py): step N+1 is scheduled, built and dispatched while step N runs on
    # the device, fed N's tokens on the device; N's results reach the host while N+1 runs,
    # and stops are seen a step late (the extra token is dropped): the same outputs as the
    # synchronous loop (False). Runs synchronous steps where the loop cannot overlap:
    # speculative decoding, multi-step decode, several processes (Engine.stats()
    # "async_scheduling" says which and why).
    async_scheduling: bool = True
    # Speculative decoding (engine/speculative.py): None | "ngram" (prompt lookup: the
    # tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    # n from ngram_prompt_lookup_max down to ngram_prompt_lookup_min) | "self" (the target
    # model's own weights quantized to speculative_quantization, optionally only its first
    # speculative_draft_layers layers, as a draft model) | "draft" (the model at
    # speculative_model: same vocabulary, smaller; engine/spec_draft.py). Up to
    # num_speculative_tokens are verified per sequence per step; speculation pauses while
    # more than speculative_disable_by_batch_size sequences run (verifying is no longer
    # nearly free then) and for a sequence whose drafts are mostly rejected.
    speculative_method: str | None = None
    speculative_model: str | None = None
    # "self" / "draft": the draft's weight quantization (None: as loaded) and, for "self",
    # how many of the target's layers it keeps (None: all). On CPU "int4" is the C++ kernel's
    # 4-bit panels (affine per 32 rows; the LM head int8): RESULTS.md "A 4-bit draft".
    # "auto" (draft_quantization): int4 where that kernel runs or the target is quantized,
    # else int8
    speculative_quantization: str | None = "auto"
    speculative_draft_layers: int | None = None
    # 7: one sequence and its draft fill a decode bucket of 8 slots (padding slots cost
    # about as much as used ones; benchmarks/RESULTS.md compares 3, 4 and 7)
    num_speculative_tokens: int = 7
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 2
    speculative_disable_by_batch_size: int = 2
    # "ngram" only: prompt lookup proposes up to this many continuations with different
    # first tokens, all verified in the same step, and the longest accepted one is kept
    # (a token tree branching at its root, FlexFlow/SpecInfer's idea: engine/spec_tree.py).
    # 1: one chain. Each extra chain costs its rows (benchmarks/RESULTS.md: a loss on CPU)
    speculative_tree_width: int = 1
    # When the step shapes (buckets) compile (engine/warmup.py): "full" all of them before
    # the engine returns; "background" those a first request needs, the rest in a thread
    # while it serves (`jaxinfer serve`, and `Engine()`: None means it unless the process
    # chose another default, warmup.use_default_mode); "lazy" those a first request needs,
    # any other when a step first needs it (one-shot runs: `jaxinfer generate`). Once warm
    # (all compiled, never for "lazy") no step compiles.
    warmup: str | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs, OpenAI echo + logprobs): every
    # prefill bucket gets a scoring twin that also computes all positions' logits
    # (engine/scoring.py), compiled after the others; off, such requests are refused.
    enable_prompt_logprobs: bool = False
    # Multi-LoRA (engine/lora.py, engine/lora_device.py): PEFT adapters served beside the
    # base model, a request picking one by name. ``max_loras`` device slots of rank
    # ``max_lora_rank`` (static: the step's adapter arrays are [K, max_loras * max_lora_rank]),
    # swapped least-recently-used from up to ``max_cpu_loras`` registered adapters (None:
    # 4 x max_loras). ``lora_modules``: (name, directory) pairs loaded at start; they turn
    # LoRA on, as does ``enable_lora`` (adapters loaded later, e.g. over HTTP).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    decode_buckets: tuple[int, ...] | None = None
    mixed_decode_buckets: tuple[int, ...] | None = None
    # (slots, positions per slot): a chunk longer than a slot fills several, so one shape
    # packs several prompts into a step (engine/batch.py)
    prefill_buckets: tuple[tuple[int, int], ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    # The sampler's rows are a step's sequences rounded up to a power of two, at least
    # this many. Each sampler width is an executable (~2-3 s to compile, ~26 MiB resident
    # on CPU). None: the widest any bucket needs, so one sampler serves every step (the
    # forwards write their rows into a per-width logits buffer in place, so the padding
    # costs no [rows, V] write per step: engine/runner.py forward_fn); 1: one sampler per
    # power of two. The tokens do not depend on it: rows are sampled independently.
    min_sampler_rows: int | None = None
    # The model's layers as one loop (models/layer_loop.py) where the C++ kernels allow it
    # (CPU, float32 or int8 KV pages, no LoRA / offload / pipeline stages, identical layers): each step
    # executable holds one layer instead of all of them (smaller, faster to trace and
    # compile), the same tokens; elsewhere the layers unroll. False: always unroll.
    layer_loop: bool = True
    # Float32 matmul weights whose values are exactly a block-quantized checkpoint's (a
    # GGUF's Q4_1 / Q8_0, dequantized by the loader) kept as those codes, 1.25 bytes a
    # weight instead of 4 (pallas_kernels/f32_matmul/codes.py): the CPU f32 kernel computes
    # with the very same floats, so the same bits. False: keep the floats.
    weight_codes: bool = True

    DEFAULT_KV_CACHE_MEMORY = 1 << 30
    MAX_LORA_RANK = 64
    HOST_KV_CACHE_RAM_FRACTION = 0.1

    def __post_init__(self) -> None:
        require(self.dtype in ("float32", "bfloat16"), "dtype",
                f"must be float32 or bfloat16, got {self.dtype!r}")
        require(self.page_size in (8, 16, 32, 64, 128), "page_size",
                f"must be one of 8, 16, 32, 64, 128, got {self.page_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "data_parallel_size", "num_scheduler_steps",
                     "pipeline_parallel_size", "min_sampler_rows"):
            v = getattr(self, name)
            if v is None and name == "min_sampler_rows":
                continue
            require(isinstance(v, int) and v >= 1, name, f"must be a positive integer, got {v!r}")
        require(self.quantization in (None, "int8", "int4"), "quantization",
                f"must be None, 'int8' or 'int4', got {self.quantization!r}")
        require(self.warmup in (None, "full", "background", "lazy"), "warmup",
                f"must be 'full', 'background', 'lazy' or None, got {self.warmup!r}")
        _check_speculative(self)
        _check_lora(self)
        _check_pipeline(self)
        _check_offload(self)
        require(self.kv_cache_dtype in (None, "auto", "model", "int8"), "kv_cache_dtype",
                f"must be None / 'auto' (int8 with quantized weights unless speculating, else the "
                f"model's dtype), "
                f"'model' or 'int8', got {self.kv_cache_dtype!r}")
        require(not (self.quantization and self.tensor_parallel_size > 1), "quantization",
                "quantization with tensor_parallel_size > 1 is not supported yet (the quantized "
                "weights' scales are not sharded)")
        v = self.tensor_parallel_size
        require(isinstance(v, int) and v >= 0, "tensor_parallel_size",
                f"must be a positive integer (or 0 for auto), got {v!r}")
        v = self.host_kv_cache_memory
        require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                "host_kv_cache_memory", f"must be a non-negative integer (bytes) or None, got {v!r}")
        v = self.long_prefill_token_threshold
        require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                "long_prefill_token_threshold", f"must be a non-negative integer (0 = no cap) or None "
                f"(auto), got {v!r}")
        require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
                f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        for name in ("kv_cache_memory", "num_pages", "max_model_len", "max_waiting", "max_queue_delay_ms"):
            v = getattr(self, name)
            require(v is None or (isinstance(v, int) and v >= 1), name,
                    f"must be a positive integer or None, got {v!r}")
        require(0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction",
                f"must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        require(self.num_pages is None or self.num_pages >= 2, "num_pages",
                "must be >= 2 (page 0 is the padding sink)")


def draft_quantization(c: "EngineConfig", int4_kernel: bool) -> str | None:
    """The draft's weight quantization, ``speculative_quantization`` with "auto" resolved:
    int4 for a quantized target (int8 would not be cheaper than an int8 one) and where the
    CPU kernel's 4-bit panels run (``int4_kernel``: on this VM they draft faster and agree
    more than int8, RESULTS.md "A 4-bit draft on a C++ kernel"), else int8 (an accelerator's
    int4 is symmetric per group of 64: 41% of its drafts agreed)."""
    q = c.speculative_quantization
    if q != "auto":
        return q
    return "int4" if c.quantization is not None or int4_kernel else "int8"


def kv_cache_dtype(c: "EngineConfig") -> str | None:
    """The KV pages' dtype, ``kv_cache_dtype`` with "auto" (None) resolved: "int8" or None
    (the model's dtype). "auto" stores int8 pages when the weights are quantized: a user who
    asks for quantized weights asks for a small footprint, and at the default model's
    32-request workload float32 pages are 0.36 GB, int8 pages 0.09 GB (the int8 server
    peaks at 565-619 MiB instead of ~0.9 GB: RESULTS.md "int8 KV pages by default"); int8
    pages add ~0.0008 to the int8 weights' mean KL of 0.0037 (RESULTS.md "Start-up beside
    llama.cpp and vLLM").
    ``kv_cache_dtype="model"`` keeps the model's dtype. Speculative decoding keeps the
    model's dtype under "auto": a user who asks for it asks for speed, and on an int8 model
    int8 pages took it from 1.10x to 0.96x (RESULTS.md "Speculation on an int8 target with
    its default int8 KV pages")."""
    d = c.kv_cache_dtype
    if d in (None, "auto"):
        return "int8" if c.quantization is not None and c.speculative_method is None else None
    return None if d == "model" else d


SPECULATIVE_METHODS = ("ngram", "self", "draft")
# The longest draft: the sampler's per-row draft-token arrays are this wide (engine/sampler.py)
MAX_SPECULATIVE_TOKENS = 16
DRAFT_METHODS = ("self", "draft")        # those that run a draft model

# vLLM's ``speculative_config`` keys -> EngineConfig fields (speculative_fields). "draft_layers"
# and "tree_width" are ours ('self' drafting with the first layers; prompt lookup's
# candidates verified at once); "draft_tensor_parallel_size" is accepted as 1.
SPECULATIVE_CONFIG_KEYS = {
    "method": "speculative_method", "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "ngram_prompt_lookup_max", "prompt_lookup_min": "ngram_prompt_lookup_min",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
    "quantization": "speculative_quantization", "draft_layers": "speculative_draft_layers",
    "tree_width": "speculative_tree_width",
}
# vLLM's method names (and ours) -> speculative_method; vLLM's trained heads (eagle, medusa,
# mtp, ...) need weights no checkpoint here carries
_SPECULATIVE_CONFIG_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "self": "self"}


def speculative_fields(spec: Any) -> dict[str, Any]:
    """vLLM's ``speculative_config`` (e.g. ``{"method": "ngram", "num_speculative_tokens": 5,
    "prompt_lookup_max": 4}``, or ``{"model": PATH, ...}`` for a draft model) as EngineConfig
    fields; the values are checked by EngineConfig itself. ValueError naming an unknown key,
    an unsupported method or a draft tensor-parallel size other than 1."""
    require(isinstance(spec, Mapping), "speculative_config",
            f"expected an object of speculative settings, got {type(spec).__name__}")
    known = (*SPECULATIVE_CONFIG_KEYS, "draft_tensor_parallel_size")
    unknown = sorted(map(str, set(spec) - set(known)))
    require(not unknown, "speculative_config", f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    require(spec.get("draft_tensor_parallel_size") in (None, 1), "speculative_config.draft_tensor_parallel_size",
            f"the draft runs on one device: must be 1, got {spec.get('draft_tensor_parallel_size')!r}")
    method = spec.get("method") or ("draft_model" if spec.get("model") is not None else None)
    require(method in _SPECULATIVE_CONFIG_METHODS, "speculative_config.method",
            f"must be one of {', '.join(map(repr, _SPECULATIVE_CONFIG_METHODS))} (or give 'model' for a "
            f"draft model), got {method!r}: methods that need trained draft heads (eagle, medusa, "
            "mtp) are not supported")
    out = {SPECULATIVE_CONFIG_KEYS[k]: v for k, v in spec.items() if k in SPECULATIVE_CONFIG_KEYS}
    out["speculative_method"] = _SPECULATIVE_CONFIG_METHODS[method]
    return out


def with_speculative_config(options: Mapping[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments with ``speculative_config`` (vLLM's dict) replaced by
    the fields it sets; ValueError where a field is also given on its own (which one wins
    would be a guess)."""
    out = dict(options)
    spec = out.pop("speculative_config")
    if spec is None:
        return out
    fields = speculative_fields(spec)
    both = sorted(set(fields) & {k for k, v in out.items() if v is not None})
    require(not both, "speculative_config", f"also given on its own: {', '.join(both)}; give each setting once")
    return {**out, **fields}


def _check_offload(c: "EngineConfig") -> None:
    require(c.offload_weights in ("none", "host"), "offload_weights",
            f"must be 'none' or 'host', got {c.offload_weights!r}")
    v = c.device_weight_memory
    require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), "device_weight_memory",
            f"must be a positive number of bytes or None, got {v!r}")
    if c.offload_weights == "none":
        return
    require(v is not None, "device_weight_memory", "offload_weights='host' needs the device budget in bytes")
    for name, bad in (("tensor_parallel_size", c.tensor_parallel_size != 1),
                      ("pipeline_parallel_size", c.pipeline_parallel_size > 1), ("enable_lora", c.enable_lora)):
        require(not bad, name, "cannot be combined with offload_weights='host' yet (one device per replica, "
                "no LoRA)")


def _check_pipeline(c: "EngineConfig") -> None:
    """Options a pipelined engine cannot run yet (the model-dependent checks, e.g. that the
    stages divide the layers, are engine/pipeline.py's)."""
    if c.pipeline_parallel_size == 1:
        return
    for name, bad, why in (
            ("num_scheduler_steps", c.num_scheduler_steps > 1, "multi-step decode runs on one device"),
            ("enable_lora", c.enable_lora, "LoRA slot arrays are not split into stages yet"),
            ("host_kv_cache_memory", bool(c.host_kv_cache_memory), "the host KV tier copies whole-model pages"),
            ("debug_poison_freed_pages", c.debug_poison_freed_pages, "page poisoning copies whole-model pages"),
            ("quantization", c.quantization is not None, "quantized weights are not split into stages yet")):
        require(not bad, name, f"cannot be combined with pipeline_parallel_size={c.pipeline_parallel_size} ({why})")


def _check_lora(c: "EngineConfig") -> None:
    """(Adapter names and files are checked when the engine loads them: engine/lora.py.)"""
    mods = c.lora_modules.items() if isinstance(c.lora_modules, dict) else c.lora_modules
    try:
        mods = tuple((n, p) for n, p in mods)
    except (TypeError, ValueError):
        raise ValueError(f"lora_modules: expected (name, path) pairs, got {c.lora_modules!r:.80}") from None
    require(all(isinstance(x, str) and x for m in mods for x in m), "lora_modules",
            "names and paths must be non-empty strings")
    require(len({n for n, _ in mods}) == len(mods), "lora_modules", "a name appears twice")
    object.__setattr__(c, "lora_modules", mods)
    if mods:
        object.__setattr__(c, "enable_lora", True)
    require(isinstance(c.max_loras, int) and not isinstance(c.max_loras, bool) and 1 <= c.max_loras <= 256,
            "max_loras", f"must be an integer in [1, 256], got {c.max_loras!r}")
    require(isinstance(c.max_lora_rank, int) and not isinstance(c.max_lora_rank, bool)
            and 1 <= c.max_lora_rank <= c.MAX_LORA_RANK, "max_lora_rank",
            f"must be an integer in [1, {c.MAX_LORA_RANK}], got {c.max_lora_rank!r}")
    if c.max_cpu_loras is None:
        object.__setattr__(c, "max_cpu_loras", 4 * c.max_loras)
    require(isinstance(c.max_cpu_loras, int) and c.max_cpu_loras >= max(c.max_loras, len(mods)),
            "max_cpu_loras", f"must be an integer >= max_loras ({c.max_loras}) and the number of "
            f"lora_modules ({len(mods)}), got {c.max_cpu_loras!r}")


def _check_speculative(c: "EngineConfig") -> None:
    m = c.speculative_method
    require(m in (None, *SPECULATIVE_METHODS), "speculative_method",
            f"must be None or one of {', '.join(map(repr, SPECULATIVE_METHODS))}, got {m!r}")
    for name in ("num_speculative_tokens", "ngram_prompt_lookup_max", "ngram_prompt_lookup_min",
                 "speculative_disable_by_batch_size", "speculative_tree_width"):
        v = getattr(c, name)
        require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name,
                f"must be a positive integer, got {v!r}")
    require(c.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
            f"must be <= {MAX_SPECULATIVE_TOKENS}, got {c.num_speculative_tokens}")
    require(c.speculative_tree_width <= 4, "speculative_tree_width", f"must be <= 4, got {c.speculative_tree_width}")
    require(c.speculative_tree_width == 1 or m == "ngram", "speculative_tree_width",
            f"candidates come from prompt lookup: > 1 needs speculative_method='ngram' (got {m!r})")
    require(c.ngram_prompt_lookup_min <= c.ngram_prompt_lookup_max, "ngram_prompt_lookup_min",
            f"must be <= ngram_prompt_lookup_max ({c.ngram_prompt_lookup_max}), got {c.ngram_prompt_lookup_min}")
    require(c.speculative_quantization in (None, "auto", "int8", "int4"), "speculative_quantization",
            f"must be None, 'auto', 'int8' or 'int4', got {c.speculative_quantization!r}")
    v = c.speculative_draft_layers
    require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), "speculative_draft_layers",
            f"must be a positive integer or None, got {v!r}")
    require(v is None or m == "self", "speculative_draft_layers",
            f"only applies to speculative_method='self' (got {m!r})")
    require((c.speculative_model is not None) == (m == "draft"), "speculative_model",
            "is required by speculative_method='draft' (a model with the target's vocabulary) and "
            f"only used by it (speculative_method={m!r})")
    if m == "self":
        q = draft_quantization(c, int4_kernel=False)    # "auto" is the same draft either way here
        require(v is not None or q not in (None, c.quantization), "speculative_method",
                f"'self' with speculative_quantization={q!r} and all layers would draft "
                f"with the target itself (quantization={c.quantization!r}): choose a cheaper draft "
                "(speculative_quantization int8 for a float target; int4 for an int8 one) "
                "or speculative_draft_layers, or speculative_method='ngram'")
    if m in DRAFT_METHODS:
        require(c.tensor_parallel_size == 1, "speculative_method",
                f"{m!r} runs its draft model on one device: tensor_parallel_size must be 1")
    if m is not None:
        require(c.num_scheduler_steps == 1, "speculative_method",
                "speculative decoding with num_scheduler_steps > 1 is not supported")
        require(c.data_parallel_size == 1, "speculative_method",
                "speculative decoding with data_parallel_size > 1 is not supported")
