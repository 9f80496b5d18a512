"""Unit tests of the cost-aware drafting policy (``vllm_tokenswift.core.policy.decision``), engine-free."""

import numpy as np
import pytest

from vllm_tokenswift.core.policy import estimates
from vllm_tokenswift.core.policy import decision as pol


def costs(a=0.1, b=0.01, f0=0.08, f1=0.0, h0=0.015, h1=0.0):
    return {"a": a, "b": b, "f0": f0, "f1": f1, "h0": h0, "h1": h1}


def row(**cums):
    return pol.RowOptions({k: np.asarray(v, dtype=float) for k, v in cums.items()})


def test_worked_example_tokens_per_second():
    """One request, ngram chain with cum [0.9, 0.72, 0.5]: step = 0.1 + 3·0.01 = 0.13 s,
    tokens = 1 + 2.12 = 3.12 -> 24.0 tok/s; plain decoding: 10 tok/s."""
    c = costs()
    assert pol.expected_tokens_per_second([np.array([0.9, 0.72, 0.5])], c) == pytest.approx(3.12 / 0.13)
    assert pol.expected_tokens_per_second([np.zeros(0)], c) == pytest.approx(10.0)
    # a forward adds its fixed cost
    assert pol.expected_tokens_per_second([np.array([0.9])], c, forward_rows=1) == \
        pytest.approx(1.9 / (0.1 + 0.01 + 0.08))
    d = pol.decide([row(ngram=[0.9, 0.72, 0.5], none=[])], c)
    assert d.kinds == ["ngram"] and d.lengths == [3]
    assert d.throughput == pytest.approx(3.12 / 0.13)
    assert d.step_seconds == pytest.approx(0.13) and d.expected_tokens == pytest.approx(3.12)
    assert d.threshold == pytest.approx(0.01 * 3.12 / 0.13)


def test_free_verification_and_high_acceptance_drafts_long():
    c = costs(b=1e-6, f0=1e-6, h0=1e-6)
    cum = np.cumprod(np.full(16, 0.95))
    d = pol.decide([row(ngram=cum, none=[])], c)
    assert d.kinds == ["ngram"] and d.lengths == [16]


def test_forward_costing_a_full_step_with_useless_heads_never_runs():
    c = costs(a=0.1, b=0.01, f0=0.1)
    rows = [row(forward=[0.0, 0.0, 0.0, 0.0], ngram=[0.3], none=[]) for _ in range(4)]
    d = pol.decide(rows, c)
    assert "forward" not in d.kinds
    # and with nothing worth drafting at all, a plain step
    d = pol.decide([row(forward=[0.0] * 4, none=[])], c)
    assert d.kinds == ["none"] and d.lengths == [0]
    assert d.throughput == pytest.approx(1 / 0.1)


def test_forward_runs_when_it_pays_and_is_shared_by_the_batch():
    c = costs(a=0.1, b=0.01, f0=0.08, f1=0.001)
    good = np.cumprod([0.9, 0.8, 0.7, 0.6])
    # one request: E = 0.9 + 0.72 + 0.504 + 0.3024 = 2.43 accepted, worth 0.08 + 4·0.01
    d = pol.decide([row(forward=good, none=[])], c)
    assert d.kinds == ["forward"] and d.lengths == [4]
    assert d.throughput == pytest.approx((1 + good.sum()) / (0.1 + 0.04 + 0.081))
    # weak heads: the fixed cost does not pay for one request ...
    weak = np.cumprod([0.3, 0.2])
    assert pol.decide([row(forward=weak, none=[])], c).kinds == ["none"]
    # ... and fused heads, much cheaper, do
    d = pol.decide([row(forward=weak, fused=weak, none=[])], costs(a=0.1, b=0.005, f0=0.08, h0=0.002))
    assert d.kinds == ["fused"]


def test_chain_length_follows_the_marginal_rule():
    c = costs(a=0.1, b=0.02)
    cum = np.array([0.9, 0.5, 0.25, 0.1, 0.04])
    d = pol.decide([row(ngram=cum, none=[])], c)
    theta = d.throughput
    # every kept draft has cum > b·θ, every dropped one does not
    k = d.lengths[0]
    assert all(cum[:k] > c["b"] * theta) and all(cum[k:] <= c["b"] * theta)
    # and no other prefix length is better
    best = max(range(6), key=lambda n: (1 + cum[:n].sum()) / (0.1 + 0.02 * n))
    assert k == best


def test_forced_options_are_honoured():
    c = costs(a=0.1, b=0.01, f0=0.1)
    r = pol.RowOptions({"forward": np.array([0.0, 0.0]), "none": np.zeros(0)}, forced="forward")
    d = pol.decide([r, row(ngram=[0.9], none=[])], c)
    assert d.kinds == ["forward", "ngram"] and d.lengths[0] >= 1


def test_one_draft_forward_try_outweighs_the_cost_prior():
    # long context: a plain step 42 ms, the draft forward over a 1,024-token view 9 ms
    # (0.2x), far below the prior's 1.1x; the first measured try must move the estimate
    # below the point where a forward that buys ~0.8 tokens pays (~0.7x a plain step)
    cm = pol.CostModel()
    for d in [0, 2, 0, 4] * 4:
        cm.observe_step(0.042 + 0.002 * d, rows=1, draft_tokens=d)
    c = cm.costs()
    assert c["f0"] + c["f1"] == pytest.approx((cm.prior_forward + cm.prior_forward_row) * c["a"], rel=0.05)
    cm.observe_forward(0.009, rows=1)
    c = cm.costs()
    assert c["f0"] + c["f1"] < 0.6 * c["a"]
    cm.observe_forward(0.009, rows=1)
    c = cm.costs()
    assert c["f0"] + c["f1"] < 0.45 * c["a"]


def test_cost_model_fits_and_priors():
    cm = pol.CostModel(window=32)
    assert not cm.ready
    for d in [0, 4, 8, 0, 4, 8, 2, 6] * 4:
        cm.observe_step(0.1 + 0.01 * d, rows=1, draft_tokens=d)
    c = cm.costs()
    assert c["a"] == pytest.approx(0.1, rel=0.05) and c["b"] == pytest.approx(0.01, rel=0.1)
    # no forward observed: prior fraction of a
    assert c["f0"] == pytest.approx(cm.prior_forward * c["a"], rel=0.05)
    for _ in range(32):
        cm.observe_forward(0.05, rows=2)
    assert cm.costs()["f0"] + 2 * cm.costs()["f1"] == pytest.approx(0.05, rel=0.05)
    # TP: load another rank's numbers verbatim
    other = pol.CostModel()
    other.load_state(cm.state())
    assert other.costs() == pytest.approx(cm.costs())


