"""One data-parallel replica: its scheduler, KV pages (block manager) and device runner,
and the penalty-state rows its running sequences hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxinfer.engine.batch import PAD_ROW
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduler import Scheduler, SchedulerOutput, long_prefill_threshold
from jaxinfer.engine.sequence import Sequence


@dataclass
class Replica:
    scheduler: Scheduler
    block_manager: BlockManager
    runner: Any                                   # engine.runner.ModelRunner
    free_rows: list[int]                          # penalty-state rows not in use
    poison_freed_pages: bool = False              # EngineConfig.debug_poison_freed_pages
    rows: dict[int, int] = field(default_factory=dict)   # seq_id -> penalty-state row

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step's sequences, with the block manager's page moves done on the
        device, preempted sequences' rows released and every scheduled one given a row."""
        sched = self.scheduler.schedule(drafts)
        self.apply_page_ops()
        for seq in sched.preempted:
            self.release_row(seq)
        for e in sched.scheduled:
            if e.seq.seq_id not in self.rows:
                # a speculation tree's branch has no penalties (engine/spec_tree.py): the sink row
                self.rows[e.seq.seq_id] = PAD_ROW if self.scheduler.is_branch(e.seq) else self.free_rows.pop()
        return sched

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
        if row is not None and row != PAD_ROW:
            self.free_rows.append(row)

    def finish(self, seq: Sequence, reason: str, stop_reason: Any) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        self.release_row(seq)

    def abort(self, request_id: str) -> None:
        for seq in self.scheduler.abort(request_id):
            self.release_row(seq)


def make_replica(config: Any, kv_spec: Any, ladders: Any, max_model_len: int, num_host_pages: int,
                 model: Any, mesh: Any, attention: str, publisher: Any, model_config: Any = None,
                 loras: Any = None, stack_kv: bool = True, samplers: dict | None = None) -> Replica:
    """``loras``: the engine's lora.LoraRegistry (multi-LoRA on) or None; ``model_config``
    the loaded model's ModelConfig (before any KV-head repeat), which adapters are read for;
    ``stack_kv`` False: the per-layer KV pool (a 'self' draft steps on its first layers);
    ``samplers``: sampler executables compiled already, by width (build.samplers_first)."""
    from jaxinfer.engine.runner import ModelRunner

    c = config
    bm = BlockManager(kv_spec.num_pages, c.page_size, c.enable_prefix_caching,
                      num_host_pages=num_host_pages, record_freed=c.debug_poison_freed_pages)
    sched = Scheduler(bm, c.max_num_seqs, c.max_num_batched_tokens, max_model_len, c.max_waiting,
                      prefill_shapes=ladders.prefill_shapes, max_loras=c.max_loras if loras else None,
                      policy=c.scheduling_policy,
                      long_prefill_token_threshold=long_prefill_threshold(c.long_prefill_token_threshold,
                                                                          c.max_num_batched_tokens))
    offload_layers: tuple[int, ...] = ()
    if c.offload_weights == "host":
        from jaxinfer.engine import offload
        offload_layers = offload.plan(*offload.layer_bytes(model), c.device_weight_memory)
    lora = None
    if loras is not None:
        from jaxinfer.engine.lora_device import LoraSlots
        lora = LoraSlots(model_config, model.cfg, c.max_loras, c.max_lora_rank, model.dtype, mesh)
    runner = ModelRunner(model, kv_spec, c.max_num_seqs + 1, attention, c.batch_invariant,
                         mesh=mesh, publisher=publisher, num_scheduler_steps=c.num_scheduler_steps, lora=lora,
                         offload_layers=offload_layers, layer_loop=c.layer_loop, stack_kv=stack_kv)
    runner.samplers.update(samplers or {})
    # beam search forks copy pages on the device: that copy is always there
    runner.enable_page_moves(bm.host.num_slots, host=bool(bm.host.num_slots or c.debug_poison_freed_pages))
    return Replica(sched, bm, runner, list(range(c.max_num_seqs, 0, -1)), c.debug_poison_freed_pages)
