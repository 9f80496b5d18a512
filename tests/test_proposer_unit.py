"""Engine-free unit tests of the proposer's parts: per-request seeded draft draws, the
incremental penalty history, the draft-probability buffer (``drafting``), the drafting
policy's accounting, exploration and cut (``drafting_policy``), request state
(``request_state``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_tokenswift.config import PolicyTuning, TokenSwiftConfig
from vllm_tokenswift.drafting import Drafter, draw, penalty_mask, row_ngram_chain
from vllm_tokenswift.drafting_policy import DraftingPolicy, StepPlan, Verified
from vllm_tokenswift.request_state import Row as _Row
from vllm_tokenswift.request_state import new_request_state


class _Parts:
    """The proposer's engine-free parts for one engine: its settings, drafting policy and
    step counter, and the request states it would make."""

    def __init__(self, engine_seed=0, **cfg):
        self.cfg = TokenSwiftConfig.parse({"use_heads": False, "ngram_topk": 0, **cfg})
        self.engine_seed = engine_seed
        self.policy = DraftingPolicy(self.cfg, 4)
        self.step = 0          # engine steps so far (0: an aligned step for exploration tries)

    def new_state(self, runner, rid):
        sp = getattr(runner.requests.get(rid), "sampling_params", None)
        return new_request_state(rid, sp, ngram_n=self.cfg.ngram_n, use_ngrams=self.cfg.ngram_topk > 0,
                                 explore_every=self.cfg.policy_tuning.explore_every, engine_seed=self.engine_seed)

    def forced(self, r, has_fused=False):
        return self.policy.row_options(r, self.step, has_fused).forced

    def options(self, r, has_fused=False):
        return self.policy.row_options(r, self.step, has_fused)

    def account(self, st, k, a, tokens=None):
        self.policy.account([Verified(st, k, a, tokens)])

    def plan(self, r, threshold, kind="ngram"):
        """A one-row plan with this cut threshold."""
        return StepPlan(self.policy, [r], [kind], threshold, [self.options(r)], None)


def _proposer(engine_seed=0, **cfg):
    return _Parts(engine_seed, **cfg)


def _runner(**reqs):
    return SimpleNamespace(requests={rid: SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=1.0, min_p=0.0, repetition_penalty=1.0, extra_args=None, seed=seed))
        for rid, seed in reqs.items()})


def test_seeded_draws_reproduce_per_request_and_across_ranks():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = _proposer()
    b = _proposer()  # another tensor-parallel rank, or another run
    sa = a.new_state(_runner(r1=1234), "r1")
    # the same request seed gives the same draws, whatever else the other rank drew before
    b_other = b.new_state(_runner(x=None), "x")
    draw(b_other, probs)
    sb = b.new_state(_runner(r1=1234), "r1")
    assert draw(sa, probs) == draw(sb, probs)
    assert draw(sa, probs) == draw(sb, probs)  # and the streams stay in step
    # another seed: another stream
    sc = a.new_state(_runner(r1=99), "r1")
    draws = [draw(sc, probs) for _ in range(5)]
    sd = b.new_state(_runner(r1=1234), "r1")
    assert draws != [draw(sd, probs) for _ in range(5)]


def test_unseeded_requests_use_engine_seed_and_request_id():
    a, b = _proposer(engine_seed=7), _proposer(engine_seed=7)
    s1, s2 = a.new_state(_runner(q=None), "q"), b.new_state(_runner(q=None), "q")
    assert s1.seed == s2.seed  # identical on every rank (no Python hash salt)
    assert a.new_state(_runner(z=None), "z").seed != s1.seed
    assert _proposer(engine_seed=8).new_state(_runner(q=None), "q").seed != s1.seed


def test_incremental_penalty_history_matches_recount():
    prop = _proposer()
    V = 40
    rng = np.random.default_rng(0)
    toks = rng.integers(0, V, size=(1, 300)).astype(np.int32)
    st = prop.new_state(_runner(r=None), "r")
    st.window = 16
    for pos in [20, 21, 25, 60, 61, 200, 299]:
        row = _Row(0, "r", st, pos, 4, [])
        got = penalty_mask(row.state, toks[0], row.pos, V, "cpu")
        want = torch.zeros(V, dtype=torch.bool)
        want[torch.as_tensor(toks[0, max(0, pos + 1 - 16): pos + 1].astype(np.int64))] = True
        assert torch.equal(got, want), pos
    st2 = prop.new_state(_runner(r=None), "r")  # global penalty (no window): all tokens so far
    for pos in [10, 50, 51, 299]:
        got = penalty_mask(st2, toks[0], pos, V, "cpu")
        want = torch.zeros(V, dtype=torch.bool)
        want[torch.as_tensor(toks[0, : pos + 1].astype(np.int64))] = True
        assert torch.equal(got, want), pos


def test_draft_probs_buffer_rows_and_positions():
    prop = _proposer()
    V = 6
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]])
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", "c"]), device="cpu")
    rows = [_Row(0, "a", None, 0, 4, []), _Row(2, "c", None, 0, 4, [])]
    out = [[1, 2, 5], [], [3]]
    drafter = Drafter(prop.cfg, None, None, None, V, 4)
    drafter.set_draft_probs(runner, rows, out, {0: (q, [0, 1])})
    dp = runner._draft_probs
    assert dp.shape == (3, 4, V) and runner._draft_prob_req_ids == ["a", "b", "c"]
    torch.testing.assert_close(dp[0, :2], q)                              # sampled positions: q
    assert dp[0, 2].tolist() == [0, 0, 0, 0, 0, 1.0]                     # n-gram position: one-hot
    assert dp[2, 0].tolist() == [0, 0, 0, 1.0, 0, 0]                     # greedy row: one-hot
    # next step: stale values of other positions are never read by vLLM, rows rewritten
    drafter.set_draft_probs(runner, rows, [[4], [], [0]], {})
    assert runner._draft_probs[0, 0].tolist() == [0, 0, 0, 0, 1.0, 0]


def test_tp_broadcast_from_rank0_is_float32_only_and_exact_enough(monkeypatch):
    """vLLM's CPU all-gather has no float64 kernel: the broadcast sends float32 hi/lo pairs
    and every rank rebuilds rank 0's values (to ~1e-14 relative)."""
    import numpy as np
    import torch

    from vllm_tokenswift import draft_forward

    sent = []

    def fake_gather(t):
        assert t.dtype == torch.float32 and t.dim() == 1
        sent.append(t)
        return torch.stack([t, t + 1.0])   # rank 1 holds other values; row 0 wins

    monkeypatch.setattr(draft_forward, "tp_all_gather", fake_gather)
    x = np.array([0.1, 12.345678901234, 1e-7, 3.0e5 + 1 / 3, 0.0])
    got = draft_forward.tp_broadcast_from_rank0(x)
    assert got.dtype == np.float64 and got.shape == (5,)
    np.testing.assert_allclose(got, x, rtol=1e-13, atol=0)
    assert sent[0].numel() == 10


