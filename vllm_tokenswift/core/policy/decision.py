"""Cost-aware drafting policy: what to propose, per request and per engine step.

The paper drafts with a forward of the target over the budgeted view every step.
That forward reads all the weights again; on hardware where a decode step is
bound by reading the weights it costs close to a plain step, and it only pays
when the chain it buys is accepted often enough. This module decides, every
step and for every request, which option maximises expected **generated tokens
per second** of the whole batch, from costs and acceptance measured while the
engine runs (an extension beyond the paper, which always drafts):

* ``forward``: the TokenSwift draft forward over the budgeted view (``l_0..l_3``
  plus n-grams; paper Sec 3.2-3.3);
* ``fused``: no extra forward; the dependent heads are applied to the pre-norm
  hidden state the *verification* forward already computed at the position
  before the newest token (Medusa-style: head i predicts ``t+1+i`` from ``h_t``,
  so head 1 drafts the token after the newest one), plus n-grams;
* ``chain``: a self-speculative chain: the draft forward run ``m`` times, token by token,
  each over the budgeted view plus the chain so far (the paper's TriForce* baseline);
  ``m`` forwards cost ``m·(c0 + c1·n)`` and draft ``m`` tokens;
* ``ngram``: the request's n-gram chain alone (no forward, no heads);
* ``none``: no draft (a plain step for that request).

and how long each chain is.

**Cost model** (:class:`CostModel`). One engine step costs::

    T = a + g·[D>0] + b1·F + b·(D - F) + [any forward]·(f0 + f1·n_fwd)
          + [any fused]·(h0 + h1·n_fused) + L·(c0 + c1·n_chain)

``a``: a step that verifies no draft tokens (the plain decode step of this batch,
plus the proposer's own fixed work); ``g``: the fixed extra cost of a step that
verifies any draft (vLLM's rejection sampler and spec-decode metadata instead of
the plain sampler); ``b1``: a request's first verified draft token, ``b``: each
later one (at long context on the CPU the first is nearly free, the verification's
attention being bound by reading the KV cache, and the later ones are not; a cost
dict without ``b1`` prices the first as the others); ``D``: draft tokens in the
batch, ``F``: requests verifying any; ``f0 + f1·n`` and ``h0 + h1·n``: the draft forward and the fused heads for
``n`` rows; ``L``: the forwards of the step's self-speculative chains, each over
``n_chain`` rows' views and fitted apart (``c0 + c1·n``: no heads, one logits row per
request; a cost dict without ``c0``/``c1`` prices them as draft forwards). Each is a non-negative ridge least-squares fit over the last
:attr:`CostModel.window` observations (wall-clock, from the proposer's timers),
pulled towards priors expressed as fractions of ``a`` so that a fresh engine starts
with sensible numbers. ``a`` and ``b`` follow context growth and batch-size changes
because old observations leave the window. ``a`` and ``g`` can only be told apart
when some steps verify no draft; when the window holds too few such steps and the
plan's predicted gain over plain decoding is small, :func:`needs_plain_probe` asks
for one plain step.

**Acceptance** (:class:`AcceptanceModel`). Per option and per draft position j,
the probability that draft j is accepted given that drafts ``0..j-1`` were
(``reached``/``accepted`` counts with exponential decay), per request, shrunk
towards the engine-wide figure of the request's group, greedy or sampled (a Beta-style prior of :attr:`prior_weight`
pseudo-observations). Before the chain exists (deciding whether to run a
forward) these per-position means predict the chain; once the chain exists, a
per-token calibration (:class:`Calibration`: acceptance by source, position and
the chain selector's own confidence bin) estimates each token.

**Decision** (:func:`decide`). With ``cum_{r,j}`` the estimated probability that
the first ``j+1`` drafts of request r are accepted, a step generates
``R + Σ_{r,j} cum_{r,j}`` tokens in expectation. Maximising tokens per second
``(R + Σ cum) / T`` over which drafts to include is a ratio problem whose optimum
includes exactly the drafts with ``cum > b·θ*`` (a request's first: ``cum > b1·θ*``),
``θ*`` the optimal throughput (Dinkelbach iteration; a few rounds converge). The fixed costs of the draft
forward and the fused heads are decided by enumerating the on/off combinations,
plus plain decoding (no drafts, no ``g``); each request then takes the option with
the largest surplus
``Σ_j (cum_j − b_j·θ)`` over its best prefix (``b_0 = b1``, ``b_j = b``). The chain
builder later cuts each chain where its per-token estimate drops to ``b·θ``
(:attr:`Decision.threshold`; the first token: :attr:`Decision.threshold_first`).

Determinism: decisions depend on the token history (acceptance counts), the
draft probabilities and the cost model's numbers. Under tensor parallelism the
timings differ per rank, so the proposer broadcasts rank 0's cost model
(:meth:`CostModel.state` / :meth:`CostModel.load_state`) every few steps and all
ranks decide from the same numbers.

The estimates live in :mod:`vllm_tokenswift.core.policy.estimates`; the proposer reaches all of this
through one facade, :class:`vllm_tokenswift.core.policy.base.DraftingPolicy` (account / plan).

Engine-free: numpy only.
"""

