"""Where an engine step's time goes, for the cost probe (``vllm-tokenswift probe``).

Nothing here runs in a production engine: the probe builds its engines with
``worker_extension_cls=`` :data:`WORKER_EXTENSION` (vLLM mixes :class:`StepProfiler` into its
worker class) and calls ``collective_rpc("tokenswift_profile_install")`` once the engine is up.
That wraps, on this worker's own objects only, the parts below with wall-clock timers
(``time.perf_counter``), summed in the worker's :class:`StepProfile`:

``forward``          the target's forward (pre/post hooks on the model), attention included
``attention``        the attention layers of that forward (each layer's ``impl.forward``)
``sample``           sampling and rejection sampling (the runner's ``_sample``)
``propose``          the TokenSwift proposer (``propose_step``), the draft forward included
``draft_forward``    the draft forward (``TargetAccess.draft_forward``) ...
``draft_model``      ... its model call ...
``draft_attention``  ... and its attention layers

and counts ``steps`` (calls of ``_sample``: one per engine step that samples) and
``draft_forwards``. ``collective_rpc("tokenswift_profile")`` returns the sums; the probe
divides by the steps of a run whose steps all have one shape, and the step's wall time
comes from the front end, so "other" (scheduling, the engine-core round trip, input
preparation, the LM head and logits) is the remainder.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict

#: the ``worker_extension_cls`` the probe's engines are built with
WORKER_EXTENSION = "vllm_tokenswift.bench.profiler.StepProfiler"


class StepProfile:
    """Per-part sums of seconds and counts in one worker (see the module doc)."""

    def __init__(self) -> None:
        self.in_draft = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    @contextlib.contextmanager
    def timed(self, part: str):
        """Add the block's wall time to ``part``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t

    def snapshot(self) -> dict:
        """``{"seconds": {part: s}, "counts": {what: n}}`` (plain dicts)."""
        return {"seconds": dict(self.seconds), "counts": dict(self.counts)}

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


def _timed_method(profile: StepProfile, fn, part, count: str | None = None, draft: bool = False):
    """``fn`` (a bound method) timed into ``part`` (a name, or ``f(profile) -> name``);
    ``count``: also count calls; ``draft``: mark the profile as inside the draft forward."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = part(profile) if callable(part) else part
        if draft:
            profile.in_draft = True
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            profile.add(name, time.perf_counter() - t)
            if draft:
                profile.in_draft = False
            if count:
                profile.count(count)

    return wrapper


def install(runner, profile: StepProfile) -> list[str]:
    """Wrap the parts of one model runner (module doc) with timers into ``profile``;
    returns the parts installed (the proposer's only on a TokenSwift engine)."""
    parts = []
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    starts: list[float] = []

    def pre(mod, args, kwargs=None):
        starts.append(time.perf_counter())

    def post(mod, args, output):
        if starts:
            profile.add("draft_model" if profile.in_draft else "forward", time.perf_counter() - starts.pop())

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    parts.append("forward")
    ctx = runner.vllm_config.compilation_config.static_forward_context
    n_attn = 0
    for layer in ctx.values():
        impl = getattr(layer, "impl", None)
        if impl is not None and hasattr(impl, "forward"):
            impl.forward = _timed_method(profile, impl.forward,
                                         lambda p: "draft_attention" if p.in_draft else "attention")
            n_attn += 1
    if n_attn:
        parts.append("attention")
    runner._sample = _timed_method(profile, runner._sample, "sample", count="steps")
    parts.append("sample")
    drafter = getattr(runner, "drafter", None)
    if hasattr(drafter, "propose_step"):
        drafter.propose_step = _timed_method(profile, drafter.propose_step, "propose")
        parts.append("propose")
        target = getattr(drafter, "target_access", None)
        if target is not None:
            target.draft_forward = _timed_method(profile, target.draft_forward, "draft_forward",
                                                 count="draft_forwards", draft=True)
            parts.append("draft_forward")
    return parts


class StepProfiler:
    """vLLM worker extension (``worker_extension_cls``) of the probe's engines: two methods
    reachable by name through ``collective_rpc``."""

    def tokenswift_profile_install(self) -> list[str]:
        """Install the timers on this worker's model runner (idempotent); returns the parts."""
        if getattr(self, "_tokenswift_profile", None) is None:
            self._tokenswift_profile = StepProfile()
            self._tokenswift_profile_parts = install(self.model_runner, self._tokenswift_profile)
        return list(self._tokenswift_profile_parts)

    def tokenswift_profile(self) -> dict:
        """This worker's sums so far (:meth:`StepProfile.snapshot`); empty before install."""
        prof = getattr(self, "_tokenswift_profile", None)
        return prof.snapshot() if prof is not None else {"seconds": {}, "counts": {}}
