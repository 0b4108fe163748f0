"""The engine: a request's walk from HTTP to the response, one module per stop.

1. ``serving/app.py`` routes the request; ``serving/protocol.py`` (and ``guided_protocol``,
   ``tools``) reads the JSON body into a ``GenRequest``: prompt, ``SamplingParams``
   (``jaxinfer/sampling_params.py`` validates every field), and how to render the answer.
2. ``engine/async_engine.py`` tokenizes (chat template included) in a worker thread and
   posts "add" to the engine thread's inbox; the engine thread runs ``Engine.step`` in a
   loop and hands each request its deltas through an asyncio queue.
3. ``engine/engine.py`` ``Engine.add_request`` makes the request's sequences
   (``sequence.py``, one per sample), its detokenizers and grammar state (``guided.py``),
   and gives them to a replica's scheduler (``replica.py``; data parallelism picks the
   replica holding the longest cached prefix).
4. ``scheduler.py`` decides each step's work: decodes first, then prefill chunks, then
   admissions, within the token budget and the free pages (``block_manager.py``: paged
   KV, refcounts, prefix cache, host tier); it preempts by recompute when pages run out.
   ``speculative.py`` may add drafts to decoding sequences.
5. ``batch.py`` pads the step into the cheapest compiled bucket: fixed-shape numpy arrays
   (``STEP_ARRAYS``), the only place that pads.
6. ``runner.py`` runs two AOT-compiled executables on the device: the forward over the
   ragged batch (``models/``, attention from ``attention/dispatch.py``, matmuls from
   ``jaxinfer/matmul.py``; KV pages donated) and the sampler (``sampler.py``; grammar
   masks from ``guided.py`` built on the host meanwhile; the watermark's bias from
   ``watermark.py``). One device->host copy of the packed tokens and logprobs per step; a
   scoring step (prompt logprobs, ``scoring.py``) also returns every prompt position's.
7. ``output.py`` applies the tokens: logprobs, grammar state, stop tokens and strings
   (``detokenizer.py``), max_tokens; finished sequences free their pages and rows. Beam
   search (``beam.py``), best_of and scoring-only requests hook in through ``search.py``.
8. ``async_engine.py`` grows each request's cumulative output from the deltas;
   ``serving/protocol.py`` renders OpenAI or TGI JSON / SSE chunks back to the client.

Start-up (``Engine.__init__``): ``resources.py`` places the model (meshes, replicas) and
sizes the KV pool; ``warmup.py`` compiles the buckets a first request needs, then the rest.
"""