from __future__ import annotations

import math
from itertools import accumulate
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_tokenswift.core.config import MIN_GAIN as _MIN_GAIN

# the running estimates the decision is made from (re-exported: ``policy.CostModel`` ...)
from vllm_tokenswift.core.policy.estimates import (CHAIN, DRAFT_KINDS, FORWARD, FUSED, KINDS, NGRAM, NONE,  # noqa: F401
                                       AcceptanceModel, Calibration, CostModel, DepthCounts, shrunk)



# ============================================================== decision
@dataclass
class RowOptions:
    """What one request could do this step: per available option, the estimated
    ``cum_j`` (probability that its first j+1 drafts are accepted).

    Attributes:
        cums: option -> non-increasing array of ``cum_j`` (missing = unavailable).
        forced: an option this request must take this step (exploration, the
            ``"paper"``/``"cycle"`` policies), or None.
    """

    cums: dict
    forced: str | None = None


@dataclass
class Decision:
    """The policy's choice for one step.

    Attributes:
        kinds: per row, the option (``KINDS``).
        lengths: per row, the planned chain length (0 for ``none``).
        threshold: ``b·θ``: the chain builder cuts a chain where its estimated
            cumulative acceptance falls to this value ...
        threshold_first: ... and its first token where it falls to this one,
            ``min(b1, b)·θ`` (None: :attr:`threshold`).
        throughput: the expected tokens per second of the chosen plan (θ).
        step_seconds: its expected step time.
        expected_tokens: its expected generated tokens.
        plain_probe: see below.
    """

    kinds: list
    lengths: list
    threshold: float
    throughput: float
    step_seconds: float
    expected_tokens: float
    #: the adaptive policy replaced the decision by a plain step to measure ``a`` apart
    #: from ``g`` (:func:`needs_plain_probe`)
    plain_probe: bool = False
    threshold_first: float | None = None


def _step_seconds(costs: dict, draft_tokens: int, n_fwd: int, n_fus: int, n_chain: int = 0,
                  chain_len: int = 0, drafting_rows: int = 0) -> float:
    """``T`` of the module doc for a plan with these counts (``chain_len`` forwards for the
    ``n_chain`` rows that take a self-speculative chain; ``drafting_rows``: ``F``, the rows
    with at least one of the ``draft_tokens``, whose first is priced at ``b1``)."""
    t = costs["a"] + costs["b"] * draft_tokens
    if drafting_rows and "b1" in costs:
        t += (costs["b1"] - costs["b"]) * drafting_rows
    if n_chain and chain_len:
        t += chain_len * (_c0(costs) + _c1(costs) * n_chain)
    if draft_tokens > 0:
        t += costs.get("g", 0.0)
    if n_fwd:
        t += costs["f0"] + costs["f1"] * n_fwd
    if n_fus:
        t += costs["h0"] + costs["h1"] * n_fus
    return t


def _c0(costs: dict) -> float:
    """A chain forward's fixed cost (``c0``; the draft forward's ``f0`` when not given)."""
    return costs.get("c0", costs["f0"])


def _c1(costs: dict) -> float:
    """A chain forward's cost per row (``c1``; the draft forward's ``f1`` when not given)."""
    return costs.get("c1", costs["f1"])


def _b1(costs: dict) -> float:
    """A request's first draft token's cost (``b1``; ``b`` when not given)."""
    return costs.get("b1", costs["b"])


def _best_prefix(vals: list, cut0: float, cut: float) -> tuple[int, float]:
    """``(k, s)``: the prefix of ``vals`` (non-increasing ``cum_j``) with the largest surplus
    ``s = Σ_{j<k} (cum_j - cut_j)`` (``cut_0 = cut0``, ``cut_j = cut`` after it), the
    shortest of equal ones; ``(0, 0.0)`` when no prefix has a positive surplus. With
    ``cut0 <= cut`` it is the drafts with ``cum_j > cut_j``; a dearer first draft
    (``cut0 > cut``) may still be worth its followers. O(k): past the first position a
    term ``<= 0`` ends it (``cum`` does not rise)."""
    run = best = 0.0
    k = 0
    for j, v in enumerate(vals):
        c = cut0 if j == 0 else cut
        if j and not v > c:
            break
        run += v - c
        if run > best:
            best, k = run, j + 1
    return k, best