def test_draft_token_prior_is_a_fraction_of_the_whole_batch_step():
    """Before any drafting step is observed, a verified draft token is priced at
    ``prior_b`` × the plain step of the whole batch, at batch 1 and at batch 8 alike (it
    used to be divided by the batch size: 0.08·a/8 at batch 8)."""
    for rows in (1, 8):
        cm = pol.CostModel(prior_b=0.08)
        for _ in range(16):
            cm.observe_step(0.2, rows=rows, draft_tokens=0)   # plain steps only: b is the prior's
        c = cm.costs()
        assert c["a"] == pytest.approx(0.2, rel=1e-6)
        assert c["b"] == pytest.approx(0.08 * 0.2, rel=1e-6)
        assert c["b1"] == pytest.approx(0.08 * 0.2, rel=1e-6)
    cm = pol.CostModel(prior_b=0.01)
    cm.observe_step(0.2, rows=8, draft_tokens=0)
    assert cm.costs()["b"] == pytest.approx(0.002, rel=1e-6)


def test_an_outlier_first_step_does_not_scale_the_priors():
    """The priors are fractions of the median draft-free step in the window, not of the
    first step observed: the first decode step after a 16K-token prefill took 244 ms
    against 17 ms for the next ones (demo model), and priors scaled by it held ``b`` at
    16 ms per draft token (the steps measured ~3) while the window saw one drafting step,
    so the policy priced drafts out at long context."""
    cm = pol.CostModel()
    cm.observe_step(0.244, rows=1, draft_tokens=0)              # the outlier, first
    for _ in range(62):
        cm.observe_step(0.017, rows=1, draft_tokens=0)
    cm.observe_step(0.0231, rows=1, draft_tokens=1)              # one drafting step: +6 ms
    c = cm.costs()
    # a is the window's least-squares fit, outlier included (it leaves after 64 steps)
    assert c["a"] == pytest.approx((0.244 + 62 * 0.017) / 63, rel=0.03)
    # g and b1 stay near their priors (fractions of 17 ms) and explain the one drafting step
    assert c["b1"] < 0.006 and c["g"] < 0.008, c
    assert c["a"] + c["g"] + c["b1"] == pytest.approx(0.0231, abs=0.004)
    # the draft forward's prior too: 0.8 + 0.3 plain steps of 17 ms, not of 244
    assert c["f0"] + c["f1"] == pytest.approx((cm.prior_forward + cm.prior_forward_row) * c["a"], rel=0.05)
    # before any draft-free step, the median of all observed steps
    only = pol.CostModel()
    only.observe_step(0.03, rows=1, draft_tokens=2)
    assert only._a_prior() == pytest.approx(0.03)
    assert pol.CostModel()._a_prior() == 1.0


def test_acceptance_counts_and_shrinkage():
    am = pol.AcceptanceModel(depth=4, prior_weight=4.0)
    req = am.new_request()
    for _ in range(50):
        am.record(req, "fused", num_verified=3, num_accepted=1)  # pos 0 always, pos 1 never
    p = am.probs(req, "fused")
    assert p[0] > 0.95 and p[1] < 0.1
    cum = am.cumulative(req, "fused", 3)
    assert cum[0] == pytest.approx(p[0]) and cum[1] == pytest.approx(p[0] * p[1])
    # an untouched option stays at its prior
    assert am.probs(am.new_request(), "forward")[0] == pytest.approx(am.initial["forward"])


def test_acceptance_engine_figures_are_kept_per_group():
    """Greedy traffic must not teach sampled requests that drafting pays (one engine
    serving both: the demo's greedy run then its sampled run)."""
    am = pol.AcceptanceModel(depth=4, prior_weight=4.0)
    for _ in range(200):
        am.record(am.new_request("greedy"), "forward", num_verified=4, num_accepted=4)
    assert am.engine_probs("forward", "greedy")[0] > 0.98
    # a new sampled request still starts from the initial prior, not the greedy figure
    fresh = am.new_request("sampled")
    assert am.probs(fresh, "forward").tolist() == pytest.approx([am.initial["forward"]] * 4)
    for _ in range(200):
        am.record(am.new_request("sampled"), "forward", num_verified=4, num_accepted=0)
    assert am.engine_probs("forward", "sampled")[0] < 0.02
    assert am.engine_probs("forward", "greedy")[0] > 0.98   # untouched by sampled traffic
    assert am.cumulative(am.new_request("greedy"), "forward", 2)[1] > 0.95


def test_cost_model_solves_again_every_refresh_every_observations():
    """With ``refresh_every=8`` the estimates are re-solved on each of the first 16 step
    observations, then only after every 8th (or a draft-forward/fused observation);
    ``refresh_every=1`` re-solves after every observation."""
    lazy, eager = pol.CostModel(refresh_every=8), pol.CostModel()
    history = []
    for i in range(40):
        for cm in (lazy, eager):
            cm.observe_step(0.1 + 0.001 * i, rows=1, draft_tokens=0)
        history.append((lazy.costs()["a"], eager.costs()["a"]))
    # warm-up: both track every observation
    assert [h[0] for h in history[:16]] == [h[1] for h in history[:16]]
    # then the lazy one holds its solution for 7 observations and catches up on the 8th
    for i in range(16, 40):
        lazy_a, eager_a = history[i]
        since = (i - 15) % 8
        if since == 0:
            assert lazy_a == eager_a, i
        else:
            assert lazy_a == history[i - since][1] and lazy_a < eager_a, i
    lazy.observe_forward(0.05, rows=1)          # a forward observation re-solves at once,
    eager.observe_forward(0.05, rows=1)
    assert lazy.costs() == eager.costs()        # the step fit's pending observations too
    c = lazy.costs()
    c["a"] = -1.0                               # callers get a copy
    assert lazy.costs()["a"] > 0
    with pytest.raises(ValueError, match="refresh_every"):
        pol.CostModel(refresh_every=0)


