"""The drafting policy as the proposer sees it: one facade, two visits per engine step.

:class:`DraftingPolicy` owns the running estimates (:mod:`vllm_tokenswift.estimates`:
step costs, acceptance per option and position, the per-token calibration) and the
calibration keys, and turns them into decisions with :mod:`vllm_tokenswift.policy`:

1. :meth:`DraftingPolicy.account` books what the step that just ran verified (per
   request: its last proposal, how many drafts were verified and accepted, the tokens
   sampled) and what the previous step's drafting and this verification cost;
2. :meth:`DraftingPolicy.plan` decides, per drafting request, the option (draft
   forward, fused heads, n-gram chain or none) and how long chains may be, and returns a
   :class:`StepPlan` whose :meth:`~StepPlan.cut` trims each chain the drafting builds and
   whose :meth:`~StepPlan.proposal` records what was handed to vLLM (for the next
   account).

Policies (``TokenSwiftConfig.policy``): ``"adaptive"`` (expected tokens per second,
with deterministic exploration), ``"paper"`` (the draft forward every step, chains
whole), ``"cycle"`` (the options in turn, for tests), ``"probe"`` (the option and exact
chain length each request asks for in ``extra_args["tokenswift_probe"]``, for the cost
probe).

Engine-free (numpy, torch only through :mod:`vllm_tokenswift.request_state`); under
tensor parallelism the caller passes the broadcast of rank 0's cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_tokenswift import policy as pol
from vllm_tokenswift.chain import SOURCE_NGRAM, Chain
from vllm_tokenswift.config import TokenSwiftConfig
from vllm_tokenswift.request_state import Proposal, RequestState, Row

#: adaptive policy: a request tries the draft forward / fused heads at least once every
#: ``policy_tuning.explore_every`` of its steps (deterministic exploration), a gap that
#: doubles after every forced try the policy did not then take up voluntarily, up to
#: ``policy_tuning.explore_max`` steps (an option that never pays costs ever less) ...
#: ... and a due try waits for the next engine step that is a multiple of this, so that
#: the due requests of a batch try together and share one draft forward: its fixed cost
#: (reading all the weights) is most of what a try costs, whatever the rows (batch-8
#: trace, paper sampling, docs/bench/smollm2/step-trace/b8-paper.txt: a draft forward for
#: 1-3 rows cost 79-95 ms against a 108 ms plain step).
#: Requests that arrive at different times would otherwise each pay it on their own step.
EXPLORE_ALIGN = 16
#: tensor parallelism: rank 0's cost model is broadcast every this many steps
COST_SYNC_EVERY = 16
#: the cost model's fits are solved again after this many step observations (any draft
#: forward or fused-heads observation re-solves at once; see estimates.CostModel)
COST_REFRESH_EVERY = 8


def calibration_keys(sources, sampled: bool) -> list[int]:
    """The calibration's source keys of a chain's tokens: the token's source, offset by 10
    for sampled requests. A greedy request's draft is accepted when it is the target's
    argmax; a sampled request's point-mass draft (an n-gram token) with the target's
    probability of it, and a drawn one with min(1, p/q): the same confidence means
    different acceptance, so the two groups are calibrated apart (one engine serving a
    looping greedy request would otherwise tell sampled requests that n-gram chains pay)."""
    off = 10 if sampled else 0
    return [s + off for s in sources]


@dataclass
class Verified:
    """One request's share of the step that just ran: its state (whose ``last`` is the
    proposal verified), the drafts verified and accepted, and the tokens sampled (the
    accepted drafts, then the bonus token)."""

    state: RequestState
    num_verified: int
    num_accepted: int
    tokens: list | None = None


@dataclass
class StepCosts:
    """What the previous engine step cost, for the cost model (seconds).

    Attributes:
        step: ``(seconds, decode rows, draft tokens)`` of the verification step outside the
            proposer's drafting work, or None when the step also prefilled (not a decode
            step) or is the first.
        forward: ``(seconds, rows)`` of the previous step's draft forward, or None.
        fused: ``(seconds, rows)`` of its fused heads, or None.
    """

    step: tuple | None = None
    forward: tuple | None = None
    fused: tuple | None = None

    @classmethod
    def of_drafting(cls, forward: tuple | None, fused: tuple | None,
                    forward_selected: bool = False) -> "StepCosts":
        """The drafting costs of a step to observe next step: ``forward`` and ``fused``
        as ``(seconds, rows)`` or None. A draft forward that (re-)selected a KV view
        (``forward_selected``: a forward over a request's whole context to capture its
        query, or the importance pass over all its keys, paper Sec 3.3) is not observed:
        it happens once per request and once per re-selection (every ~6 blocks of output
        at a 1,024-token budget), while the cost model's ``f0 + f1·n`` is what a draft
        forward over budgeted views costs step after step. At a 32K-token context the
        first forward of a request cost ~100 ms against ~9 ms for the next ones, and
        observing it kept the policy off the draft forward (docs/bench/long)."""
        return cls(forward=None if forward_selected else forward, fused=fused)


def probe_chain(ch: Chain | None, r: Row) -> Chain:
    """The probe policy's chain of exactly the request's ``drafts`` tokens (at most the
    row's room): the option's own chain, cut or padded with the newest token (as an
    n-gram token, a point mass)."""
    n = min(r.state.probe[1], r.room)
    ch = ch if ch is not None else Chain([], [], 0.0)
    ch = ch.truncate(min(n, len(ch.tokens)))
    ch.confs = list(ch.confs) + [0.0] * (len(ch.tokens) - len(ch.confs))
    pad = n - len(ch.tokens)
    if pad > 0:
        ch.tokens += [int(r.context[-1])] * pad
        ch.sources += [SOURCE_NGRAM] * pad
        ch.confs += [0.0] * pad
    return ch


class StepPlan:
    """The policy's plan for one engine step (returned by :meth:`DraftingPolicy.plan`).

    Attributes:
        kinds: per drafting row (the ``rows`` given to ``plan``), its option (``policy.KINDS``).
        threshold: chains are cut where their calibrated cumulative acceptance falls to
            this (``b·θ``); negative: kept whole (``"paper"`` and ``"probe"`` policies).
        options: per row, the :class:`policy.RowOptions` the decision was made from.
        decision: the adaptive policy's :class:`policy.Decision` (None for the others).
    """

    def __init__(self, policy: "DraftingPolicy", rows: list[Row], kinds: list, threshold: float,
                 options: list, decision: pol.Decision | None):
        self._policy = policy
        self.rows = rows
        self.kinds = kinds
        self.threshold = threshold
        self.options = options
        self.decision = decision
        self.any_forced = any(r.forced for r in rows)

    def rows_of(self, kind: str) -> list[int]:
        """Indices (into ``rows``) of the rows that take option ``kind``."""
        return [j for j, k in enumerate(self.kinds) if k == kind]

    def cut(self, ch: Chain, r: Row, cum: np.ndarray | None = None) -> Chain:
        """Cut ``ch`` where its calibrated cumulative acceptance falls to :attr:`threshold`
        (negative: keep it whole), at most ``r.room`` tokens, at least one for a forced
        row; ``r.past_cut`` gets the first token past the cut. ``cum``: that acceptance if
        already computed for this very chain this step (the n-gram row's decision did).

        Losslessness: whether position j is kept may depend on the tokens before it but
        never on the token at j itself when that token was *sampled* from q (keeping a
        sampled draft only for some values would change the distribution the rejection
        sampler corrects for). The confidences of sampled tokens are therefore a
        property of q (its largest probability), not of the drawn token; point-mass
        tokens (greedy, n-grams) are deterministic functions of their prefix, so their
        own confidence may decide."""
        keep = min(len(ch.tokens), r.room)
        if self.threshold >= 0 and ch.tokens:
            if cum is None:
                cum = self._policy.calibrated_cum(ch, r.state.sampled)
            keep = min(keep, max(pol.cut_length(cum, self.threshold), 1 if r.forced else 0))
        r.past_cut = ((ch.tokens[keep], ch.sources[keep], ch.confs[keep])
                      if keep < min(len(ch.tokens), len(ch.sources), len(ch.confs)) else None)
        return ch.truncate(keep)

    def cut_ngram(self, j: int) -> Chain:
        """Row ``j``'s n-gram chain, cut (with the acceptance its decision computed)."""
        r = self.rows[j]
        ch = r.ngram if r.ngram is not None else Chain([], [], 0.0)
        return self.cut(ch, r, self.options[j].cums.get(pol.NGRAM))

    def proposal(self, r: Row, kind: str, sources: list, confs: list, span: int) -> Proposal:
        """Record what row ``r`` hands to vLLM: the request's exploration bookkeeping
        (:meth:`RequestState.took`) and its :class:`Proposal`, which the next
        :meth:`DraftingPolicy.account` books."""
        tuning = self._policy.tuning
        r.state.took(kind, r.forced, alongside_forced=self.any_forced and not r.forced, tuning=tuning)
        return Proposal(kind, list(sources), list(confs), span, self._observable_past_cut(r, kind))

    def _observable_past_cut(self, r: Row, kind: str) -> tuple | None:
        """The ``Proposal.next`` of row ``r``: its chain's first token past the cut (for
        a row without a chain, the first token of its n-gram chain) as ``(token,
        calibration source key, confidence)``, when the step's output tells whether it
        would have been accepted: any token of a greedy request; for a sampled request
        only an n-gram token, which is handed over as a point mass (a token drawn from q
        is accepted with min(1, p/q), not with the probability that the target samples
        it)."""
        nxt = r.past_cut
        if nxt is None and kind == pol.NONE and r.ngram is not None and r.ngram.tokens:
            nxt = (r.ngram.tokens[0], r.ngram.sources[0], r.ngram.confs[0])
        if nxt is None:
            return None
        sampled = r.state.sampled
        if sampled and nxt[1] != SOURCE_NGRAM:
            return None
        return nxt[0], calibration_keys((nxt[1],), sampled)[0], nxt[2]


class DraftingPolicy:
    """The proposer's drafting policy: accounts for each verified step and plans the next.

    Args:
        cfg: the engine's :class:`~vllm_tokenswift.config.TokenSwiftConfig` (``policy``,
            ``policy_tuning``, ``num_draft_distributions``).
        num_spec_tokens: ``num_speculative_tokens`` (the longest chain).
        num_heads: heads loaded (the fused option's span), 0 without heads.
        tp_broadcast: tensor parallelism: ``f(np.ndarray) -> np.ndarray`` giving every rank
            rank 0's vector (``draft_forward.tp_broadcast_from_rank0``); None with one rank.
    """

    def __init__(self, cfg: TokenSwiftConfig, num_spec_tokens: int, num_heads: int = 0,
                 tp_broadcast=None):
        self.cfg = cfg
        self.num_spec_tokens = num_spec_tokens
        self.num_heads = num_heads
        self.tp_broadcast = tp_broadcast
        self.costs = pol.CostModel(refresh_every=COST_REFRESH_EVERY,
                                   prior_b=cfg.policy_tuning.draft_token_cost_prior)
        self.acceptance = pol.AcceptanceModel(num_spec_tokens)
        self.calibration = pol.Calibration(positions=num_spec_tokens)
        self.last_decision: pol.Decision | None = None

    @property
    def tuning(self):
        """The adaptive policy's advanced settings (``config.PolicyTuning``)."""
        return self.cfg.policy_tuning

    def estimates_of(self, st: RequestState) -> dict:
        """The request's acceptance estimates (:meth:`AcceptanceModel.new_request`), made
        when the policy first meets it: greedy and sampled requests learn from separate
        engine-wide figures."""
        if not st.acceptance:
            st.acceptance = self.acceptance.new_request("sampled" if st.sampled else "greedy")
        return st.acceptance

    # ----------------------------------------------------------------- 1. account
    def account(self, verified: list[Verified], costs: StepCosts | None = None) -> None:
        """Book the step that just ran: per request, its proposal's acceptance (per source,
        option and draft position; the token past the cut when the output tells it), and
        the cost observations (previous step's fused heads and draft forward, then this
        verification step)."""
        for v in verified:
            self._account_request(v.state, v.num_verified, v.num_accepted, v.tokens)
        if costs is not None:
            if costs.fused is not None:
                self.costs.observe_fused(*costs.fused)
            if costs.forward is not None:
                self.costs.observe_forward(*costs.forward)
            if costs.step is not None:
                self.costs.observe_step(*costs.step)

    def _account_request(self, st: RequestState, num_verified: int, num_accepted: int,
                         tokens: list[int] | None = None) -> None:
        """Book ``st.last`` as verified (acceptance per source/option).

        ``tokens``: what the step sampled for the request (the accepted drafts, then the
        bonus token). When every draft proposed was verified and accepted (none proposed
        included), the bonus token tells whether the chain's first token past the cut
        would have been accepted too: that is booked in the calibration as an
        observation of its own (:meth:`policy.Calibration.observe`)."""
        last = st.last
        nxt = last.next
        if (nxt is not None and tokens is not None and self.tuning.observe_past_cut
                and num_verified == len(last.sources)
                and num_accepted == num_verified):
            self.calibration.observe(nxt[1], num_verified, nxt[2], int(tokens[num_accepted]) == nxt[0])
        st.all_accepted = num_verified >= self.num_spec_tokens and num_accepted >= num_verified
        if last.span:
            # the draft forward or fused heads ran: book what they realised, a chain the
            # cut emptied or shortened included
            self.acceptance.record(self.estimates_of(st), last.kind, num_verified, num_accepted, last.span)
        if num_verified <= 0 or not last.sources:
            return
        if not last.span:
            self.acceptance.record(self.estimates_of(st), last.kind, num_verified, num_accepted)
        self.calibration.update(calibration_keys(last.sources, st.sampled), last.confs,
                                num_verified, num_accepted)

    # ----------------------------------------------------------------- 2. plan
    def plan(self, rows: list[Row], step: int, has_fused: bool) -> StepPlan:
        """Decide every drafting row's option and the chains' cut threshold.

        Args:
            rows: this step's drafting rows, their n-gram chains (``Row.ngram``) built.
            step: the engine step counter (identical on every TP rank).
            has_fused: the fused heads are available this step.
        Returns:
            :class:`StepPlan`; each row's ``forced`` flag is set (exploration).
        """
        cfg = self.cfg
        options = []
        for r in rows:
            options.append(self.row_options(r, step, has_fused))
            r.forced = options[-1].forced not in (None, pol.NONE)
        decision = None
        if cfg.policy == "paper":
            kinds, threshold = [pol.FORWARD] * len(rows), -1.0
        elif cfg.policy == "probe":
            kinds, threshold = [r.state.probe[0] for r in rows], -1.0
        else:
            if self.tp_broadcast is not None and step % COST_SYNC_EVERY == 1:
                self.costs.load_state(self.tp_broadcast(self.costs.state()))
            costs = self.costs.costs()
            decision = pol.decide(options, costs, self.tuning.min_gain)
            if cfg.policy == "adaptive" and pol.needs_plain_probe(
                    decision, options, costs, self.costs.plain_observations()):
                decision = pol.plain_decision(options, costs)
                decision.plain_probe = True
            self.last_decision = decision
            kinds, threshold = decision.kinds, decision.threshold
        return StepPlan(self, rows, kinds, threshold, options, decision)

    def row_options(self, r: Row, step: int, has_fused: bool) -> pol.RowOptions:
        """Per available option, the estimated cumulative acceptance of row ``r``'s chain,
        and the option it is forced to take (exploration, the cycle policy) or None."""
        st = r.state
        cums = {pol.NONE: np.zeros(0)}
        if r.ngram is not None and r.ngram.tokens:
            cums[pol.NGRAM] = self.calibrated_cum(r.ngram, st.sampled)
        n_fwd = min(r.room, self.cfg.num_draft_distributions)
        cums[pol.FORWARD] = self.acceptance.cumulative(self.estimates_of(st), pol.FORWARD, n_fwd)
        if has_fused and r.verify_index >= 0:
            cums[pol.FUSED] = self.acceptance.cumulative(self.estimates_of(st), pol.FUSED,
                                                         min(r.room, self.num_heads))
        forced = None
        if self.cfg.policy == "cycle":
            forced = pol.KINDS[st.steps % len(pol.KINDS)]
            if forced not in cums:
                forced = pol.NGRAM if pol.NGRAM in cums else pol.NONE
        elif (self.cfg.policy == "adaptive" and self.tuning.explore_every and st.steps > 2
              and not st.all_accepted and step % EXPLORE_ALIGN == 0):
            # A request whose last chain was full length and wholly accepted (a text that
            # repeats itself) defers its forced try: no option can yield more than a
            # full-length accepted chain, so the try could only lose a step. So does one
            # whose n-gram chain is expected to yield at least what the tried option's own
            # positions could at best (unless explore_beside_ngram). Tries wait for an
            # aligned engine step (EXPLORE_ALIGN; the same step on every TP rank).
            ngram_yield = float(np.sum(cums[pol.NGRAM])) if pol.NGRAM in cums else 0.0
            for kind in (pol.FORWARD, pol.FUSED):
                if kind not in cums or st.steps - st.tried.get(kind, 0) < st.explore_gap:
                    continue
                if not self.tuning.explore_beside_ngram and ngram_yield >= len(cums[kind]):
                    continue
                forced = kind
                break
        return pol.RowOptions(cums, forced)

    def calibrated_cum(self, ch: Chain, sampled: bool) -> np.ndarray:
        """The calibrated cumulative acceptance ``[len(ch)]`` of chain ``ch``'s tokens."""
        return self.calibration.chain_cum(calibration_keys(ch.sources, sampled), ch.confs)
