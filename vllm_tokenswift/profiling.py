"""Where a TokenSwift engine step's time goes, for the cost probe (``vllm-tokenswift probe``).

Off unless the worker runs with ``VLLM_TOKENSWIFT_PROFILE=1``; then the plugin's own
code adds wall-clock seconds (``time.perf_counter``) to :data:`PROFILE`:

``forward``          the target's verification forward (``model(...)``, hooks on the
                     target module), its attention layers included
``attention``        the attention layers of that forward (``CPUAttentionBackendImpl.forward``
                     through the ``cpu-verify-attention`` patch)
``sample``           sampling and rejection sampling (``GPUModelRunner._sample`` through
                     the ``draft-free-sampling`` patch)
``propose``          the proposer (``propose_with_runner``), the draft forward included
``draft_forward``    the draft forward (``TargetAccess.draft_forward``) ...
``draft_attention``  ... and its attention layers

and counts ``steps`` (proposer calls) and ``draft_forwards``. The probe reads the sums
through ``collective_rpc("tokenswift_stats")`` (key ``"profile"``) after a run whose
steps all have one shape and divides by the steps; the step's wall time comes from the
front end, so "other" (scheduling, the engine-core round trip, input preparation, the
LM head and logits) is the remainder.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict

ENV = "VLLM_TOKENSWIFT_PROFILE"


class StepProfile:
    """Per-part sums of seconds and counts in this process (see the module doc)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = (os.environ.get(ENV, "0") not in ("", "0")) if enabled is None else enabled
        self.in_draft = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    @contextlib.contextmanager
    def timed(self, part: str):
        """Add the block's wall time to ``part`` (nothing when profiling is off)."""
        if not self.enabled:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t

    def snapshot(self) -> dict:
        """``{"enabled", "seconds": {part: s}, "counts": {what: n}}`` (plain dicts)."""
        return {"enabled": self.enabled, "seconds": dict(self.seconds), "counts": dict(self.counts)}

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


#: this process's profile (the worker's, where the engine steps run)
PROFILE = StepProfile()


def install_forward_timer(module) -> list:
    """Time every call of ``module`` (the target model) into ``forward`` or, during a
    draft forward, ``draft_model``; returns the hook handles. Installed only when
    profiling is on: a module with hooks takes PyTorch's slower call path."""
    if not PROFILE.enabled:
        return []
    starts: list[float] = []

    def pre(mod, args, kwargs=None):
        starts.append(time.perf_counter())

    def post(mod, args, output):
        if starts:
            PROFILE.add("draft_model" if PROFILE.in_draft else "forward", time.perf_counter() - starts.pop())

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