def test_inverse_cdf_draws_follow_q_and_never_take_zero_mass_tokens():
    """Chi-square goodness of fit of 20,000 draws per depth against q (two depths with
    different q, zero-probability tokens included), and the fallback for a row without
    positive mass."""
    from scipy.stats import chisquare

    q = torch.zeros(2, 12)
    q[0, :6] = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q[1, 5:] = torch.softmax(torch.arange(7, dtype=torch.float32) / 3, -1)
    prop = _proposer()
    st = prop.new_state(_runner(r=5), "r")
    draws = np.array([draw(st, q) for _ in range(20000)])     # [N, 2]
    for d in range(2):
        counts = np.bincount(draws[:, d], minlength=12)
        support = q[d].numpy() > 0
        assert counts[~support].sum() == 0
        exp = q[d].numpy()[support].astype(np.float64)
        _, p = chisquare(counts[support], exp / exp.sum() * counts.sum())
        assert p > 1e-3, (d, counts)
    bad = torch.zeros(1, 12)
    try:
        draw(st, bad)
    except RuntimeError:
        pass   # torch.multinomial's own error for a row without mass
    else:
        raise AssertionError("a row without probability mass must not be drawn from")


def test_exploration_backs_off_while_forced_tries_are_not_taken_up():
    """The adaptive policy forces a try of the draft forward every ``explore_gap`` steps of
    a request; each forced try doubles the gap (up to ``policy_tuning.explore_max``), a
    voluntary choice resets it."""
    from vllm_tokenswift import policy as pol
    EXPLORE_EVERY, EXPLORE_MAX = PolicyTuning().explore_every, PolicyTuning().explore_max
    prop = _proposer(policy="adaptive")
    st = prop.new_state(_runner(r=1), "r")
    r = _Row(0, "r", st, pos=10, room=4, context=[1, 2])

    def forced_at(step):
        st.steps = step
        return prop.forced(r)

    assert st.explore_gap == EXPLORE_EVERY
    assert forced_at(EXPLORE_EVERY - 1) is None and forced_at(EXPLORE_EVERY) == pol.FORWARD
    gaps = []
    tried = 0
    for _ in range(8):   # forced tries, never chosen voluntarily
        step = tried + st.explore_gap
        assert forced_at(step - 1) is None and forced_at(step) == pol.FORWARD
        st.took(pol.FORWARD, forced=True, tuning=PolicyTuning())
        tried = step
        gaps.append(st.explore_gap)
    assert gaps == [96, 192, 384, 768, 768, 768, 768, 768] and EXPLORE_MAX == 768
    st.took(pol.NGRAM, forced=False, tuning=PolicyTuning())          # other options leave the gap alone
    assert st.explore_gap == EXPLORE_MAX
    st.took(pol.FORWARD, forced=False, tuning=PolicyTuning())        # chosen on its own: back to the short gap
    assert st.explore_gap == EXPLORE_EVERY
    assert forced_at(st.steps + EXPLORE_EVERY) == pol.FORWARD


