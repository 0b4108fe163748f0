"""Token-tree speculation for prompt lookup (``EngineConfig.speculative_tree_width`` > 1):
several candidate continuations of a sequence verified in one step, the longest accepted
one kept (FlexFlow Serve / SpecInfer verify a token tree; this tree branches at its root).

Candidates: ``NgramProposer.candidates`` (engine/speculative.py), up to ``width`` chains
with different first tokens (a chain that agrees with another on its first token is a
subtree of it: it would verify nothing the other does not).

Verification rides on the step as it is, no tree attention mask and no second path: the
first chain is the sequence's ordinary draft; each other chain goes to a *branch*, a
short-lived copy of the sequence (``Scheduler.branch``: full pages shared, the partially
filled last page copied, BlockManager.fork) scheduled right after it as one more
speculating sequence. A chain's slots attend to the shared context and to the chain
before them in the branch's own pages, so every slot's row is bitwise the row a plain
decode would compute there (batch-invariant kernels); the root row (the last sampled
token) is computed once per chain, which is all a branch costs beyond its chain.

After the step (``pick``): the chain with the longest accepted run wins, the parent's
own on a tie. A branch that wins gives the parent its pages (BlockManager.swap_pages: the
KV at those positions is the target's for exactly the accepted tokens) and takes the
parent's. ``drop`` then ends every branch: their pages go back (the copy included), their
row mapping too. A branch is never a sample of the request: it takes no place in
``max_num_seqs`` and no penalty-state row (it has no penalties: the sink row), is never
postprocessed, never preempts anything (grown only where the free pages and decode slots
hold it after every real sequence's own needs) and never outlives its step.

When it pays: an extra chain costs 1 + its length rows of verification. On a GPU's
memory-bound decode step rows are nearly free; on a CPU each row costs compute
(benchmarks/RESULTS.md "Token-tree speculation": measured there).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler
from jaxinfer.engine.sequence import Sequence


class TreeBranches:
    """The branches of one step: grown before scheduling, picked from and dropped after."""

    def __init__(self) -> None:
        self.parent_of: dict[int, Sequence] = {}      # branch seq_id -> its parent
        self._branches: list[Sequence] = []
        self.num_branches = 0       # chains verified in branches, and how many of them won
        self.num_wins = 0

    def grow(self, sched: Scheduler, drafts: dict[int, list[int]],
             extra: list[tuple[Sequence, list[list[int]]]], spare_slots: int) -> None:
        """A branch per extra chain while decode slots and pages allow, after
        every running sequence's own step and draft (so scheduling never preempts for a
        branch): ``drafts[branch.seq_id] = chain``."""
        bm = sched.bm
        spare_pages = bm.num_free_pages - sum(
            max(0, bm.pages_for(s.num_tokens + len(drafts.get(s.seq_id, ()))) - len(s.page_ids))
            for s in sched.running)
        for parent, chains in extra:
            full = parent.num_computed_tokens // bm.page_size
            for chain in chains:
                need = bm.pages_for(parent.num_tokens + len(chain)) - full
                if 1 + len(chain) > spare_slots or need > spare_pages:
                    return
                child = sched.branch(parent)
                if child is None:
                    return
                self.parent_of[child.seq_id] = parent
                self.num_branches += 1
                self._branches.append(child)
                drafts[child.seq_id] = chain
                spare_slots -= 1 + len(chain)
                spare_pages -= need

    def is_branch(self, seq: Sequence) -> bool:
        return seq.seq_id in self.parent_of

    def pick(self, tries: list[tuple[int, ScheduledSeq, int]], bm: Any) -> tuple[int, int]:
        """``tries``: (first slot, entry, accepted tokens) of a sequence's own chain, then
        of its branches' -> (slot of the winning chain, its accepted tokens). A winning
        branch's pages become the parent's."""
        slot, e, n = max(tries, key=lambda t: t[2])      # max keeps the first of equals: the parent's own
        if self.is_branch(e.seq):
            self.num_wins += 1
            bm.swap_pages(self.parent_of[e.seq.seq_id], e.seq)
        return slot, n

    def drop(self, replica: Any) -> None:
        """End this step's branches (``replica``: engine/replica.Replica)."""
        for child in self._branches:
            replica.scheduler.drop_branch(child)
            replica.release_row(child)
        self._branches.clear()
        self.parent_of.clear()
