"""The adaptive policy as at 9386c9c, before a request's first draft token was priced apart
from its later ones: the cost model's step fit is ``a + g·[D>0] + b·D`` (the ``F`` column left
empty, ``b1 := b``). The 'before' side of an A/B in one bench run
(``PYTHONPATH=docs/bench/long/first-draft``, ``"policy": "oldpol:OldPol"``)."""
from vllm_tokenswift.core.policy.adaptive import AdaptivePolicy
from vllm_tokenswift.core.policy.estimates import CostModel


class OneDraftPrice(CostModel):
    @staticmethod
    def _step_features(draft_tokens, drafting_rows):
        return (1.0, 1.0 if draft_tokens > 0 else 0.0, 0.0, draft_tokens)

    def _solve(self):
        c = super()._solve()
        c["b1"] = c["b"]
        return c


class OldPol(AdaptivePolicy):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.costs = OneDraftPrice(refresh_every=self.costs.refresh_every, prior_b=self.costs.prior_b)