def _candidates(rows: Sequence[RowOptions]) -> list:
    """Per row: ``(forced, [(kind, cum values, prefix sums), ...])`` over the draft options
    it may take (its forced one only, when forced), as Python lists, built once per
    :func:`decide` for all the combinations it tries."""
    cands = []
    for row in rows:
        opts = [row.forced] if row.forced is not None else list(row.cums.keys())
        lst = []
        for kind in opts:
            if kind == NONE or kind not in row.cums:
                continue
            vals = np.asarray(row.cums[kind], dtype=np.float64).tolist()   # Python floats
            lst.append((kind, vals, [0.0, *accumulate(vals)]))
        cands.append((row.forced is not None, lst))
    return cands


def _no_plan_beats(cands: list, costs: dict, theta0: float) -> bool:
    """True only when no plan that drafts can exceed ``theta0`` tokens/s (a sufficient
    test; always False when a row is forced, which must draft even at a loss).

    Dinkelbach's test at ``θ0``: a plan beats ``θ0`` only if ``R + gain - θ0·T > 0``.
    For the plans that may use the options of one fixed-cost combination (n-gram chains,
    plus the draft forward and/or the fused heads with their fixed costs ``f0``/``h0``
    charged, and ``g`` charged always: a plan without drafts gives ``R - θ0·a <= 0``
    anyway), the largest value separates over the rows: each row adds the best of 0 and
    its options' best prefix surplus ``Σ_j (cum_j - θ0·b_j)`` (:func:`_best_prefix`), less ``θ0·f1`` (``θ0·h1``) for the
    forward (fused heads). A plan that uses fewer options than its combination is
    counted, with the right fixed costs, by the smaller combination. So when every
    combination's value is at most 0, so is every plan's. O(rows × options × k)."""
    if any(forced for forced, _lst in cands):
        return False
    a, b = costs["a"], costs["b"]
    cut = b * theta0
    cut0 = _b1(costs) * theta0
    tot = [0.0, 0.0, 0.0, 0.0]      # {ngram}, {ngram, forward}, {ngram, fused}, all
    has_fwd = has_fus = False
    lmax = max((len(vals) for _f, lst in cands for kind, vals, _p in lst if kind == CHAIN), default=0)
    tot_ch = [0.0] * (lmax + 1)      # {ngram, chain of L forwards}, L = 1..lmax
    for _forced, lst in cands:
        s_ng = s_fw = s_fu = 0.0
        s_ch = [0.0] * (lmax + 1)
        for kind, vals, _pre in lst:
            if kind == CHAIN:
                run = top = 0.0           # the best prefix within the first L drafts
                for L in range(1, lmax + 1):
                    if L <= len(vals):
                        run += vals[L - 1] - (cut0 if L == 1 else cut)
                        top = max(top, run)
                    s_ch[L] = top - theta0 * L * _c1(costs)
                continue
            sur = _best_prefix(vals, cut0, cut)[1]
            if kind == NGRAM:
                s_ng = sur
            elif kind == FORWARD:
                has_fwd = True
                s_fw = sur - theta0 * costs["f1"]
            elif kind == FUSED:
                has_fus = True
                s_fu = sur - theta0 * costs["h1"]
        tot[0] += s_ng
        tot[1] += max(s_ng, s_fw)
        tot[2] += max(s_ng, s_fu)
        tot[3] += max(s_ng, s_fw, s_fu)
        for L in range(1, lmax + 1):
            tot_ch[L] += max(s_ng, s_ch[L])
    R = len(cands)
    base = a + costs.get("g", 0.0)
    values = [R - theta0 * base + tot[0]]
    if has_fwd:
        values.append(R - theta0 * (base + costs["f0"]) + tot[1])
    if has_fus:
        values.append(R - theta0 * (base + costs["h0"]) + tot[2])
    if has_fwd and has_fus:
        values.append(R - theta0 * (base + costs["f0"] + costs["h0"]) + tot[3])
    for L in range(1, lmax + 1):
        values.append(R - theta0 * (base + L * _c0(costs)) + tot_ch[L])
    return max(values) < -1e-9 * R


