"""Several processes (hosts) running one engine: process 0 schedules, the others replay.

Under ``jax.distributed`` every process must run the same step on the same global batch.
We keep ONE scheduler, on process 0, and broadcast each step's host arrays (the padded
batch, the sampling tensors) to the other processes, which run the same executable on
them. Why not deterministic schedulers everywhere: a scheduler's decisions depend on
when requests arrive and when clients disconnect (aborts), which only the process
holding the HTTP server sees; replicating that input stream exactly is harder than
replicating its output, which is a few small arrays per step.

The channel is jax.distributed's own key-value store (the coordinator service): no XLA
computation, so nothing to compile per bucket, and no collective outside the step. A
message is a JSON header (bucket, dtypes, shapes) + the arrays' raw bytes: nothing is
unpickled. Process 0 deletes step n's message once step n has finished: every step's
forward is a collective over all processes (the model axis spans them), so by then
every follower has read it.
"""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import jax
import numpy as np

from jaxinfer.engine import sampler as S
from jaxinfer.engine.batch import STEP_ARRAYS, Bucket

log = logging.getLogger("jaxinfer")

_PREFIX = "jaxinfer/step/"
_STOP = b"stop"


def _treedef():
    """Structure of a step's host arrays (batch.step_args)."""
    return jax.tree.structure({"arrays": {k: 0 for k in STEP_ARRAYS},
                               "t": S.sampling_tensors_from_params([], [], [], 1),
                               "sample_rows": 0, "keep_rows": 0})


def encode(bucket: Bucket, host: dict[str, Any]) -> bytes:
    leaves = [np.ascontiguousarray(x) for x in jax.tree.leaves(host)]
    header = json.dumps({"bucket": [bucket.num_decode, bucket.num_prefill, bucket.prefill_chunk,
                                    bucket.max_pages, bucket.score, bucket.min_sample_rows],
                         "leaves": [[x.dtype.str, list(x.shape)] for x in leaves]}).encode()
    return struct.pack("<I", len(header)) + header + b"".join(x.tobytes() for x in leaves)


def decode(payload: bytes) -> tuple[Bucket, dict[str, Any]]:
    (n,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4:4 + n])
    off, leaves = 4 + n, []
    for dtype, shape in header["leaves"]:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        leaves.append(np.frombuffer(payload, dt, count, off).reshape(shape))
        off += count * dt.itemsize
    return Bucket.of(*header["bucket"]), jax.tree.unflatten(_treedef(), leaves)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-process engine: jax.distributed is not initialized")
    return client


class StepPublisher:
    """Process 0's side: one message per step, deleted once the step has run everywhere."""

    def __init__(self) -> None:
        self.client = _client()
        self.n = 0

    def publish(self, bucket: Bucket, host: dict[str, Any]) -> None:
        self.client.key_value_set_bytes(f"{_PREFIX}{self.n}", encode(bucket, host))
        self.n += 1

    def step_done(self) -> None:
        """Called after the last published step's outputs were fetched."""
        if self.n:
            self.client.key_value_delete(f"{_PREFIX}{self.n - 1}")

    def stop(self) -> None:
        self.client.key_value_set_bytes(f"{_PREFIX}{self.n}", _STOP)


def follow(runner: Any, poll_ms: int = 1000) -> int:
    """A follower process's loop: replay every step process 0 publishes, until it stops.
    Returns the number of steps run."""
    client = _client()
    n = 0
    while True:
        try:
            payload = client.blocking_key_value_get_bytes(f"{_PREFIX}{n}", poll_ms)
        except Exception as e:   # noqa: BLE001 (jaxlib raises its own runtime error type)
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                continue         # process 0 is idle: keep waiting
            raise
        if payload == _STOP:
            log.info("follower: process 0 stopped after %d steps", n)
            return n
        bucket, host = decode(payload)
        runner.run_host_step(bucket, host, sample=False).block_until_ready()
        n += 1