def test_exploration_waits_while_full_chains_are_accepted():
    """A forced try of the draft forward is deferred while the request's last chain was
    full length (num_speculative_tokens) and wholly accepted, and happens at the first
    step after a chain that was not."""
    from vllm_tokenswift import policy as pol
    EXPLORE_EVERY = PolicyTuning().explore_every

    prop = _proposer(policy="adaptive")
    prop.policy.calibration = pol.Calibration(positions=4)
    st = prop.new_state(_runner(r=1), "r")
    r = _Row(0, "r", st, pos=10, room=4, context=[1, 2])
    st.steps = EXPLORE_EVERY
    prop.account(st, 4, 4)            # 4 of 4 accepted: the chain could not have been longer
    assert st.all_accepted and prop.forced(r) is None
    prop.account(st, 3, 3)            # shorter than num_speculative_tokens
    assert not st.all_accepted and prop.forced(r) == pol.FORWARD
    prop.account(st, 4, 4)
    assert prop.forced(r) is None
    prop.account(st, 4, 2)            # a rejection
    assert prop.forced(r) == pol.FORWARD


def test_exploration_waits_while_the_ngram_chain_yields_more_than_a_try_could():
    """A due forced try is skipped while the request's n-gram chain is expected to yield at
    least the tried option's own positions (4 for the draft forward at room 4), taken when
    it is expected to yield less, always taken with ``explore_beside_ngram``, and never
    forced with ``explore_every=0``; the tuning's gaps set the request's first gap."""
    from vllm_tokenswift import policy as pol
    from vllm_tokenswift.chain import SOURCE_NGRAM, Chain

    def forced(tuning, conf):
        # heads on: the draft forward's own positions are l_0..l_3, 4 at room 4
        prop = _proposer(policy="adaptive", use_heads=True, heads="/h", policy_tuning=tuning)
        prop.policy.calibration = pol.Calibration(positions=4, prior_weight=1e9)  # prob = bin centre
        st = prop.new_state(_runner(r=1), "r")
        st.temperature = 0.0
        st.steps = st.explore_gap
        r = _Row(0, "r", st, pos=10, room=4, context=[1, 2])
        r.ngram = Chain([5, 6, 7, 8, 9, 10], [SOURCE_NGRAM] * 6, 0.0, confs=[conf] * 6)
        opts = prop.options(r)
        return st.explore_gap, float(np.sum(opts.cums[pol.NGRAM])), opts.forced

    gap, ngram_yield, f = forced({}, 0.99)          # 6 tokens at 0.95 each: 4.35 expected
    assert gap == 48 and ngram_yield == pytest.approx(sum(0.95 ** j for j in range(1, 7)))
    assert ngram_yield >= 4 and f is None
    gap, ngram_yield, f = forced({}, 0.75)          # 0.75 each: 2.47 expected < 4
    assert ngram_yield < 4 and f == pol.FORWARD
    assert forced({"explore_beside_ngram": True}, 0.99)[2] == pol.FORWARD
    assert forced({"explore_every": 0, "explore_max": 10}, 0.75)[2] is None
    assert forced({"explore_every": 10, "explore_max": 10}, 0.75)[:1] == (10,)


