"""The cost-aware drafting policy (``policy="adaptive"``, the default) and its diagnostic
variant ``policy="cycle"``.

Every step and for every request, :class:`AdaptivePolicy` weighs the draft forward over the
budgeted view, self-speculative chains of every length (the draft forward token by token),
the fused heads, the request's n-gram chain alone and no draft, and picks the
options and chain lengths that maximise the batch's expected generated tokens per second
(:func:`vllm_tokenswift.core.policy.decision.decide`), from what it measures while the engine
runs: step costs (:class:`~vllm_tokenswift.core.policy.estimates.CostModel`), acceptance per
option and draft position (:class:`~vllm_tokenswift.core.policy.estimates.AcceptanceModel`)
and each chain token's acceptance by source, position and confidence
(:class:`~vllm_tokenswift.core.policy.estimates.Calibration`). Deterministic exploration keeps
the options it does not take measured; a plain step now and then separates a plain step's
cost from a verifying step's fixed cost. An extension beyond the paper, which drafts with
the draft forward every step.

Engine-free (numpy).
"""

from __future__ import annotations

import numpy as np

from vllm_tokenswift.core.chain import SOURCE_NGRAM, Chain
from vllm_tokenswift.core.policy import decision as dec
from vllm_tokenswift.core.policy.base import DraftingPolicy, past_cut_of
from vllm_tokenswift.core.policy.estimates import AcceptanceModel, Calibration, CostModel
from vllm_tokenswift.core.step import CHAIN, FORWARD, FUSED, KINDS, NGRAM, NONE, CutChain, StepCosts, StepPlan

#: a request tries the draft forward / fused heads at least once every
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