def test_cumulative_is_cached_until_the_counts_change():
    """``cumulative`` returns the same (read-only) array while neither the request's nor
    its group's counts of that option changed, and a fresh one when either did."""
    am = pol.AcceptanceModel(depth=4, prior_weight=4.0)
    req, other = am.new_request("sampled"), am.new_request("sampled")
    first = am.cumulative(req, pol.FORWARD, 4)
    assert am.cumulative(req, pol.FORWARD, 4) is first
    assert not first.flags.writeable
    assert am.cumulative(req, pol.FORWARD, 2).tolist() == first[:2].tolist()
    am.record(req, pol.NGRAM, 3, 0)                  # another option: no change
    assert am.cumulative(req, pol.FORWARD, 4).tolist() == first.tolist()
    am.record(other, pol.FORWARD, 4, 0)              # the group's figure moved
    second = am.cumulative(req, pol.FORWARD, 4)
    assert second[0] < first[0]
    am.record(req, pol.FORWARD, 4, 4)                # the request's own counts moved
    third = am.cumulative(req, pol.FORWARD, 4)
    assert third[0] > second[0]
    assert third.tolist() == np.cumprod(am.probs(req, pol.FORWARD)).tolist()
    am.record(am.new_request("greedy"), pol.FORWARD, 4, 4)   # another group: no change
    assert am.cumulative(req, pol.FORWARD, 4) is third


def test_depth_counts_reached_and_accepted():
    dc = pol.DepthCounts(depth=4, decay=1.0)
    dc.update(4, 2)   # positions 0, 1 accepted, 2 rejected, 3 not reached
    dc.update(2, 2)   # both accepted
    assert dc.reached.tolist() == [2, 2, 1, 0]
    assert dc.accepted.tolist() == [2, 2, 0, 0]


def test_calibration_learns():
    cal = pol.Calibration(num_bins=10, prior_weight=2.0, decay=1.0)
    assert cal.prob(1, 0, 0.95) == pytest.approx(0.95)  # prior: the bin centre
    for _ in range(100):
        cal.update([1, 1], [0.95, 0.95], num_verified=2, num_accepted=0)
    assert cal.prob(1, 0, 0.95) < 0.05
    assert cal.prob(1, 1, 0.95) == pytest.approx(0.95)  # never reached



def test_calibration_observe_books_one_unverified_token():
    """observe() books one token at its own (source, position, bin), decayed like
    update(), and nothing else; it moves a position that update() never reaches."""
    cal = pol.Calibration(num_bins=10, positions=4, prior_weight=4.0, decay=0.5)
    cal.update([1, 1], [0.95, 0.95], num_verified=2, num_accepted=2)
    assert (cal.reached, cal.accepted) == ({(1, 0, 9): 1.0, (1, 1, 9): 1.0}, {(1, 0, 9): 1.0, (1, 1, 9): 1.0})
    cal.observe(1, 2, 0.95, accepted=True)
    cal.observe(1, 1, 0.95, accepted=False)
    cal.observe(11, 6, 0.31, accepted=True)          # past the last position bucket: shares it
    assert cal.reached == {(1, 0, 9): 1.0, (1, 1, 9): 1.5, (1, 2, 9): 1.0, (11, 3, 3): 1.0}
    assert cal.accepted == {(1, 0, 9): 1.0, (1, 1, 9): 0.5, (1, 2, 9): 1.0, (11, 3, 3): 1.0}
    assert cal.prob(1, 1, 0.95) == pytest.approx((0.5 + 4 * 0.95) / (1.5 + 4))


def test_calibration_chain_cum_is_the_running_product_of_prob_bit_for_bit():
    """chain_cum inlines prob(); it must give exactly np.cumprod of prob per token (the
    decision compares these values with thresholds), positions past the last bucket
    sharing it, confidences 0 and 1 in the end bins."""
    cal = pol.Calibration(num_bins=10, positions=4, prior_weight=4.0, decay=0.999)
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        src = rng.integers(0, 3, n).tolist()
        conf = rng.random(n).tolist()
        cal.update(src, conf, num_verified=n, num_accepted=int(rng.integers(0, n + 1)))
    for _ in range(50):
        n = int(rng.integers(0, 9))
        src = rng.integers(0, 3, n).tolist()
        conf = [0.0, 1.0, *rng.random(n).tolist()][:n]
        got = cal.chain_cum(src, conf)
        want = np.cumprod(np.asarray([cal.prob(s, j, c) for j, (s, c) in enumerate(zip(src, conf))],
                                     dtype=np.float64))
        assert got.dtype == np.float64 and got.shape == (n,)
        assert got.tolist() == want.tolist()


def test_calibration_priors_replace_the_bin_centre_per_token():
    """``chain_cum(..., priors)``: a token with a prior shrinks its bin towards it instead
    of the bin's centre; None keeps the centre; observations move both alike."""
    cal = pol.Calibration(num_bins=10, positions=4, prior_weight=4.0)
    np.testing.assert_allclose(cal.chain_cum([13, 13], [0.15, 0.15]), [0.15, 0.15 * 0.15])
    np.testing.assert_allclose(cal.chain_cum([13, 13], [0.15, 0.15], [0.6, None]), [0.6, 0.6 * 0.15])
    for _ in range(4):
        cal.update([13], [0.15], 1, 1)          # position 0, bin 1: 4 of 4 accepted
    np.testing.assert_allclose(cal.chain_cum([13], [0.15], [0.6]), [(4 + 4 * 0.6) / 8], rtol=1e-3)   # decay 0.999
    np.testing.assert_allclose(cal.chain_cum([13], [0.15]), [(4 + 4 * 0.15) / 8], rtol=1e-3)


def test_cut_length():
    assert pol.cut_length([0.9, 0.5, 0.2], 0.3) == 2
    assert pol.cut_length([0.1], 0.3) == 0
    assert pol.cut_length([], 0.0) == 0