def test_greedy_acceptance_does_not_calibrate_sampled_chains():
    """N-gram chains verified for a greedy request (accepted when they are the target's
    argmax) leave the calibration of a sampled request's chains (accepted with the
    target's probability) at its prior, and raise the greedy one."""
    from vllm_tokenswift import policy as pol
    from vllm_tokenswift.chain import SOURCE_NGRAM, Chain
    from vllm_tokenswift.request_state import Proposal as _Proposal

    prop = _proposer(policy="adaptive")
    prop.policy.calibration = pol.Calibration(positions=4)
    greedy = prop.new_state(SimpleNamespace(requests={"g": SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=0.0, min_p=0.0, repetition_penalty=1.0, extra_args=None, seed=None))}), "g")
    assert not greedy.sampled
    chain = Chain([5, 6, 7, 8], [SOURCE_NGRAM] * 4, 0.0, [0.55] * 4)
    prior = prop.policy.calibrated_cum(chain, sampled=True).copy()
    for _ in range(50):
        greedy.last = _Proposal(pol.NGRAM, list(chain.sources), list(chain.confs))
        prop.account(greedy, 4, 4)
    np.testing.assert_allclose(prop.policy.calibrated_cum(chain, sampled=True), prior)
    assert prop.policy.calibrated_cum(chain, sampled=False)[-1] > prior[-1] + 0.3


def test_a_draft_forward_whose_chain_was_cut_away_is_booked():
    """The draft forward ran but the cut left no draft: the request's forward estimate
    books position 0 as reached and not accepted (the forward realised nothing), and a
    chain cut to one accepted token books position 1 so."""
    from vllm_tokenswift import policy as pol
    from vllm_tokenswift.request_state import Proposal as _Proposal

    prop = _proposer(policy="adaptive")
    prop.policy.calibration = pol.Calibration(positions=4)
    st = prop.new_state(_runner(r=1), "r")
    fwd = prop.policy.estimates_of(st)[pol.FORWARD]
    st.last = _Proposal(pol.FORWARD, [], [], span=4)
    prop.account(st, 0, 0)
    assert fwd.reached[0] == pytest.approx(1.0) and fwd.accepted[0] == 0.0
    st.last = _Proposal(pol.FORWARD, [0], [0.9], span=4)
    prop.account(st, 1, 1)
    assert fwd.reached[1] > 0.9 and fwd.accepted[1] == 0.0 and fwd.accepted[0] > 0.9


def test_due_exploration_tries_wait_for_an_aligned_engine_step():
    """A request whose forced try is due takes it only on an engine step that is a
    multiple of EXPLORE_ALIGN, so requests that fell due at different steps of a batch
    try together (one draft forward for all of them)."""
    from vllm_tokenswift import policy as pol
    from vllm_tokenswift.drafting_policy import EXPLORE_ALIGN

    EXPLORE_EVERY = PolicyTuning().explore_every
    prop = _proposer(policy="adaptive")
    runner = _runner(r=2)
    a, b = prop.new_state(runner, "a"), prop.new_state(runner, "b")
    ra = _Row(0, "a", a, pos=10, room=4, context=[1, 2])
    rb = _Row(1, "b", b, pos=10, room=4, context=[1, 2])
    a.steps, b.steps = EXPLORE_EVERY + 3, EXPLORE_EVERY     # both due, "a" for 3 steps already
    forced = {}
    for step in range(1, 2 * EXPLORE_ALIGN + 1):
        prop.step = step
        forced[step] = (prop.forced(ra),
                        prop.forced(rb))
    tried = [s for s, f in forced.items() if f != (None, None)]
    assert tried == [EXPLORE_ALIGN, 2 * EXPLORE_ALIGN]
    assert forced[EXPLORE_ALIGN] == (pol.FORWARD, pol.FORWARD)


