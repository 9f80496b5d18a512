"""The adaptive policy as at 9386c9c, before a request's first draft token was priced apart
from its later ones: the cost model's step fit is ``a + g·[D>0] + b·D`` (the ``F`` column left
empty, ``b1 := b``). The 'before' side of an A/B in one bench run
(``PYTHONPATH=docs/bench/long/first-draft``, ``"policy": "oldpol:OldPol"``)."""
from vllm_tokenswift.core.policy.adaptive import AdaptivePolicy
from vllm_tokenswift.core.policy.estimates import CostModel


class OneDraftPrice(CostModel):
    def observe_step(self, seconds, rows, draft_tokens, drafting_rows=None):
        if seconds <= 0 or rows <= 0:
            return
        if len(self._step) == self.window and self._step.rows[0][0][1] == 0.0:
            self._plain -= 1
        self._step.add((1.0, 1.0 if draft_tokens > 0 else 0.0, 0.0, draft_tokens), seconds)
        self._plain += draft_tokens <= 0
        self._rows.append(rows)
        while len(self._rows) > self.window:
            self._rows.popleft()
        self._steps_seen += 1
        self._stale_steps += 1
        if self._stale_steps >= self.refresh_every or self._steps_seen <= 2 * self.refresh_every:
            self._cached = None

    def _solve(self):
        c = super()._solve()
        c["b1"] = c["b"]
        return c


class OldPol(AdaptivePolicy):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        old = OneDraftPrice(refresh_every=self.costs.refresh_every, prior_b=self.costs.prior_b)
        self.costs = old