def test_cost_model_separates_the_fixed_price_of_drafting():
    """Steps without drafts cost a = 0.1 s; steps with D drafts cost a + g + b·D with
    g = 0.02, b = 0.01: the fit recovers a, b and the first draft's price g + b1 (one
    request per step: ``g`` and ``b1`` are the same column, split by their priors), and
    counts the plain steps it holds."""
    cm = pol.CostModel(window=40)
    for d in [0, 3, 6, 0, 1, 5, 2, 0, 4, 8] * 4:
        cm.observe_step(0.1 + (0.02 + 0.01 * d if d else 0.0), rows=1, draft_tokens=d)
    c = cm.costs()
    assert c["a"] == pytest.approx(0.1, rel=0.03)
    assert c["g"] + c["b1"] == pytest.approx(0.03, rel=0.05)
    assert c["b"] == pytest.approx(0.01, rel=0.05)
    assert cm.plain_observations() == 12
    # plain observations leave the window with the steps that made them
    for _ in range(35):
        cm.observe_step(0.15, rows=1, draft_tokens=4)
    assert cm.plain_observations() == 1       # the last 5 of the old cycle (5, 2, 0, 4, 8) hold one
    for _ in range(5):
        cm.observe_step(0.15, rows=1, draft_tokens=4)
    assert cm.plain_observations() == 0
    assert tuple(cm.costs()) == pol.CostModel.KEYS


def test_cost_state_round_trip_and_length_check():
    cm = pol.CostModel()
    cm.observe_step(0.1, rows=2, draft_tokens=0)
    vec = cm.state()
    assert vec.shape == (len(pol.CostModel.KEYS),) and vec.dtype == np.float64
    other = pol.CostModel()
    other.load_state(vec)
    assert other.costs() == pytest.approx(cm.costs())
    with pytest.raises(ValueError, match="expected 10"):
        other.load_state(vec[:9])


def test_chain_forwards_are_fitted_apart_from_the_draft_forward():
    """A chain forward (no heads, one logits row) is fitted on its own (``c0``, ``c1``); before
    any is observed it is priced as a draft forward."""
    cm = pol.CostModel()
    for _ in range(20):
        cm.observe_step(0.020, rows=1, draft_tokens=0)
    for _ in range(10):
        cm.observe_forward(0.0075, rows=1)
    c = cm.costs()
    assert c["c0"] + c["c1"] == pytest.approx(c["f0"] + c["f1"], rel=1e-6)
    assert c["f0"] + c["f1"] == pytest.approx(0.0075, rel=0.1)
    for _ in range(10):
        cm.observe_chain(0.004, rows=1)
    c = cm.costs()
    assert c["c0"] + c["c1"] == pytest.approx(0.004, rel=0.1)
    assert c["f0"] + c["f1"] == pytest.approx(0.0075, rel=0.1)      # the draft forward's fit is unchanged


def test_a_one_token_chain_is_chosen_when_its_own_forward_is_cheap():
    """Demo model at 32K under the paper's sampling (rounded from a run's cost model): a plain
    step 20 ms, a draft forward with heads 7.3 ms, a chain forward 4 ms, the first token
    accepted 60% (chain) / 64% (forward, its second position 2%). The one-token chain gives
    1.6 / 28.7 ms = 1.11x plain decoding; priced at the draft forward's 7.3 ms it would give
    1.6 / 32 ms = 1.0x, under the 5% margin, and plain decoding would win."""
    c = {"a": 0.020, "g": 0.0022, "b": 0.0025, "f0": 0.0073, "f1": 0.0, "h0": 0.0019, "h1": 0.0}
    r = row(none=[], forward=[0.64, 0.0128], chain=[0.6, 0.36, 0.216])
    d = pol.decide([r], dict(c, c0=0.004, c1=0.0))
    assert d.kinds == ["chain"] and d.lengths == [1]
    assert d.step_seconds == pytest.approx(0.020 + 0.0022 + 0.0025 + 0.004)
    assert d.throughput == pytest.approx(1.6 / 0.0287)
    assert pol.decide([r], c).kinds == ["none"]                        # chains priced as draft forwards


def test_sampled_forward_and_chain_share_their_first_token():
    """Under sampling the draft forward's first token and a chain's are the same draw from
    l_0: each verified first token is booked for both (position 0 only); greedy requests
    keep the two apart."""
    am = estimates.AcceptanceModel(depth=4)
    s, g = am.new_request("sampled"), am.new_request("greedy")
    am.record(s, "forward", 2, 1)          # first accepted, second rejected
    am.record(s, "chain", 1, 0)            # first rejected
    for kind in ("forward", "chain"):     # per request decay 0.98: 1·0.98 + 1 reached, 1·0.98 + 0 accepted
        assert s[kind].reached[0] == pytest.approx(1.98) and s[kind].accepted[0] == pytest.approx(0.98)
    # the forward's second position is its own: the chain's stays unobserved
    assert s["forward"].reached[1] == pytest.approx(1.0) and s["chain"].reached[1] == 0.0
    eng = am._group("sampled")
    assert eng["chain"].reached[0] == pytest.approx(eng["forward"].reached[0])
    assert am.probs(s, "chain")[0] == pytest.approx(am.probs(s, "forward")[0])
    am.record(g, "forward", 2, 1)
    assert g["chain"].reached[0] == 0.0 and am._group("greedy")["chain"].reached[0] == 0.0
    # nothing verified: nothing shared
    before = s["chain"].version
    am.record(s, "forward", 0, 0, span=3)
    assert s["chain"].version == before


def test_rank0_keeps_broadcasting_fresh_costs_after_loading_its_own_state():
    """Under TP every rank, rank 0 included, loads rank 0's state; rank 0's next
    broadcast must still come from its observations since (not the frozen numbers),
    while the decisions in between use the frozen numbers on every rank."""
    rank0, rank1 = pol.CostModel(), pol.CostModel()
    for _ in range(20):
        rank0.observe_step(0.10, rows=1, draft_tokens=0)
        rank1.observe_step(0.30, rows=1, draft_tokens=0)   # a slower rank's own timings
    vec = rank0.state()
    rank0.load_state(vec)
    rank1.load_state(vec)
    assert rank0.costs() == rank1.costs()
    assert rank0.costs()["a"] == pytest.approx(0.10, rel=0.05)
    for _ in range(200):                                   # rank 0's steps get 3x slower
        rank0.observe_step(0.30, rows=1, draft_tokens=0)
    assert rank0.costs()["a"] == pytest.approx(0.10, rel=0.05)   # frozen until the next sync
    fresh = rank0.state()
    assert fresh[pol.CostModel.KEYS.index("a")] == pytest.approx(0.30, rel=0.05)
    rank0.load_state(fresh)
    rank1.load_state(fresh)
    assert rank0.costs() == rank1.costs() and rank1.costs()["a"] == pytest.approx(0.30, rel=0.05)


