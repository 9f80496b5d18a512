"""The adaptive policy as before the chain-cost fit (chain forwards observed as draft forwards, so
chains are priced at the draft forward's cost): the 'before' side of an A/B in one bench invocation."""
from vllm_tokenswift.core.policy.adaptive import AdaptivePolicy


class OldCost(AdaptivePolicy):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.costs.observe_chain = self.costs.observe_forward