def _plan(cands: list, allowed: set, costs: dict, iters: int = 6, chain_len: int = 0):
    """Best plan when only ``allowed`` options exist: Dinkelbach on the throughput.
    ``chain_len``: with :data:`CHAIN` allowed, the forwards of this step's chains (each
    chain at most that long; the step pays ``chain_len`` draft forwards).

    ``cands``: :func:`_candidates` of the rows. Every Dinkelbach round costs
    O(rows × options × k) float comparisons: an option's surplus at cut ``c`` is
    ``Σ_j max(0, cum_j - c)`` over its prefix of drafts with ``cum_j > c`` (``cum`` is
    non-increasing). Done with numpy on arrays of at most k values, :func:`decide` took
    4x longer at 8 rows (0.36 against 0.09 ms)."""
    R = len(cands)
    b, b1 = costs["b"], _b1(costs)
    theta = R / costs["a"]  # plain decoding's throughput as the first guess
    kinds = [NONE] * R
    lens = [0] * R
    t = costs["a"]
    gain = 0.0
    for _ in range(iters):
        cut, cut0 = b * theta, b1 * theta
        gain = 0.0
        ntok = 0
        n_fwd = n_fus = n_ch = n_drafting = 0
        for i, (forced, lst) in enumerate(cands):
            best, best_s, best_k, best_gain = NONE, 0.0, 0, 0.0
            for kind, vals, pre in lst:
                if kind not in allowed:
                    continue
                if kind == CHAIN:
                    vals = vals[:chain_len]
                k = _best_prefix(vals, cut0, cut)[0]
                if forced:
                    k = max(k, 1) if vals else 0   # a forced option drafts at least one token
                # (the surplus from the prefix sums, as the first-written search had it)
                s = pre[k] - cut * k - ((cut0 - cut) if k else 0.0) + (1e9 if forced else 0.0)
                if s > best_s:
                    best, best_s, best_k, best_gain = kind, s, k, pre[k]
            kinds[i], lens[i] = best, best_k
            gain += best_gain
            ntok += best_k
            n_fwd += best == FORWARD
            n_fus += best == FUSED
            n_ch += best == CHAIN
            n_drafting += best_k > 0
        t = _step_seconds(costs, ntok, n_fwd, n_fus, n_ch, chain_len, n_drafting)
        new_theta = (R + gain) / t
        if abs(new_theta - theta) <= 1e-9 * max(theta, 1e-12):
            theta = new_theta
            break
        theta = new_theta
    return theta, list(kinds), list(lens), t, R + gain


def plain_decision(rows: Sequence[RowOptions], costs: dict) -> Decision:
    """Plain decoding for every request: no drafts, step time ``a``, ``R/a`` tokens/s."""
    R = len(rows)
    a = costs["a"]
    return Decision([NONE] * R, [0] * R, costs["b"] * R / a, R / a, a, float(R),
                    threshold_first=min(_b1(costs), costs["b"]) * R / a)


#: Relative margin by which a drafting plan's predicted throughput must beat plain
#: decoding's before :func:`decide` takes it on its own (``config.MIN_GAIN``, the winner's
#: curse of noisy estimates).
MIN_GAIN = _MIN_GAIN

#: the fixed-cost combinations :func:`decide` enumerates (``{NONE}``: plain decoding)
_COMBOS = (frozenset({NONE}), frozenset({NGRAM, NONE}), frozenset({NGRAM, NONE, FORWARD}),
           frozenset({NGRAM, NONE, FUSED}), frozenset({NGRAM, NONE, FORWARD, FUSED}))
#: with self-speculative chains of ``L`` forwards (enumerated over ``L``; chains are not
#: combined with the one-forward options: both pay draft forwards, and a chain of one
#: forward is the draft forward without the heads)
_CHAIN_COMBO = frozenset({NGRAM, NONE, CHAIN})