def test_a_choice_made_alongside_a_forced_try_backs_off_like_a_try():
    """A request that takes the draft forward on a step where another request was forced
    to try it (its fixed cost paid anyway) doubles its exploration gap like a forced try;
    only a choice made with nobody forced resets the gap."""
    from vllm_tokenswift import policy as pol
    EXPLORE_EVERY = PolicyTuning().explore_every

    prop = _proposer(policy="adaptive")
    st = prop.new_state(_runner(r=1), "r")
    st.took(pol.FORWARD, forced=False, alongside_forced=True, tuning=PolicyTuning())
    assert st.explore_gap == 2 * EXPLORE_EVERY
    st.took(pol.FUSED, forced=False, alongside_forced=True, tuning=PolicyTuning())
    assert st.explore_gap == 4 * EXPLORE_EVERY
    st.took(pol.NGRAM, forced=False, alongside_forced=True, tuning=PolicyTuning())      # no fixed cost: gap unchanged
    assert st.explore_gap == 4 * EXPLORE_EVERY
    st.took(pol.FORWARD, forced=False, tuning=PolicyTuning())
    assert st.explore_gap == EXPLORE_EVERY


def test_the_token_past_the_cut_is_observed_when_the_output_tells_it():
    """The plan's cut keeps the chain's first token past the cut; the hand-over books it (with the
    request's calibration key) for a greedy request whatever its source, and for a
    sampled one only an n-gram token (a point mass); a row that drafted nothing
    offers its n-gram chain's first token. _account observes it iff every draft proposed
    was verified and accepted: accepted iff the bonus token equals it."""
    from vllm_tokenswift import policy as pol
    from vllm_tokenswift.chain import SOURCE_FUSED, SOURCE_NGRAM, Chain
    from vllm_tokenswift.request_state import Proposal as _Proposal

    prop = _proposer(policy="adaptive")
    prop.policy.calibration = pol.Calibration(positions=4, decay=1.0)
    greedy = prop.new_state(SimpleNamespace(requests={"g": SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=0.0, min_p=0.0, repetition_penalty=1.0, extra_args=None, seed=None))}), "g")
    sampled = prop.new_state(_runner(s=1), "s")
    conf = [0.95, 0.95, 0.55, 0.95]

    def row(st, chain=None, room=4):
        r = _Row(0, "x", st, pos=10, room=room, context=[1, 2])
        r.ngram = chain
        return r

    def cut(ch, r, threshold, cum=None):        # the plan's cut, as the drafting applies it
        return prop.plan(r, threshold).cut(ch, r, cum)

    def observable_past_cut(r, kind):           # the proposal the hand-over records
        return prop.plan(r, -1.0).proposal(r, kind, [], [], 0).next

    cum = np.asarray([0.9, 0.8, 0.2, 0.1])      # cut at 2 by threshold 0.5
    r = row(greedy)
    ch = cut(Chain([5, 6, 7, 8], [SOURCE_FUSED] * 4, 0.0, list(conf)), r, 0.5, cum)
    assert ch.tokens == [5, 6] and r.past_cut == (7, SOURCE_FUSED, 0.55)
    assert observable_past_cut(r, pol.FUSED) == (7, SOURCE_FUSED, 0.55)
    r2 = row(sampled)
    cut(Chain([5, 6, 7, 8], [SOURCE_FUSED] * 4, 0.0, list(conf)), r2, 0.5, cum)
    assert observable_past_cut(r2, pol.FUSED) is None          # drawn from q
    r2 = row(sampled)                                                  # drawn, then an n-gram extension
    cut(Chain([5, 6, 7, 8], [SOURCE_FUSED] * 2 + [SOURCE_NGRAM] * 2, 0.0, list(conf)), r2, 0.5, cum)
    assert observable_past_cut(r2, pol.FUSED) == (7, SOURCE_NGRAM + 10, 0.55)
    r3 = row(sampled, Chain([5, 6, 7, 8], [SOURCE_NGRAM] * 4, 0.0, list(conf)))
    cut(r3.ngram, r3, 0.5, cum)
    assert observable_past_cut(r3, pol.NGRAM) == (7, SOURCE_NGRAM + 10, 0.55)
    r4 = row(greedy, Chain([5, 6], [SOURCE_NGRAM] * 2, 0.0, [0.95, 0.95]))
    cut(r4.ngram, r4, -1.0)                                      # kept whole: nothing past it
    assert r4.past_cut is None and observable_past_cut(r4, pol.NGRAM) is None
    r5 = row(greedy, Chain([9, 6], [SOURCE_NGRAM] * 2, 0.0, [0.35, 0.95]))   # the decision was "none"
    assert observable_past_cut(r5, pol.NONE) == (9, SOURCE_NGRAM, 0.35)
    r6 = row(greedy, Chain([5, 6, 7], [SOURCE_NGRAM] * 3, 0.0, [0.95] * 3), room=2)
    cut(r6.ngram, r6, 0.0)                                       # cut by the room
    assert r6.past_cut == (7, SOURCE_NGRAM, 0.95)

    def booked(last, k, a, tokens):
        prop.policy.calibration.reached.clear()
        prop.policy.calibration.accepted.clear()
        greedy.last = last
        prop.account(greedy, k, a, tokens)
        return dict(prop.policy.calibration.reached), dict(prop.policy.calibration.accepted)

    two = _Proposal(pol.NGRAM, [SOURCE_NGRAM] * 2, [0.95, 0.95], next=(7, SOURCE_NGRAM, 0.55))
    both = {(SOURCE_NGRAM, 0, 9): 1.0, (SOURCE_NGRAM, 1, 9): 1.0}
    assert booked(two, 2, 2, [5, 6, 7]) == ({**both, (SOURCE_NGRAM, 2, 5): 1.0}, {**both, (SOURCE_NGRAM, 2, 5): 1.0})
    assert booked(two, 2, 2, [5, 6, 4]) == ({**both, (SOURCE_NGRAM, 2, 5): 1.0}, {**both, (SOURCE_NGRAM, 2, 5): 0.0})
    reached, _ = booked(two, 2, 1, [5, 4])                       # a rejection: the output diverged
    assert (SOURCE_NGRAM, 2, 5) not in reached
    reached, _ = booked(two, 1, 1, [5, 7])                       # the scheduler verified fewer
    assert (SOURCE_NGRAM, 2, 5) not in reached and (SOURCE_NGRAM, 1, 5) not in reached
    none = _Proposal(pol.NONE, [], [], next=(9, SOURCE_NGRAM, 0.35))
    assert booked(none, 0, 0, [9]) == ({(SOURCE_NGRAM, 0, 3): 1.0}, {(SOURCE_NGRAM, 0, 3): 1.0})
    assert booked(_Proposal(pol.NONE, [], []), 0, 0, [9]) == ({}, {})
    assert booked(two, 2, 2, None)[0] == both                      # no tokens given: as before
    prop.policy.cfg = prop.cfg.model_copy(update={"policy_tuning": PolicyTuning(observe_past_cut=False)})
    assert booked(two, 2, 2, [5, 6, 7]) == (both, both)            # the setting off: verified tokens only
    assert booked(none, 0, 0, [9]) == ({}, {})


