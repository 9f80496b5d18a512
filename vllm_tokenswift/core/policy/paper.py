"""The paper's drafting and its baselines, each the same option on every step for every
request, chains kept whole:

* ``policy="paper"`` (:class:`PaperPolicy`): the draft forward over the budgeted view, chains
  from the paper's selection (Sec 3.2-3.3);
* ``policy="triforce"`` (:class:`TriForcePolicy`): a self-speculative chain of
  ``chain_length`` draft forwards over the budgeted view (the paper's TriForce* baseline,
  Table 3: the target drafting token by token over a dynamically updated partial KV cache);
* ``policy="medusa"`` (:class:`MedusaPolicy`): the heads on the verification forward's hidden
  state, no extra forward (the paper's Medusa* baseline).

They compute only what they use: no n-gram chains are built before planning, no acceptance
or cost estimates are kept. Used for the ablations, the paper's Table 3 baselines and for
measuring each budget's acceptance on every step.

Engine-free.
"""

from __future__ import annotations

from vllm_tokenswift.core.policy.base import DraftingPolicy
from vllm_tokenswift.core.step import CHAIN, FORWARD, FUSED, NONE, StepPlan


class PaperPolicy(DraftingPolicy):
    """The draft forward every step; chains whole (module doc)."""

    name = "paper"
    needs_ngram_chains = False
    uses_fused_heads = False
    paper_chains = True

    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        n = len(rows)
        return StepPlan(list(rows), [FORWARD] * n, [False] * n, -1.0, [{} for _ in range(n)])


class TriForcePolicy(DraftingPolicy):
    """A self-speculative chain of ``chain_length`` forwards every step (module doc); a row
    whose lookahead slots do not allow one (``chain_room == 0``) gets no draft."""

    name = "triforce"
    needs_ngram_chains = False
    uses_fused_heads = False

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.max_chain_length < 1:
            raise ValueError("a chain is drafted every step: chain_length must be >= 1 (default: "
                             "num_speculative_tokens)")

    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        n = len(rows)
        kinds = [CHAIN if r.chain_room > 0 else NONE for r in rows]
        length = self.cfg.max_chain_length
        return StepPlan(list(rows), kinds, [False] * n, -1.0, [{} for _ in range(n)],
                        lengths=[length if k == CHAIN else 0 for k in kinds])


class MedusaPolicy(DraftingPolicy):
    """The heads on the verification forward's hidden state every step (module doc); a row
    without that hidden state (its first step, or a compiled verification forward) gets no
    draft."""

    name = "medusa"
    needs_ngram_chains = False
    uses_fused_heads = True

    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        n = len(rows)
        kinds = [FUSED if has_fused and r.verify_index >= 0 else NONE for r in rows]
        return StepPlan(list(rows), kinds, [False] * n, -1.0, [{} for _ in range(n)])
