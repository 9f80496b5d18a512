"""The paper's drafting (``policy="paper"``): the draft forward over the budgeted view on
every step for every request, chains from the paper's selection and kept whole (Sec 3.2-3.3).

It computes only what it uses: no n-gram chains are built before planning, no acceptance or
cost estimates are kept, and the fused heads are never planned. Used for the ablations and
for measuring each budget's acceptance on every step.

Engine-free.
"""

from __future__ import annotations

from vllm_tokenswift.core.policy.base import DraftingPolicy
from vllm_tokenswift.core.step import FORWARD, StepPlan


class PaperPolicy(DraftingPolicy):
    """The draft forward every step; chains whole (module doc)."""

    name = "paper"
    needs_ngram_chains = False
    uses_fused_heads = False
    paper_chains = True

    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        n = len(rows)
        return StepPlan(list(rows), [FORWARD] * n, [False] * n, -1.0, [{} for _ in range(n)])