def test_the_rows_ngram_chain_scores_a_context_seen_once_with_the_escape_count():
    """The proposer's n-gram chains (the ``ngram`` option and the extension of sampled
    chains) score a 3-token context's most frequent continuation ``c / (t + 1)`` where
    ``policy_tuning.ngram_escape`` asks for it: by default (``"sampled"``) for sampled
    requests only, with ``true`` for greedy ones too, with ``false`` for none (``c / t``)."""
    from vllm_tokenswift.ngram import NGramTable

    def chain(temperature, **tuning):
        prop = _proposer(policy="adaptive", ngram_topk=20, policy_tuning=tuning)
        runner = _runner(r=1)
        runner.requests["r"].sampling_params.temperature = temperature
        st = prop.new_state(runner, "r")
        assert isinstance(st.ngrams, NGramTable) and st.sampled == (temperature > 0)
        # (1, 2, 3) seen once, followed by 4; (2, 3, 4) seen once, followed by 5;
        # (3, 4, 5) twice, followed by 6 both times
        st.ngrams.extend([1, 2, 3, 4, 5, 6, 9, 3, 4, 5, 6, 1, 2, 3])
        ch = row_ngram_chain(st, [9, 1, 2, 3], 3, prop.cfg.policy_tuning)
        assert ch.tokens == [4, 5, 6]
        return ch.confs

    escaped, plain = pytest.approx([1 / 2, 1 / 2, 2 / 3]), pytest.approx([1.0, 1.0, 1.0])
    assert chain(1.0) == escaped and chain(0.0) == plain               # default: "sampled"
    assert chain(1.0, ngram_escape=True) == escaped and chain(0.0, ngram_escape=True) == escaped
    assert chain(1.0, ngram_escape=False) == plain and chain(0.0, ngram_escape=False) == plain
