"""TokenSwift's own counters, on top of vLLM's spec-decode metrics.

vLLM already counts drafts, draft tokens, accepted tokens and per-position
acceptance for any proposer (``vllm:spec_decode_*``; "SpecDecoding metrics"
log line). These counters explain *why* acceptance is what it is:

* tokens proposed and accepted per source (draft heads / LM head vs n-gram
  candidates), giving the n-gram acceptance β of the paper (Eq. 6);
* draft views used (budgeted, full because the context fits, full to select),
  and view (re-)selections (Sec 3.3);
* time spent drafting vs the whole engine step (draft-forward time share).

They live in the worker (:class:`TokenSwiftStats`), are logged every
``log_interval_s`` seconds, and can be fetched offline with
:func:`vllm_tokenswift.engine.stats_rpc.get_engine_stats` (``LLM.collective_rpc``).

Engine-free.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from vllm_tokenswift.core.chain import SOURCE_CHAIN, SOURCE_FUSED, SOURCE_HEADS, SOURCE_NGRAM
from vllm_tokenswift.core.step import KINDS

logger = logging.getLogger("vllm_tokenswift")

#: What the drafting policy did for one request in one step (``core.step.KINDS``): the
#: draft forward over the budgeted view, a self-speculative chain, fused heads on the
#: verification forward's hidden state, an n-gram chain alone, or no draft at all.
STEP_KINDS = KINDS
#: Which predictor proposed a draft token.
SOURCE_NAMES = {SOURCE_HEADS: "heads", SOURCE_NGRAM: "ngram", SOURCE_FUSED: "fused", SOURCE_CHAIN: "chain"}


@dataclass
class TokenSwiftStats:
    """Cumulative per-engine counters (worker side). Times in seconds."""

    draft_steps: int = 0            # propose calls that drafted for >= 1 request
    drafts: int = 0                 # (request, step) pairs that got a chain
    drafts_skipped_forward: int = 0  # ... of which from the n-gram table alone (no draft forward)
    draft_tokens: int = 0           # tokens proposed
    draft_tokens_heads: int = 0     # ... from l_0 / the heads
    draft_tokens_ngram: int = 0     # ... from n-gram candidates
    verified_drafts: int = 0        # chains the target verified
    verified_tokens: int = 0
    accepted_tokens: int = 0        # accepted draft tokens (all sources)
    accepted_heads: int = 0
    accepted_ngram: int = 0         # Σ a'_i of Eq. 6
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_tokens_fused: int = 0     # ... from fused heads (no draft forward)
    accepted_fused: int = 0
    draft_tokens_chain: int = 0     # ... from self-speculative chains (l_0 of each forward)
    accepted_chain: int = 0
    chain_forwards: int = 0         # draft forwards run for self-speculative chains
    chain_forward_rows: int = 0     # ... summed over their rows (request-forwards)
    #: request-steps per policy decision (``STEP_KINDS``) and the draft tokens accepted
    #: after each kind of step
    steps_by_kind: dict = field(default_factory=lambda: {k: 0 for k in STEP_KINDS})
    accepted_by_kind: dict = field(default_factory=lambda: {k: 0 for k in STEP_KINDS})
    plain_probes: int = 0           # engine steps the adaptive policy ran plain to measure a vs g
    view_selections: int = 0        # importance (re-)selections
    views_budgeted: int = 0         # drafts over a budgeted view
    views_full: int = 0             # drafts over the whole context (fits, or to select)
    skipped_no_slot: int = 0        # newest token's slot not allocated (should stay 0)
    time_draft_s: float = 0.0       # inside the proposer
    time_draft_forward_s: float = 0.0  # of which the target's draft forward + heads
    time_fused_s: float = 0.0       # of which fused heads (+ LM head) on verification hidden states
    time_total_s: float = 0.0       # wall time between consecutive proposer calls (engine steps)
    _last_call: float | None = None
    _last_log: float = field(default_factory=time.monotonic)

    def reset(self) -> None:
        """Zero every counter in place (holders of this object see the reset)."""
        self.__dict__.update(type(self)().__dict__)

    def record_verification(self, sources: list[int], num_verified: int, num_accepted: int,
                            kind: str | None = None) -> None:
        """Account for one verified chain.

        Args:
            sources: per draft token, the predictor that proposed it (``chain.SOURCE_*``).
            num_verified: drafts the target actually verified (the scheduler may trim).
            num_accepted: how many of them were accepted (``len(sampled) - 1``).
            kind: the policy's step kind that produced the chain (``STEP_KINDS``).
        """
        if num_verified <= 0:
            return
        self.verified_drafts += 1
        self.verified_tokens += num_verified
        a = min(num_accepted, num_verified)
        self.accepted_tokens += a
        ng = sum(1 for s in sources[:a] if s == SOURCE_NGRAM)
        fu = sum(1 for s in sources[:a] if s == SOURCE_FUSED)
        ch = sum(1 for s in sources[:a] if s == SOURCE_CHAIN)
        self.accepted_ngram += ng
        self.accepted_fused += fu
        self.accepted_chain += ch
        self.accepted_heads += a - ng - fu - ch
        if kind is not None:
            self.accepted_by_kind[kind] = self.accepted_by_kind.get(kind, 0) + a
        while len(self.accepted_per_pos) < num_verified:
            self.accepted_per_pos.append(0)
        for j in range(a):
            self.accepted_per_pos[j] += 1

    def record_chain(self, sources: list[int], kind: str | None = None) -> None:
        """Account for one proposed chain (``sources`` as in :meth:`record_verification`)
        and, when ``kind`` is given, one request-step of that policy decision."""
        if kind is not None:
            self.steps_by_kind[kind] = self.steps_by_kind.get(kind, 0) + 1
        if not sources:
            return
        self.drafts += 1
        self.draft_tokens += len(sources)
        ng = sum(1 for s in sources if s == SOURCE_NGRAM)
        fu = sum(1 for s in sources if s == SOURCE_FUSED)
        ch = sum(1 for s in sources if s == SOURCE_CHAIN)
        self.draft_tokens_ngram += ng
        self.draft_tokens_fused += fu
        self.draft_tokens_chain += ch
        self.draft_tokens_heads += len(sources) - ng - fu - ch

    def step_started(self) -> float:
        now = time.perf_counter()
        if self._last_call is not None:
            self.time_total_s += now - self._last_call
        self._last_call = now
        return now

    def summary(self, num_spec_tokens: int) -> dict:
        """Figures derived from the counters.

        ``acceptance_rate`` is the paper's α (Eq. 4) over verified chains with
        γ+1 = ``num_spec_tokens``; ``ngram_acceptance`` is β (Eq. 6);
        ``mean_accepted_length`` counts the bonus token (1 + accepted/chains).
        """
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        t = max(self.verified_drafts, 1)
        d["acceptance_rate"] = self.accepted_tokens / (num_spec_tokens * t) if self.verified_drafts else None
        d["ngram_acceptance"] = self.accepted_ngram / (num_spec_tokens * t) if self.verified_drafts else None
        d["mean_accepted_length"] = 1 + self.accepted_tokens / t if self.verified_drafts else None
        d["draft_time_share"] = (self.time_draft_s / self.time_total_s) if self.time_total_s > 0 else None
        d["num_speculative_tokens"] = num_spec_tokens
        return d

    def prometheus_samples(self) -> list[tuple[str, str, dict, float]]:
        """The counters as Prometheus samples: ``(name, help, labels, value)``.

        Names carry no prefix (the exporter adds ``vllm_tokenswift:``) and are
        monotonically increasing counters (``_total``) except where named ``_seconds``
        (also counters, in seconds). Stable interface for the metrics exporter.
        """
        out: list[tuple[str, str, dict, float]] = []
        acc_help = "Draft tokens accepted by the rejection sampler, by the predictor that proposed them"
        for src, name in SOURCE_NAMES.items():
            val = {SOURCE_HEADS: self.accepted_heads, SOURCE_NGRAM: self.accepted_ngram,
                   SOURCE_FUSED: self.accepted_fused, SOURCE_CHAIN: self.accepted_chain}[src]
            out.append(("accepted_tokens_total", acc_help, {"source": name}, float(val)))
        dt_help = "Draft tokens proposed, by the predictor that proposed them"
        for src, name in SOURCE_NAMES.items():
            val = {SOURCE_HEADS: self.draft_tokens_heads, SOURCE_NGRAM: self.draft_tokens_ngram,
                   SOURCE_FUSED: self.draft_tokens_fused, SOURCE_CHAIN: self.draft_tokens_chain}[src]
            out.append(("draft_tokens_total", dt_help, {"source": name}, float(val)))
        for kind in STEP_KINDS:
            out.append(("draft_steps_total", "Request-steps by the drafting policy's decision",
                        {"kind": kind}, float(self.steps_by_kind.get(kind, 0))))
            out.append(("accepted_tokens_by_kind_total",
                        "Accepted draft tokens by the kind of step that proposed them",
                        {"kind": kind}, float(self.accepted_by_kind.get(kind, 0))))
        out.append(("plain_probes_total", "Engine steps run without drafts to measure the plain "
                    "step cost (adaptive policy)", {}, float(self.plain_probes)))
        out.append(("view_selections_total", "Budgeted draft KV view (re-)selections (paper Sec 3.3)",
                    {}, float(self.view_selections)))
        out.append(("draft_forwards_total", "Engine steps that ran the draft forward", {},
                    float(self.draft_steps)))
        out.append(("draft_seconds_total", "Seconds spent in the proposer (draft forward included)",
                    {}, float(self.time_draft_s)))
        out.append(("draft_forward_seconds_total", "Seconds spent in the draft forward", {},
                    float(self.time_draft_forward_s)))
        return out

    def maybe_log(self, interval_s: float, num_spec_tokens: int) -> None:
        if interval_s <= 0:
            return
        now = time.monotonic()
        if now - self._last_log < interval_s:
            return
        self._last_log = now
        s = self.summary(num_spec_tokens)
        logger.info(
            "TokenSwift metrics: drafts=%d accepted=%d/%d (heads %d, n-gram %d) alpha=%s beta=%s "
            "mean_accepted_len=%s view_selections=%d budgeted/full views=%d/%d draft_time_share=%s "
            "steps %s=%s",
            self.drafts, self.accepted_tokens, self.verified_tokens, self.accepted_heads,
            self.accepted_ngram, _fmt(s["acceptance_rate"]), _fmt(s["ngram_acceptance"]),
            _fmt(s["mean_accepted_length"]), self.view_selections, self.views_budgeted,
            self.views_full, _fmt(s["draft_time_share"]), "/".join(STEP_KINDS),
            "/".join(str(self.steps_by_kind.get(k, 0)) for k in STEP_KINDS))


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