class AdaptivePolicy(DraftingPolicy):
    """Expected tokens per second, per request and step (module doc)."""

    name = "adaptive"
    #: force exploration tries (the cycle policy forces its own rotation instead)
    explores = True
    #: replace a close decision by a plain step when too few plain steps were measured
    plain_probes = True

    def __init__(self, cfg, num_spec_tokens: int, tp_broadcast=None):
        super().__init__(cfg, num_spec_tokens, tp_broadcast)
        self.costs = CostModel(refresh_every=COST_REFRESH_EVERY, prior_b=cfg.policy_tuning.draft_token_cost_prior)
        self.acceptance = AcceptanceModel(num_spec_tokens)
        self.calibration = Calibration(positions=num_spec_tokens)

    def cost_estimates(self) -> dict | None:
        return self.costs.costs() if self.costs.ready else None

    def estimates_of(self, st) -> dict:
        """The request's acceptance estimates (:meth:`AcceptanceModel.new_request`), made
        when the policy first meets it: greedy and sampled requests learn from separate
        engine-wide figures."""
        if not st.acceptance:
            st.acceptance = self.acceptance.new_request("sampled" if st.sampled else "greedy")
        return st.acceptance

    # ----------------------------------------------------------------- 1. account
    def account(self, verified: list, costs: StepCosts | None = None) -> None:
        """Book the step that just ran: per request, its proposal's exploration bookkeeping
        and acceptance (per source, option and draft position; the token past the cut when
        the output tells it), then the cost observations (previous step's fused heads and
        draft forward, then this verification step)."""
        for v in verified:
            self._book_exploration(v.state, v.proposal)
            self._account_request(v.state, v.proposal, v.num_verified, v.num_accepted, v.tokens)
        if costs is not None:
            if costs.fused is not None:
                self.costs.observe_fused(*costs.fused)
            if costs.forward is not None:
                self.costs.observe_forward(*costs.forward)
            for fwd in costs.chain:       # each forward of the step's self-speculative chains
                self.costs.observe_chain(*fwd)
            if costs.step is not None:
                self.costs.observe_step(*costs.step)

    def _book_exploration(self, st, last) -> None:
        """The request took option ``last.kind`` at its step ``last.step``: the exploration
        gap doubles after a forced try of the draft forward or the fused heads (up to
        ``explore_max``) and resets to ``explore_every`` when the policy chose one of them on
        its own.

        A choice made alongside another request's forced try (``last.alongside_forced``)
        was made knowing that the try's fixed costs (``g``, the draft forward's ``f0``, the
        fused heads' ``h0``) are paid anyway, at a marginal value; it counts as a try, not as
        a voluntary choice. (Counted as a voluntary choice, it reset the gap, which made more
        forced tries, which made more such choices: at batch 8 under the paper's sampling,
        149 draft-forward and 145 fused-heads request-steps in one round against 23 and 16 in
        the round before.)"""
        if last.step < 0:
            return
        st.tried[last.kind] = last.step
        if last.kind in (FORWARD, CHAIN, FUSED):
            t = self.tuning
            st.explore_gap = (min(2 * st.explore_gap, t.explore_max) if last.forced or last.alongside_forced
                              else t.explore_every)

    def _account_request(self, st, last, num_verified: int, num_accepted: int,
                         tokens: list | None = None) -> None:
        """Book proposal ``last`` as verified (acceptance per source/option).

        ``tokens``: what the step sampled for the request (the accepted drafts, then the
        bonus token). When every draft proposed was verified and accepted (none proposed
        included), the bonus token tells whether the chain's first token past the cut
        would have been accepted too: that is booked in the calibration as an observation
        of its own (:meth:`Calibration.observe`), for a greedy request's token of any
        source and for a sampled request's n-gram token only (a point mass; a token drawn
        from q is accepted with min(1, p/q), not with the probability that the target
        samples it)."""
        nxt = last.next
        if (nxt is not None and tokens is not None and self.tuning.observe_past_cut
                and (not st.sampled or nxt[1] == SOURCE_NGRAM)
                and num_verified == len(last.sources) and num_accepted == num_verified):
            key = calibration_keys((nxt[1],), st.sampled)[0]
            self.calibration.observe(key, num_verified, nxt[2], int(tokens[num_accepted]) == nxt[0])
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
    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        """Every row's option and chain length from :func:`decision.decide`, exploration
        tries forced where due, a plain step where the cost model needs one."""
        options = [self.row_options(r, step, has_fused) for r in rows]
        forced = [o.forced not in (None, NONE) for o in options]
        if self.tp_broadcast is not None and step % COST_SYNC_EVERY == 1:
            self.costs.load_state(self.tp_broadcast(self.costs.state()))
        costs = self.costs.costs()
        decision = dec.decide(options, costs, self.tuning.min_gain)
        if self.plain_probes and dec.needs_plain_probe(decision, options, costs,
                                                       self.costs.plain_observations()):
            decision = dec.plain_decision(options, costs)
            decision.plain_probe = True
        self.last_decision = decision
        return StepPlan(list(rows), list(decision.kinds), forced, decision.threshold,
                        [o.cums for o in options], decision, decision.plain_probe, list(decision.lengths),
                        decision.threshold_first)

    def row_options(self, r, step: int, has_fused: bool) -> dec.RowOptions:
        """Per available option, the estimated cumulative acceptance of row ``r``'s chain,
        and the option it is forced to take (:meth:`forced_option`) or None."""
        st = r.state
        cums = {NONE: np.zeros(0)}
        if r.ngram is not None and r.ngram.tokens:
            cums[NGRAM] = self.calibrated_cum(r.ngram, st.sampled)
        n_fwd = min(r.room, self.cfg.num_draft_distributions)
        cums[FORWARD] = self.acceptance.cumulative(self.estimates_of(st), FORWARD, n_fwd)
        if r.chain_room > 0:
            cums[CHAIN] = self.acceptance.cumulative(self.estimates_of(st), CHAIN, r.chain_room)
        if has_fused and r.verify_index >= 0:
            cums[FUSED] = self.acceptance.cumulative(self.estimates_of(st), FUSED, min(r.room, self.num_heads))
        return dec.RowOptions(cums, self.forced_option(r, step, cums))

    def forced_option(self, r, step: int, cums: dict) -> str | None:
        """The exploration try due for row ``r`` this step, or None.

        A request whose last chain was full length and wholly accepted (a text that repeats
        itself) defers its forced try: no option can yield more than a full-length accepted
        chain, so the try could only lose a step. So does one whose n-gram chain is expected
        to yield at least what the tried option's own positions could at best (unless
        ``explore_beside_ngram``). Tries wait for an aligned engine step
        (:data:`EXPLORE_ALIGN`; the same step on every TP rank)."""
        st = r.state
        if not (self.explores and self.tuning.explore_every and st.steps > 2 and not st.all_accepted
                and step % EXPLORE_ALIGN == 0):
            return None
        ngram_yield = float(np.sum(cums[NGRAM])) if NGRAM in cums else 0.0
        for kind in (FORWARD, CHAIN, FUSED):
            if kind not in cums or st.steps - st.tried.get(kind, 0) < st.explore_gap:
                continue
            if not self.tuning.explore_beside_ngram and ngram_yield >= len(cums[kind]):
                continue
            return kind
        return None

    # ----------------------------------------------------------------- 3. cut
    def cut(self, plan: StepPlan, j: int, chain: Chain, cum=None) -> CutChain:
        """Cut row ``j``'s chain where its calibrated cumulative acceptance falls to the
        plan's threshold (its first token: ``plan.threshold_first``; negative: keep it
        whole), at most the row's room, at least one
        token for a forced row. ``cum``: that acceptance if already computed for this very
        chain this step (the n-gram row's decision did).

        Losslessness: whether position j is kept may depend on the tokens before it but
        never on the token at j itself when that token was *sampled* from q (keeping a
        sampled draft only for some values would change the distribution the rejection
        sampler corrects for). The confidences of sampled tokens are therefore a property
        of q (its largest probability), not of the drawn token; point-mass tokens (greedy,
        n-grams) are deterministic functions of their prefix, so their own confidence may
        decide."""
        r = plan.rows[j]
        keep = min(len(chain.tokens), r.room)
        if plan.threshold >= 0 and chain.tokens:
            if cum is None:
                cum = self.calibrated_cum(chain, r.state.sampled, plan.kinds[j], r.state)
            keep = min(keep, max(dec.cut_length(cum, plan.threshold, plan.threshold_first),
                                 1 if plan.forced[j] else 0))
        past = past_cut_of(chain, keep)      # before the cut: truncate works in place
        return CutChain(chain.truncate(keep), past)

    def calibrated_cum(self, ch: Chain, sampled: bool, kind: str | None = None, st=None) -> np.ndarray:
        """The calibrated cumulative acceptance ``[len(ch)]`` of chain ``ch``'s tokens.

        For a sampled request's tokens drawn from q (every source but the n-gram table's
        point masses) the calibration's prior is option ``kind``'s measured conditional
        acceptance at the token's position (:meth:`AcceptanceModel.probs`, the figure the
        decision chose the option by) instead of the confidence bin's centre
        (:meth:`Calibration.chain_cum` says why); ``st``: the request's state (its own
        acceptance estimates), else the engine-wide figure of the sampled group."""
        keys = calibration_keys(ch.sources, sampled)
        priors = None
        if sampled and kind in (FORWARD, CHAIN, FUSED) and any(s != SOURCE_NGRAM for s in ch.sources):
            p = (self.acceptance.probs(self.estimates_of(st), kind) if st is not None
                 else self.acceptance.engine_probs(kind, "sampled"))
            last = len(p) - 1
            priors = [None if s == SOURCE_NGRAM else float(p[min(i, last)]) for i, s in enumerate(ch.sources)]
        return self.calibration.chain_cum(keys, ch.confs, priors)


class CyclePolicy(AdaptivePolicy):
    """``policy="cycle"`` (diagnostics and tests): every request rotates through the five
    options step by step (an unavailable one gives way to its n-gram chain, else no draft),
    with chain lengths and cuts as the adaptive policy decides them; no exploration, no
    plain probes."""

    name = "cycle"
    explores = False
    plain_probes = False

    def forced_option(self, r, step: int, cums: dict) -> str | None:
        forced = KINDS[r.state.steps % len(KINDS)]
        if forced not in cums:
            forced = NGRAM if NGRAM in cums else NONE
        return forced
