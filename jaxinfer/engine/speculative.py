"""Speculative decoding: propose a few tokens per decoding sequence, verify them all in one
ordinary ragged step, keep the longest accepted run.

Host only (numpy, no jax). The engine consults a ``Speculator`` at two points of its step:

* before scheduling, ``propose`` returns drafts {seq_id: tokens}; the scheduler budgets
  and allocates pages for 1 + len(draft) tokens of each such sequence
  (``Scheduler.schedule(drafts)``), and the batch builder gives it 1 + len(draft)
  consecutive decode slots: slot j feeds the token at position start + j (the last
  sampled token, then the draft) and, since a step writes its K/V before any slot
  attends, sees the draft before it as context. Verification is therefore an ordinary
  decode bucket (no new shapes, nothing compiled after warm-up) whose sampler row j is
  the target's next-token choice after the first j draft tokens.
* after the step, ``postprocess`` accepts draft token j while it equals the token the
  target sampled at slot j - 1; the first mismatch (or the slot after the last draft)
  gives one more token of the target's own. The accepted run is fed back through the
  engine's one-token postprocessing, one position at a time, exactly as that many plain
  decode steps would be (stop tokens and strings, max_tokens, logprobs, grammar state),
  so a stop in the middle of a run ends the sequence there and drops the rest. Then the
  pages that hold only rejected tokens' KV are freed (``BlockManager.trim``); the
  rejected positions are past ``num_computed_tokens``, so the prefix cache never
  registers them.

Why this is exact. Greedy: slot j's row is bitwise the row a plain decode step would
compute at that position (the kernels are batch-invariant), so accepted tokens are the
plain path's tokens. Temperature > 0: the drafts are deterministic (a proposal q that puts
all its mass on the draft token d), for which the rejection-sampling rule of Leviathan et
al. accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise samples from
norm(max(p - q, 0)) = p without d. Sampling t ~ p and accepting iff t == d is that rule:
P(accept) = p(d), and a rejected t is distributed as p given t != d. Each slot samples
with the key (seed, output index) the plain path would use, so a seeded request gives the
same tokens with and without speculation.

Constrained sequences (a grammar, logit_bias, min_tokens, bad_words) speculate: a draft is
cut to the prefix its grammar accepts (``allowed``), and verification slot j gets the token
mask plain decoding would use after the first j draft tokens (guided.fill_run: the grammar
matcher steps through them and rolls back), so the sampled tokens are still the plain
path's; the accepted run then advances the grammar one token at a time.

Penalties (repetition / presence / frequency) speculate too: a draft token is fed without
being counted in the sequence's penalty-state row (batch.py gives it the sink row), slot j's
penalties count the first j draft tokens on top of the row (``SamplingTensors.draft_before``),
and the accepted ones are folded into the row at the sequence's next step
(``Sequence.uncounted_tokens`` -> ``SamplingTensors.counts_add``), so every slot sees the
counts plain decoding would. Such a sequence verifies one chain (no tree branches).

Not speculated (they decode one token per step as usual): beam search; steps that carry a
prefill or could admit one; batches larger than ``speculative_disable_by_batch_size``;
a sequence whose recent drafts were mostly rejected, for a while (the pause rule below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from jaxinfer.engine_config import EngineConfig
from jaxinfer.engine.output import replay_runs
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.spec_tree import TreeBranches

# A sequence whose moving average of accepted draft tokens per verification (each round
# moves it a quarter of the way: acceptance comes in bursts, and one bad round should not
# cost a long pause) falls below its method's floor stops proposing for a while: a
# verification step (and a draft model's proposals) costs more than a plain step, which
# few accepted tokens do not pay back.
# Prompt lookup: floor half a token, first pause 8 steps (its proposals are free; a failed
# round costs only the verification's extra rows, ~0.65 of a plain step for float32 on a
# 2-core CPU). A draft model: floor half the draft length, first pause 32 steps (its k
# proposals cost k draft steps: at ~0.46 of a float32 target step each, a round of 7 pays
# from ~4 accepted tokens on, and a failed one wastes ~4 plain steps: benchmarks/RESULTS.md).
# After a pause one round is tried; if it fails too the next pause doubles, up to
# MAX_PAUSE_STEPS, so a sequence that never gains (say, under a penalty the draft does not
# apply) pays for a probe every so often, not every few steps.
MIN_ACCEPTED = 0.5
MIN_ACCEPTED_DRAFT_FRACTION = 0.5
PAUSE_STEPS = 8
PAUSE_STEPS_DRAFT = 32
MAX_PAUSE_STEPS = 128


class NgramProposer:
    """Prompt lookup (vLLM's ngram proposer): find the latest earlier occurrence of the
    sequence's last n tokens (n from ``max_n`` down to ``min_n``) in its prompt and output
    so far, and propose the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """``tokens``: i32[L] the sequence so far -> up to ``k`` proposed tokens."""
        chains = self.candidates(tokens, k, 1)
        return chains[0] if chains else []

    def candidates(self, tokens: np.ndarray, k: int, width: int) -> list[list[int]]:
        """Up to ``width`` proposals (each up to ``k`` tokens) with different first tokens:
        first ``propose``'s, then those after other occurrences, latest first, longest
        match first (token-tree speculation: engine/spec_tree.py)."""
        L, out, firsts = len(tokens), [], set()
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows[i] = tokens[i:i+n], for starts whose continuation exists (i + n < L)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if not len(hits):
                continue
            if not out:
                # the latest occurrence followed by k tokens, else the earliest (the latest
                # may sit just before the end, with almost nothing after it)
                full = hits[hits + n + k <= L]
                start = int(full[-1] if len(full) else hits[0]) + n
                out.append(tokens[start:start + k].tolist())
                firsts.add(out[0][0])
                if len(out) == width:
                    return out
            # then the latest occurrence of each first token not proposed yet
            hits = hits[::-1]
            nxt = tokens[hits + n]
            _, at = np.unique(nxt, return_index=True)
            for i in np.sort(at):
                if int(nxt[i]) not in firsts:
                    firsts.add(int(nxt[i]))
                    out.append(tokens[hits[i] + n:hits[i] + n + k].tolist())
                    if len(out) == width:
                        return out
        return out


@dataclass(slots=True)
class _SeqState:
    accepted: float              # moving average of draft tokens accepted per verification
    paused: int = 0              # steps left without proposing
    failed: int = 0              # pauses since the last round that met the floor


@dataclass
class Speculator:
    """Proposals before a step, acceptance after it, and vLLM's spec-decode counters."""

    config: EngineConfig
    proposer: Any          # NgramProposer, or a draft model's (engine/spec_draft.py: propose(sched, wanted, ensure))
    tree: TreeBranches | None = None      # speculative_tree_width > 1 (engine/spec_tree.py)
    num_drafts: int = 0                   # verified drafts (one per sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # accepted draft tokens by position
    _states: dict[int, _SeqState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.config.num_speculative_tokens
        lookup = isinstance(self.proposer, NgramProposer)
        self.min_accepted = MIN_ACCEPTED if lookup else MIN_ACCEPTED_DRAFT_FRACTION * self.config.num_speculative_tokens
        self.pause_steps = PAUSE_STEPS if lookup else PAUSE_STEPS_DRAFT

    def propose(self, sched: Scheduler, max_slots: int, eligible: Callable[[Sequence], bool],
                ensure: Callable[[Any, Any], None] | None = None,
                allowed: Callable[[Sequence, list[int]], int] | None = None) -> dict[int, list[int]]:
        """Drafts for this step's decoding sequences ({} = a plain step). Only when every
        running sequence decodes and nobody can be admitted (so the step is decode-only and
        fits the decode ladder), at most ``speculative_disable_by_batch_size`` of them, and
        in at most ``max_slots`` decode slots (the largest decode bucket) in all.
        ``ensure(runner, bucket)``: compiles a draft model's bucket that warm-up has not
        reached yet (engine/warmup.py). ``allowed(seq, draft)``: how many leading tokens of
        a draft the sequence's grammar accepts (a draft is cut there; an empty one dropped)."""
        c, running = self.config, sched.running
        if not self._may_speculate(sched):
            return {}
        self._states = {s.seq_id: self._states.get(s.seq_id) or _SeqState(2 * self.min_accepted) for s in running}
        spare = min(max_slots, sched.max_num_batched_tokens) - len(running)
        drafts: dict[int, list[int]] = {}
        wanted: list[tuple[Sequence, int]] = []      # a draft model's: (sequence, tokens), all at once
        extra: list[tuple[Sequence, list[list[int]]]] = []    # the tree's other chains
        for seq in running:
            if self._sits_out(seq):
                continue
            # no token past max_tokens or max_model_len is ever fed
            k = min(c.num_speculative_tokens, spare, seq.params.max_tokens - seq.num_output_tokens - 1,
                    sched.max_model_len - seq.num_tokens)
            if k <= 0 or not eligible(seq):
                continue
            if isinstance(self.proposer, NgramProposer):
                chains = self._ngram_chains(seq, k, allowed)
                if chains:
                    drafts[seq.seq_id] = chains[0]
                    spare -= len(chains[0])
                    if len(chains) > 1:
                        extra.append((seq, chains[1:]))
            else:
                wanted.append((seq, k))
                spare -= k
        if wanted:
            drafts.update(self._model_drafts(sched, wanted, ensure, allowed))
        if extra and self.tree is not None:
            self.tree.grow(sched, drafts, extra, spare)
        return drafts

    def _may_speculate(self, sched: Scheduler) -> bool:
        """Every running sequence decodes, nobody can be admitted and at most
        ``speculative_disable_by_batch_size`` run."""
        running = sched.running
        if not running or len(running) > self.config.speculative_disable_by_batch_size:
            return False
        if sched.waiting and len(running) < sched.max_num_seqs:
            return False
        return all(s.num_new_tokens_needed == 1 for s in running)

    def _sits_out(self, seq: Sequence) -> bool:
        """``seq`` is paused (its drafts kept failing: ``_pace``) and sits this round out;
        after its last paused round, one round to prove itself."""
        st = self._states[seq.seq_id]
        if not st.paused:
            return False
        st.paused -= 1
        if not st.paused:
            st.accepted = self.min_accepted
        return True

    def _ngram_chains(self, seq: Sequence, k: int, allowed: Callable[[Sequence, list[int]], int] | None
                      ) -> list[list[int]]:
        """Prompt lookup's continuations of ``seq`` (up to ``k`` tokens; one chain for a
        penalized sequence, else up to the tree's width), each cut where the grammar stops
        accepting, empty ones dropped."""
        chains = self.proposer.candidates(np.asarray(seq.all_token_ids, np.int32), k,
                                          1 if seq.params.penalized else self.config.speculative_tree_width)
        if allowed is not None:
            chains = [ch[:allowed(seq, ch)] for ch in chains]
            chains = [ch for ch in chains if ch]
        return chains

    def _model_drafts(self, sched: Scheduler, wanted: list[tuple[Sequence, int]], ensure: Any,
                      allowed: Callable[[Sequence, list[int]], int] | None) -> dict[int, list[int]]:
        """A draft model's proposals for ``wanted`` (sequence, tokens), all in one run, each
        cut where the grammar stops accepting; empty ones dropped."""
        proposed = self.proposer.propose(sched, wanted, ensure)
        if allowed is not None:
            for seq, _ in wanted:
                draft = proposed.get(seq.seq_id, [])
                proposed[seq.seq_id] = draft[:allowed(seq, draft)]
                if draft and not proposed[seq.seq_id]:
                    # the draft model's work bought nothing: a round with none accepted
                    self._pace(seq, 0)
        return {i: d for i, d in proposed.items() if d}

    def verifies(self, sched: SchedulerOutput) -> bool:
        """Whether the step needs ``postprocess`` and ``rollback``: it verified a draft, or
        branches of a tree exist (they end with the step even if none was scheduled)."""
        return any(e.draft for e in sched.scheduled) or bool(self.tree and self.tree.parent_of)

    def postprocess(self, apply: Callable[..., list[Any]], sched: SchedulerOutput,
                    entries: list[tuple[int, ScheduledSeq]], token_ids: np.ndarray, bm: Any) -> list[Any]:
        """Accept each draft's longest verified run (of its tree's chains, the longest:
        engine/spec_tree.py) and feed the run through ``apply`` (the engine's one-token
        postprocessing: (sched, entries) -> requests touched), one position at a time.
        ``token_ids`` i32[S']: the token sampled at each slot; ``bm``: the block manager
        (a winning branch's pages move to its parent). Returns the requests touched, each
        once, finished ones last."""
        tree = self.tree
        branches: dict[int, list[tuple[int, ScheduledSeq]]] = {}      # parent seq_id -> its branches' entries
        if tree is not None:
            for slot, e in entries:
                if tree.is_branch(e.seq):
                    branches.setdefault(tree.parent_of[e.seq.seq_id].seq_id, []).append((slot, e))
        runs: list[tuple[int, Sequence, int, int]] = []      # (first slot, seq, tokens to emit, stride)
        first = []
        for slot, e in entries:
            if tree is not None and tree.is_branch(e.seq):
                continue            # verified with its parent; never postprocessed itself
            if e.draft:
                tries = [(s, x, self._accepted(x, token_ids[s:s + len(x.draft)]))
                         for s, x in [(slot, e)] + branches.get(e.seq.seq_id, [])]
                win, n = tree.pick(tries, bm) if len(tries) > 1 else (slot, tries[0][2])
                self._record(e.seq, sum(len(x.draft) for _, x, _ in tries), n)
                if e.seq.params.penalized:        # fed uncounted: counted at the next step
                    e.seq.uncounted_tokens = token_ids[win:win + n].tolist()
                # the root row (slot 0 of every chain) is the same bits in each: the
                # parent's gives the first token, the winner's slots the rest
                runs.append((win, e.seq, n + 1, 1))
                e = ScheduledSeq(e.seq, e.start_pos, 1, True)
            first.append((slot, e))
        return replay_runs(lambda sc, en, i: apply(sc, en),
                           (SchedulerOutput([e for _, e in first], sched.preempted, len(first)), first), runs)

    def rollback(self, sched: SchedulerOutput, replica: Any) -> None:
        """Free the pages of rejected positions: a speculating sequence keeps pages for its
        computed tokens only (the next step allocates what it needs); end the step's
        branches. ``replica``: engine/replica.Replica."""
        for e in sched.scheduled:
            if e.draft and not e.seq.is_finished and not (self.tree and self.tree.is_branch(e.seq)):
                replica.block_manager.trim(e.seq, e.seq.num_computed_tokens)
        if self.tree is not None:
            self.tree.drop(replica)

    @staticmethod
    def _accepted(e: ScheduledSeq, sampled: np.ndarray) -> int:
        """Draft tokens accepted: draft[j] stands while the target sampled it at slot j."""
        n = 0
        while n < len(e.draft) and int(sampled[n]) == e.draft[n]:
            n += 1
        return n

    def _record(self, seq: Sequence, num_draft_tokens: int, n: int) -> None:
        """Count one verified draft (all its chains' tokens) of which ``n`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += n
        for j in range(n):
            self.accepted_per_pos[j] += 1
        self._pace(seq, n)

    def _pace(self, seq: Sequence, n: int) -> None:
        """A round of ``seq``'s speculation yielded ``n`` draft tokens: pause it while its
        moving average stays under the method's floor, longer after each failed probe."""
        st = self._states.get(seq.seq_id)
        if st is not None:
            st.accepted = 0.75 * st.accepted + 0.25 * n
            if n >= self.min_accepted:
                st.failed = 0
            if st.accepted < self.min_accepted:
                st.paused = min(self.pause_steps << st.failed, MAX_PAUSE_STEPS)
                st.failed = min(st.failed + 1, 8)

    def stats(self) -> dict[str, Any]:
        """vLLM's spec-decode counters (per-position: accepted draft tokens at position j),
        and with a token tree its branches verified and won."""
        out = {"spec_decode_num_drafts": self.num_drafts,
               "spec_decode_num_draft_tokens": self.num_draft_tokens,
               "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
               "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
        if self.tree is not None:       # ours: whether the tree's extra chains pay
            out.update(spec_decode_num_tree_branches=self.tree.num_branches,
                       spec_decode_num_tree_branch_wins=self.tree.num_wins)
        return out


def make_speculator(config: EngineConfig, draft: Any = None) -> Speculator | None:
    """``draft``: the proposer of the draft-model methods (spec_draft.DraftProposer)."""
    if config.speculative_method is None:
        return None
    return Speculator(config, draft or NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max),
                      TreeBranches() if config.speculative_tree_width > 1 else None)


def speculable(seq: Sequence) -> bool:
    """Whether ``seq`` may speculate: not in a beam search (its tokens are chosen on the
    host after each step). A token mask (grammar, min_tokens, bad words, logit_bias) is
    fine: each verification slot gets the mask plain decoding would use there
    (guided.fill_run); so are penalties (the module's docstring: how)."""
    return seq.params.beam_width == 1



def spec_decode_sizes(decode_sizes: tuple[int, ...], num_speculative_tokens: int, tree_width: int = 1
                      ) -> tuple[int, ...]:
    """The decode ladder, grown by powers of two so one sequence and its whole draft (every
    chain of its tree) fit (a one-sequence engine has decode buckets of 1 slot only)."""
    need, sizes = tree_width * (num_speculative_tokens + 1), set(decode_sizes)
    n = 1
    while n < need:
        n *= 2
        sizes.add(n)
    return tuple(sorted(sizes))
