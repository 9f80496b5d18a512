"""The adaptive policy as at 2123632 (HEAD before this session's policy changes): chain forwards
observed as draft forwards (priced at the draft forward's cost), and the draft forward's and the
chain's first tokens estimated apart under sampling. The 'before' side of an A/B in one bench run."""
from vllm_tokenswift.core.policy.adaptive import AdaptivePolicy


class OldPol(AdaptivePolicy):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.costs.observe_chain = self.costs.observe_forward
        self.acceptance.shared_first_groups = ()
