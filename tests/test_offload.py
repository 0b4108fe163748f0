"""Weight offload (engine/offload.py): layers whose weights do not fit the device budget
live in host memory and are copied to the device a layer ahead of use.

On CPU, XLA offers the memory kinds ``device``, ``pinned_host`` and ``unpinned_host`` (all
host RAM) and runs the same code path: weights placed in ``pinned_host``, the step
compiled for them, the per-layer copies issued inside it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine_config import EngineConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine import offload

# A tiny 4-layer model (tests/tp_worker.py's), small buckets.
KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=24, page_buckets=(8,),
          min_sampler_rows=16, decode_buckets=(1, 4), mixed_decode_buckets=(0, 4), prefill_buckets=((2, 16),), progress=False)


@pytest.fixture(scope="module")
def tiny():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tp_worker import tiny_loaded

    return tiny_loaded("llama_8q4kv", num_layers=4)


def budget_for(loaded, resident_layers: int) -> int:
    other, per = offload.layer_bytes(loaded.model)
    return other + sum(per[:resident_layers]) + per[resident_layers] // 2


@pytest.fixture(scope="module")
def engines(tiny):
    """(offload on: layer 0 resident, layers 1-3 in host memory; offload off; the budget)."""
    from jaxinfer.engine.engine import Engine

    budget = budget_for(tiny, 1)
    return (Engine(loaded=tiny, offload_weights="host", device_weight_memory=budget, **KW),
            Engine(loaded=tiny, **KW), budget)


def test_tokens_identical_and_resident_bytes_under_budget(engines):
    """Offload on and off: the same tokens and logprob bits for a mix of prompts (chunked
    prefill, batched decode); the weights in device memory stay under the budget and the
    offloaded ones are in host memory."""
    on, off, budget = engines
    host_kind = offload.host_memory_kind(on.runner.state_leaves[0].sharding.device_set.pop())
    dev, host = offload.resident_bytes(on.runner.state_leaves)
    assert 0 < dev <= budget < dev + host
    kinds = {x.sharding.memory_kind for x in on.runner.state_leaves}
    assert kinds == {"device", host_kind}, kinds
    assert offload.resident_bytes(off.runner.state_leaves)[1] == 0
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 200, size=n).tolist() for n in (5, 40, 17, 3, 29)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    a, b = on.generate(prompts, sp), off.generate(prompts, sp)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [(p.logprob, p.top) for p in x.outputs[0].logprobs] == [(p.logprob, p.top) for p in y.outputs[0].logprobs]


def test_step_takes_host_weights(engines):
    """The compiled step's offloaded parameters are annotated with the host memory kind (it
    reads them from there; nothing copies them to the device before the call)."""
    from jaxinfer.engine.batch import Bucket

    eng = engines[0]
    b = Bucket.of(1, 0, 0, 8)
    text = eng.runner.lower_forward(b).as_text()
    host_kind = offload.host_memory_kind(eng.runner.state_leaves[0].sharding.device_set.pop())
    n_host = sum(1 for x in eng.runner.state_leaves if x.sharding.memory_kind == host_kind)
    assert n_host > 0 and text.count(f'mhlo.memory_kind = "{host_kind}"') >= n_host


def test_plan():
    assert offload.plan(10, [5, 5, 5, 5], 21) == (2, 3)
    assert offload.plan(10, [5, 5, 5, 5], 30) == ()
    assert offload.plan(10, [5, 5, 5, 5], 10) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="device_weight_memory: 9 bytes is less than .* need on the device"):
        offload.plan(10, [5], 9)


def test_config_refusals():
    with pytest.raises(ValueError, match="device_weight_memory: offload_weights='host' needs"):
        EngineConfig(offload_weights="host")
    with pytest.raises(ValueError, match="offload_weights: must be 'none' or 'host'"):
        EngineConfig(offload_weights="disk")
    for kw, name in ((dict(tensor_parallel_size=2), "tensor_parallel_size"),
                     (dict(pipeline_parallel_size=2), "pipeline_parallel_size"), (dict(enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=f"{name}: cannot be combined with offload_weights='host'"):
            EngineConfig(offload_weights="host", device_weight_memory=1 << 30, **kw)