def test_fixed_price_of_drafting_makes_plain_decoding_win():
    """An n-gram chain with cum [0.15, 0.05]: with g = 0 its first token pays
    (0.15 > b·θ = 0.01·10); with g = 0.02 the best drafting plan makes
    1.15 / 0.13 = 8.85 tok/s < 10 tok/s of plain decoding, so no request drafts."""
    r = row(ngram=[0.15, 0.05], none=[])
    d0 = pol.decide([r], costs(), min_gain=0.0)
    assert d0.kinds == ["ngram"] and d0.lengths == [1]
    assert d0.throughput == pytest.approx(1.15 / 0.11)
    d = pol.decide([r], dict(costs(), g=0.02))
    assert d.kinds == ["none"] and d.lengths == [0]
    assert d.throughput == pytest.approx(10.0) and d.step_seconds == pytest.approx(0.1)
    assert pol.plain_decision([r, r], costs()).kinds == ["none", "none"]
    # the price is paid once per step, not per request
    d8 = pol.decide([row(ngram=[0.5], none=[])] * 8, dict(costs(b=0.001), g=0.02))
    assert d8.kinds == ["ngram"] * 8
    assert d8.throughput == pytest.approx(12 / (0.1 + 0.02 + 0.008))
    # a forced option still drafts (exploration), paying g
    forced = pol.RowOptions({"ngram": np.array([0.15]), "none": np.zeros(0)}, forced="ngram")
    assert pol.decide([forced], dict(costs(), g=0.02)).kinds == ["ngram"]


def test_drafting_needs_a_margin_over_plain_decoding():
    """The chain of the test above predicts 1.15 / 0.11 = 10.45 tok/s against plain
    decoding's 10: a 4.5% gain, below the default 5% margin (MIN_GAIN), so the policy
    stays plain; a chain predicting 1.3 / 0.11 = 11.8 tok/s (18%) drafts; a margin of
    20% refuses that one too; a forced try drafts whatever the margin."""
    assert pol.MIN_GAIN == pytest.approx(0.05)
    small = [row(ngram=[0.15, 0.05], none=[])]
    d = pol.decide(small, costs())
    assert d.kinds == ["none"] and d.throughput == pytest.approx(10.0)
    clear = [row(ngram=[0.3], none=[])]
    assert pol.decide(clear, costs()).kinds == ["ngram"]
    assert pol.decide(clear, costs()).throughput == pytest.approx(1.3 / 0.11)
    assert pol.decide(clear, costs(), min_gain=0.2).kinds == ["none"]
    forced = pol.RowOptions({"ngram": np.array([0.15]), "none": np.zeros(0)}, forced="ngram")
    assert pol.decide([forced], costs(), min_gain=0.2).kinds == ["ngram"]


def test_plain_probe_only_when_the_choice_is_close_and_unmeasured():
    c = dict(costs(), g=0.0)
    close = [row(ngram=[0.3], none=[])]                 # 1.3 / 0.11 = 11.8 tok/s vs 10
    far = [row(ngram=np.cumprod(np.full(8, 0.95)), none=[])]
    d_close, d_far = pol.decide(close, c), pol.decide(far, c)
    assert d_close.lengths == [1] and d_far.lengths == [8]
    assert pol.needs_plain_probe(d_close, close, c, plain_obs=0)
    assert pol.needs_plain_probe(d_close, close, c, plain_obs=3)
    assert not pol.needs_plain_probe(d_close, close, c, plain_obs=4)       # measured enough
    assert not pol.needs_plain_probe(d_far, far, c, plain_obs=0)           # gain beyond the margin
    plain = pol.plain_decision(close, c)
    assert not pol.needs_plain_probe(plain, close, c, plain_obs=0)         # already plain
    forced = [pol.RowOptions({"ngram": np.array([0.3]), "none": np.zeros(0)}, forced="ngram")]
    assert not pol.needs_plain_probe(pol.decide(forced, c), forced, c, plain_obs=0)


def test_ridge_fit_running_sums_equal_the_batch_solution():
    """The step fit keeps X'X and X'y as running sums over its window (O(1) per step):
    after many more observations than the window, and at every point in between, its
    solution equals numpy's ridge solution over the window's rows, non-negativity
    included."""
    rng = np.random.default_rng(3)
    fit = estimates._RidgeFit(3, window=16, strength=0.5)
    prior, scale = [0.02, 0.004, 0.001], [1.0, 1.0, 4.0]
    for step in range(100):
        d = int(rng.integers(0, 9)) if step % 3 else 0
        fit.add((1.0, 1.0 if d else 0.0, d), 0.02 + 0.005 * (d > 0) + 0.002 * d + rng.normal() * 1e-3)
        X = np.array([r[0] for r in fit.rows])
        y = np.array([r[1] for r in fit.rows])
        lam = 0.5 * np.array(scale) ** 2
        ref = np.linalg.solve(X.T @ X + np.diag(lam), X.T @ y + lam * np.array(prior))
        got = fit.solve(prior, scale)
        if (ref >= 0).all():
            np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
        assert min(got) >= 0.0 and len(fit) == min(step + 1, 16)
    # a coefficient the data push below zero is fixed at 0 and the rest refitted
    neg = estimates._RidgeFit(2, window=8, strength=1e-6)
    for d in range(8):
        neg.add((1.0, d), 0.05 - 0.001 * d)
    c = neg.solve([0.0, 0.0], [1.0, 1.0])
    assert c[1] == 0.0 and c[0] == pytest.approx(np.mean([0.05 - 0.001 * d for d in range(8)]), rel=1e-4)