def decide(rows: Sequence[RowOptions], costs: dict, min_gain: float = MIN_GAIN) -> Decision:
    """Choose every request's option and chain length to maximise expected tokens/s.

    Enumerates plain decoding and the fixed-cost options (draft forward on/off ×
    fused heads on/off, n-gram chains always allowed; self-speculative chains of each
    length ``L`` with n-gram chains); for each, finds the best plan
    (see module doc) and keeps the best throughput. A plan that switches the forward
    on but gives it no row is the same as the plan without it, so it is never
    preferred; a plan that drafts pays ``g`` once, so plain decoding wins when the
    expected accepted tokens do not cover it. Combinations that do not allow a
    request's forced option are skipped. Plain decoding, when allowed, also wins
    unless the best drafting plan beats it by more than ``min_gain`` (relative).
    When no drafting plan can beat that margin (:func:`_no_plan_beats`), plain
    decoding is returned without planning (the same decision, found in
    O(rows × options × k): most steps of a sampled request end here).

    Args:
        rows: per request (batch order), its :class:`RowOptions`.
        costs: :meth:`CostModel.costs` (``g`` may be absent: 0).
        min_gain: margin over plain decoding a drafting plan needs (see
            :data:`MIN_GAIN`; 0: pure expected-throughput maximisation).
    Returns:
        :class:`Decision`.
    """
    if not rows:
        return Decision([], [], 0.0, 0.0, 0.0, 0.0)
    forced_kinds = {r.forced for r in rows if r.forced is not None}
    cands = _candidates(rows)
    margin = 1 + max(0.0, min_gain)
    if _no_plan_beats(cands, costs, margin * len(rows) / costs["a"]):   # False with forced rows
        return plain_decision(rows, costs)
    best = plain = None
    for allowed in _COMBOS:
        if not forced_kinds <= allowed:
            continue
        if allowed == {NONE}:
            d = plain_decision(rows, costs)
            plain = (d.throughput, d.kinds, d.lengths, d.step_seconds, d.expected_tokens)
            continue
        plan = _plan(cands, allowed, costs)
        if best is None or plan[0] > best[0] * (1 + 1e-12):
            best = plan
    lmax = max((len(r.cums[CHAIN]) for r in rows if CHAIN in r.cums), default=0)
    for L in range(1, lmax + 1):
        # rows forced to another option (exploration, the cycle policy) take it beside the chains
        plan = _plan(cands, _CHAIN_COMBO | forced_kinds, costs, chain_len=L)
        if best is None or plan[0] > best[0] * (1 + 1e-12):
            best = plan
    if plain is not None and (best is None or not any(best[2])
                              or best[0] <= plain[0] * margin):
        best = plain
    theta, kinds, lens, t, tokens = best
    return Decision(kinds, lens, costs["b"] * theta, theta, t, tokens,
                    threshold_first=min(_b1(costs), costs["b"]) * theta)


def needs_plain_probe(decision: Decision, rows: Sequence[RowOptions], costs: dict,
                      plain_obs: int, min_plain: int = 4, margin: float = 1.3) -> bool:
    """Whether to run a plain step instead of ``decision`` to measure ``a`` apart from ``g``.

    When every recent step verified drafts, the step fit only knows ``a + g`` and
    falls back on the prior for the split; a wrong split biases every later choice
    between drafting and plain decoding. A probe is worth its cost only when the
    choice is close: the decision drafts, no request is forced to draft
    (exploration), fewer than ``min_plain`` plain steps are in the cost model's window
    and the plan's predicted throughput is below ``margin`` × plain decoding's.

    Args:
        decision: :func:`decide`'s choice for this step.
        rows: the same rows.
        costs: the same costs.
        plain_obs: :meth:`CostModel.plain_observations`.
    Returns:
        True: take :func:`plain_decision` this step.
    """
    if not rows or not any(decision.lengths) or any(r.forced is not None for r in rows):
        return False
    if plain_obs >= min_plain:
        return False
    return decision.throughput < margin * len(rows) / costs["a"]


def expected_tokens_per_second(cums: Sequence[np.ndarray], costs: dict, *, forward_rows: int = 0,
                               fused_rows: int = 0) -> float:
    """``(R + Σ cum) / T`` for given chains (``D`` = their total length, ``T`` as in the
    module doc); the arithmetic :func:`decide` maximises, exposed for reports and tests."""
    R = len(cums)
    D = sum(len(c) for c in cums)
    t = _step_seconds(costs, D, forward_rows, fused_rows, drafting_rows=sum(len(c) > 0 for c in cums))
    return (R + float(sum(float(np.sum(c)) for c in cums))) / t


def cut_length(cum: Sequence[float], threshold: float, first: float | None = None) -> int:
    """Longest prefix whose cumulative estimates all exceed ``threshold``, the first one
    ``first`` instead when given (at least 0).

    Whether position j is kept depends on ``cum[0..j]`` only, never on a later position's
    estimate: a later estimate may depend on the token drafted at j (see
    :meth:`AdaptivePolicy.cut <vllm_tokenswift.core.policy.adaptive.AdaptivePolicy.cut>`)."""
    k = 0
    for c in cum:
        thr = first if (k == 0 and first is not None) else threshold
        if c <= thr or not math.isfinite(c):
            break
        k += 1
    return k
