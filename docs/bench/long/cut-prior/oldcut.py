"""The adaptive policy as before the cut fix (calibration prior = the confidence bin's centre
for every token): the 'before' side of an A/B in one bench invocation."""
from vllm_tokenswift.core.policy.adaptive import AdaptivePolicy, calibration_keys


class OldCut(AdaptivePolicy):
    def calibrated_cum(self, ch, sampled, kind=None, st=None):
        return self.calibration.chain_cum(calibration_keys(ch.sources, sampled), ch.confs)