def test_acceptance_counts_what_an_option_realises_after_the_cut():
    """With ``span`` (the option's planned length) a chain that the cut shortened and that
    was wholly accepted counts its first missing position as reached and not accepted, and
    an emptied chain counts position 0 so; without it only verified positions count."""
    d = pol.DepthCounts(4, decay=1.0)
    d.update(1, 1, span=4)              # cut to 1 token, accepted
    assert d.reached.tolist() == [1, 1, 0, 0] and d.accepted.tolist() == [1, 0, 0, 0]
    d.update(0, 0, span=4)              # cut to nothing: the forward realised no draft
    assert d.reached.tolist() == [2, 1, 0, 0] and d.accepted.tolist() == [1, 0, 0, 0]
    d.update(4, 2, span=4)              # full chain, a rejection at position 2
    assert d.reached.tolist() == [3, 2, 1, 0] and d.accepted.tolist() == [2, 1, 0, 0]
    plain = pol.DepthCounts(4, decay=1.0)
    plain.update(1, 1)
    plain.update(0, 0)
    assert plain.reached.tolist() == [1, 0, 0, 0] and plain.accepted.tolist() == [1, 0, 0, 0]
    # the decision's estimate of a draft forward whose head tokens are always cut
    m = pol.AcceptanceModel(4, prior_weight=8.0)
    req = m.new_request("sampled")
    for _ in range(200):
        m.record(req, pol.FORWARD, 1, 1, span=4)
    cum = m.cumulative(req, pol.FORWARD, 4)
    assert cum[0] > 0.95 and cum[1] < 0.05


def _reference_plan(rows, allowed, costs, iters=6):
    """The plan search as first written (numpy per option), kept to check the list-based one."""
    R = len(rows)
    b = costs["b"]
    theta = R / costs["a"]
    kinds, lens, t, gain = [pol.NONE] * R, [0] * R, costs["a"], 0.0
    for _ in range(iters):
        cut = b * theta
        gain, ntok, n_fwd, n_fus = 0.0, 0, 0, 0
        for i, row in enumerate(rows):
            best, best_s, best_k, best_gain = pol.NONE, 0.0, 0, 0.0
            opts = [row.forced] if row.forced is not None else list(row.cums.keys())
            for kind in opts:
                if kind == pol.NONE or kind not in allowed or kind not in row.cums:
                    continue
                cum = row.cums[kind]
                k = int(np.searchsorted(-cum, -cut, side="left")) if cum.size else 0
                s = float(cum[:k].sum() - cut * k)
                if row.forced is not None:
                    k = max(k, 1) if cum.size else 0
                    s = float(cum[:k].sum() - cut * k) + 1e9
                if s > best_s:
                    best, best_s, best_k, best_gain = kind, s, k, float(cum[:k].sum())
            kinds[i], lens[i] = best, best_k
            gain += best_gain
            ntok += best_k
            n_fwd += best == pol.FORWARD
            n_fus += best == pol.FUSED
        t = pol._step_seconds(costs, ntok, n_fwd, n_fus)
        new_theta = (R + gain) / t
        if abs(new_theta - theta) <= 1e-9 * max(theta, 1e-12):
            theta = new_theta
            break
        theta = new_theta
    return theta, list(kinds), list(lens), t, R + gain


def test_plan_search_matches_the_numpy_reference_on_random_batches():
    """The list-based plan search gives the numpy reference's kinds and lengths, and its
    throughput to rounding, on 300 random batches of 1-32 rows (random options, forced
    rows, costs) under every fixed-cost combination."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        R = int(rng.integers(1, 33))
        rows = []
        for _ in range(R):
            cums = {pol.NONE: np.zeros(0)}
            for kind, n in ((pol.NGRAM, 8), (pol.FORWARD, 4), (pol.FUSED, 3)):
                if rng.random() < 0.8:
                    cums[kind] = np.cumprod(rng.uniform(0.0, 1.0, int(rng.integers(1, n + 1))))
            forced = None
            if rng.random() < 0.1:
                forced = [k for k in cums if k != pol.NONE][0] if len(cums) > 1 else None
            rows.append(pol.RowOptions(cums, forced))
        a = float(rng.uniform(0.01, 0.2))
        costs = {"a": a, "g": a * rng.uniform(0, 0.2), "b": a * rng.uniform(0.01, 0.3),
                 "f0": a * rng.uniform(0.1, 1.0), "f1": a * rng.uniform(0, 0.3),
                 "h0": a * rng.uniform(0, 0.3), "h1": a * rng.uniform(0, 0.1)}
        for allowed in pol._COMBOS[1:]:
            got = pol._plan(pol._candidates(rows), allowed, costs)
            ref = _reference_plan(rows, allowed, costs)
            assert got[1] == ref[1] and got[2] == ref[2], trial
            assert got[0] == pytest.approx(ref[0], rel=1e-12) and got[4] == pytest.approx(ref[4], rel=1e-12)


def _random_batch(rng, forced_share=0.1, max_rows=32, low=0.0, lengths=(8, 4, 3)):
    """Random rows (options with cumulative acceptances, conditional acceptance drawn
    from [low, 1), empty chains included, some rows forced) and random costs (``g``,
    ``f0``, ``h0`` sometimes 0)."""
    R = int(rng.integers(1, max_rows + 1))
    rows = []
    for _ in range(R):
        cums = {pol.NONE: np.zeros(0)}
        for kind, n in zip((pol.NGRAM, pol.FORWARD, pol.FUSED), lengths):
            if rng.random() < 0.8:
                cums[kind] = np.cumprod(rng.uniform(low, 1.0, int(rng.integers(0, n + 1))))
        forced = None
        if rng.random() < forced_share:
            forced = [k for k in cums if k != pol.NONE][0] if len(cums) > 1 else None
        rows.append(pol.RowOptions(cums, forced))
    a = float(rng.uniform(0.01, 0.2))

    def maybe_zero(x):
        return 0.0 if rng.random() < 0.2 else x

    costs = {"a": a, "g": maybe_zero(a * rng.uniform(0, 0.4)), "b": a * rng.uniform(0.01, 0.5),
             "f0": maybe_zero(a * rng.uniform(0.1, 1.0)), "f1": a * rng.uniform(0, 0.3),
             "h0": maybe_zero(a * rng.uniform(0, 0.3)), "h1": a * rng.uniform(0, 0.1)}
    if rng.random() < 0.5:            # a request's first draft priced apart, cheaper or dearer
        costs["b1"] = maybe_zero(a * rng.uniform(0.0, 0.5))
    return rows, costs


def test_plain_shortcut_never_changes_the_decision(monkeypatch):
    """On 600 random batches ``decide`` (which returns plain decoding without planning
    when ``_no_plan_beats``) chooses what planning every combination chooses (``decide``
    with the shortcut switched off), and the batches include both outcomes: steps the
    shortcut settled and steps that drafted (else this test would test nothing)."""
    rng = np.random.default_rng(1)
    calls = {"n": 0}
    real_plan, real_shortcut = pol._plan, pol._no_plan_beats

    def counting(*a, **k):
        calls["n"] += 1
        return real_plan(*a, **k)

    def reference(rows, costs, min_gain):
        monkeypatch.setattr(pol, "_no_plan_beats", lambda *a: False)
        try:
            d = pol.decide(rows, costs, min_gain)
        finally:
            monkeypatch.setattr(pol, "_no_plan_beats", real_shortcut)
        return d.kinds, d.lengths

    monkeypatch.setattr(pol, "_plan", counting)
    pruned = drafted = 0
    for trial in range(600):
        rows, costs = _random_batch(rng, forced_share=0.1 if trial % 3 == 0 else 0.0,
                                    low=float(rng.choice([0.0, 0.3, 0.6, 0.8])))
        min_gain = float(rng.choice([-0.1, 0.0, pol.MIN_GAIN, 0.2]))
        expected = reference(rows, costs, min_gain)
        calls["n"] = 0
        d = pol.decide(rows, costs, min_gain)
        assert (d.kinds, d.lengths) == expected, trial
        pruned += calls["n"] == 0
        drafted += any(d.lengths)
    assert pruned >= 100 and drafted >= 100, (pruned, drafted)


def _best_drafting_value(rows, costs, theta0):
    """Brute force: the largest ``R + gain - θ0·T`` over every plan that drafts (each row
    takes nothing or one option with a prefix of 1.. of its drafts)."""
    from itertools import product

    choices = []
    for r in rows:
        ch = [(pol.NONE, 0)]
        for kind, cum in r.cums.items():
            if kind != pol.NONE:
                ch += [(kind, k) for k in range(1, len(cum) + 1)]
        choices.append(ch)
    best = -np.inf
    for plan in product(*choices):
        D = sum(k for _kind, k in plan)
        if D == 0:
            continue
        gain = sum(float(np.sum(r.cums[kind][:k])) for r, (kind, k) in zip(rows, plan) if k)
        t = pol._step_seconds(costs, D, sum(kind == pol.FORWARD for kind, _ in plan),
                              sum(kind == pol.FUSED for kind, _ in plan),
                              drafting_rows=sum(k > 0 for _kind, k in plan))
        best = max(best, len(rows) + gain - theta0 * t)
    return best


def test_plain_shortcut_is_sound_and_tight_against_brute_force():
    """On 300 random batches of 1-3 rows, against every drafting plan enumerated: when
    ``_no_plan_beats`` says no plan beats θ0, none does; and when every plan falls
    short of θ0 (and so does a step that verifies nothing but pays ``g``), it says so."""
    rng = np.random.default_rng(2)
    fired = 0
    for trial in range(300):
        rows, costs = _random_batch(rng, forced_share=0.0, max_rows=3,
                                    low=float(rng.choice([0.0, 0.5, 0.8])), lengths=(5, 4, 3))
        theta0 = (1 + float(rng.choice([0.0, pol.MIN_GAIN, 0.2]))) * len(rows) / costs["a"]
        best = _best_drafting_value(rows, costs, theta0)
        says = pol._no_plan_beats(pol._candidates(rows), costs, theta0)
        fired += says
        if says:
            assert best <= 0, trial
        empty = len(rows) - theta0 * (costs["a"] + costs["g"])
        if best < -1e-6 and empty < -1e-6:
            assert says, trial
    assert 50 <= fired <= 250, fired
    forced = [pol.RowOptions({pol.NGRAM: np.array([0.01])}, forced=pol.NGRAM)]
    assert not pol._no_plan_beats(pol._candidates(forced), costs, 1e9)


def test_plain_shortcut_edge_cases():
    """Two cases near the shortcut's boundary: (1) neither an n-gram-only nor a
    forward-only plan pays for ``g`` but one row of each together does, so the shortcut
    must not fire (each row adds the better of its options); (2) a plan that beats plain
    decoding by one part in a million must be planned, not cut short."""
    c = {"a": 1.0, "g": 1.5, "b": 0.01, "f0": 0.0, "f1": 0.0, "h0": 0.0, "h1": 0.0}
    rows = [row(ngram=[0.9, 0.81, 0.729], none=[]), row(forward=[0.9, 0.81, 0.729], none=[])]
    for one in rows:
        assert pol._no_plan_beats(pol._candidates([one, row(none=[])]), c, 2.0)
    assert not pol._no_plan_beats(pol._candidates(rows), c, 2.0)
    d = pol.decide(rows, c, min_gain=0.0)
    assert d.kinds == ["ngram", "forward"] and d.lengths == [3, 3]
    # (1 + x) / (a + g + b) = (1 + 1e-6) / a: drafting one token beats plain by 1e-6 (relative)
    c = {"a": 1.0, "g": 0.01, "b": 0.1, "f0": 0.0, "f1": 0.0, "h0": 0.0, "h1": 0.0}
    x = (1 + 1e-6) * 1.11 - 1
    assert not pol._no_plan_beats(pol._candidates([row(ngram=[x], none=[])]), c, 1.0)
    assert pol.decide([row(ngram=[x], none=[])], c, min_gain=0.0).lengths == [1]
    y = (1 - 1e-6) * 1.11 - 1
    assert pol._no_plan_beats(pol._candidates([row(ngram=[y], none=[])]), c, 1.0)
    assert pol.decide([row(ngram=[y], none=[])], c, min_gain=0.0).lengths == [0]


def test_a_view_selecting_draft_forward_is_not_observed_as_the_forwards_cost():
    from vllm_tokenswift.core.step import Drafts, StepCosts

    sel = StepCosts.of_drafting(Drafts(forward=(0.100, 1), fused=(0.002, 1), forward_selected=True))
    assert sel.forward is None and sel.fused == (0.002, 1) and sel.step is None
    clean = StepCosts.of_drafting(Drafts(forward=(0.009, 1)))
    assert clean.forward == (0.009, 1) and clean.fused is None
    cm = pol.CostModel()
    for _ in range(16):
        cm.observe_step(0.042, rows=1, draft_tokens=0)
    for costs in (sel, clean):           # as AdaptivePolicy.account books them
        if costs.forward is not None:
            cm.observe_forward(*costs.forward)
    c = cm.costs()
    # only the 9 ms forward was observed (with the 100 ms one it would sit near 0.9a)
    assert c["f0"] + c["f1"] < 0.6 * c["a"]


# ============================================================== a request's first draft apart
def _roofline_steps(cm, a=0.0805, per_later=0.0089, ds=(0, 3, 0, 5, 8, 0, 4, 6), rows=1, reps=8):
    """Steps whose verification costs nothing for a request's first draft and ``per_later``
    for each later one (the demo model at a 96K-token context: verifying q = 2 query tokens
    is bound by reading the KV cache, as q = 1 is; more are bound by arithmetic)."""
    for _ in range(reps):
        for d in ds:
            cm.observe_step(a + per_later * max(0, d - 1), rows=rows, draft_tokens=d)


def test_the_first_draft_is_priced_apart_from_the_later_ones():
    """Observed only on n-gram chains of 3-8 drafts (what the policy verifies at long
    context before it takes any one-token chain), a cost that is flat up to one draft and
    then 8.9 ms per draft is fitted as ``g + b1`` ~ 0 and ``b`` ~ 8.9 ms. With the
    estimates of the 96K run that missed it (a plain step 80.5 ms, a chain forward 13.9
    ms, the chain's first token accepted 0.33) the decision then takes a one-token
    self-speculative chain (predicted 1.12x plain decoding's throughput; ``triforce-1``
    measured 1.21x), which it did not with the first draft priced as the later ones
    (``b`` = 8.9 ms for it too: 1.035x, under the 5% margin)."""
    cm = pol.CostModel()
    _roofline_steps(cm)
    c = cm.costs()
    assert c["a"] == pytest.approx(0.0805, rel=0.02)
    assert c["b"] == pytest.approx(0.0089, rel=0.05)
    assert c["g"] + c["b1"] < 0.0015, c
    c.update(c0=0.0139, c1=0.0)
    rows = [pol.RowOptions({pol.NONE: np.zeros(0), pol.CHAIN: np.array([0.33, 0.11, 0.04])})]
    d = pol.decide(rows, c)
    assert d.kinds == [pol.CHAIN] and d.lengths == [1]
    assert d.throughput == pytest.approx(1.33 / (c["a"] + c["g"] + c["b1"] + 0.0139), rel=1e-9)
    assert d.threshold_first < d.threshold
    one_price = dict(c, b1=c["b"], g=0.0)       # the first draft priced as the later ones
    assert pol.decide(rows, one_price).kinds == [pol.NONE]


def test_the_first_draft_and_the_fixed_price_are_told_apart_across_batch_sizes():
    """With several requests per step, ``g`` (once per step that verifies any draft),
    ``b1`` (per request verifying any) and ``b`` (per later draft) are separate columns:
    steps of 1-4 rows recover each. Inconsistent counts are refused."""
    a, g, b1, b = 0.2, 0.012, 0.002, 0.008
    cm = pol.CostModel(window=64)
    rng = np.random.default_rng(3)
    for _ in range(64):
        rows = int(rng.integers(1, 5))
        f = int(rng.integers(0, rows + 1))
        e = int(rng.integers(0, 4 * f + 1)) if f else 0
        cm.observe_step(a + (g if f else 0.0) + b1 * f + b * e, rows=rows, draft_tokens=f + e, drafting_rows=f)
    c = cm.costs()
    assert c["a"] == pytest.approx(a, rel=0.01)
    assert c["g"] == pytest.approx(g, rel=0.1) and c["b1"] == pytest.approx(b1, abs=0.001)
    assert c["b"] == pytest.approx(b, rel=0.1)
    for bad in ((2, 3, 3), (2, 3, 0), (2, 0, 1), (1, 1, 2)):
        with pytest.raises(ValueError, match="drafting rows"):
            cm.observe_step(0.1, rows=bad[0], draft_tokens=bad[1], drafting_rows=bad[2])


def test_step_seconds_and_the_cut_price_the_first_draft_of_every_row():
    """``T`` charges ``b1`` once per drafting row and ``b`` for its later drafts; the cut
    keeps a first token above ``threshold_first`` that ``threshold`` would cut; a plan
    whose first drafts cost more than the later ones still takes a prefix whose
    followers pay for it (the best prefix, not the first term below its cut)."""
    c = {"a": 1.0, "g": 0.1, "b": 0.05, "b1": 0.01, "f0": 0.0, "f1": 0.0, "h0": 0.0, "h1": 0.0}
    assert pol._step_seconds(c, 5, 0, 0, drafting_rows=2) == pytest.approx(1.0 + 0.1 + 2 * 0.01 + 3 * 0.05)
    without_b1 = {k: v for k, v in c.items() if k != "b1"}
    assert pol._step_seconds(without_b1, 5, 0, 0, drafting_rows=2) == pytest.approx(1.0 + 0.1 + 5 * 0.05)
    assert pol.cut_length([0.3, 0.2], 0.35) == 0
    assert pol.cut_length([0.3, 0.2], 0.35, first=0.25) == 1
    assert pol.cut_length([0.3, 0.29], 0.25, first=0.35) == 0
    dear = {"a": 1.0, "g": 0.0, "b": 0.1, "b1": 0.9, "f0": 0.0, "f1": 0.0, "h0": 0.0, "h1": 0.0}
    rows = [pol.RowOptions({pol.NONE: np.zeros(0), pol.NGRAM: np.array([0.99, 0.98, 0.97, 0.96, 0.95])})]
    d = pol.decide(rows, dear, min_gain=0.0)
    # theta: 1 token / 1.0 s plain; 5 drafts: (1 + 4.85) / (1 + 0.9 + 0.4) = 2.54 tokens/s
    assert d.kinds == [pol.NGRAM] and d.lengths == [5]
    assert d.throughput == pytest.approx(5.85 / 2.3)
    assert pol._best_prefix([0.99, 0.98], 1.5, 0.1) == (2, pytest.approx(0.99 + 0.98 - 1.6))
    assert pol._best_prefix([0.99], 1.5, 0.1) == (0, 0.0)
