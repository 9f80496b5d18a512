"""The real proposer driven through whole engine steps without vLLM: constructed
:class:`StepInput` values, a fake target whose next-token rule is known, and the exact
drafts, draft distributions, counters and request states that come out. Then the parts:
seeded draft draws, the incremental penalty history, the draft-probability buffer, and the
adaptive policy's accounting, exploration and cut."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_tokenswift.core.chain import SOURCE_FUSED, SOURCE_HEADS, SOURCE_NGRAM, Chain, request_ngram_chain
from vllm_tokenswift.core.config import PolicyTuning, TokenSwiftConfig, TokenSwiftConfigError
from vllm_tokenswift.core.draft_sampling import DraftProbBuffer, draw, penalty_mask
from vllm_tokenswift.core.policy import DraftingPolicy, policy_class
from vllm_tokenswift.core.policy import decision as pol
from vllm_tokenswift.core.policy.adaptive import EXPLORE_ALIGN, AdaptivePolicy
from vllm_tokenswift.core.step import (FORWARD, FUSED, KINDS, NGRAM, NONE, Proposal, RequestStep, Row, StepInput,
                                       StepPlan, Verified)
from vllm_tokenswift.engine.proposer import TokenSwiftProposer

V = 32          # vocabulary of the fake target
BS = 16         # KV block size
K = 4           # num_speculative_tokens


def nxt(t: int) -> int:
    """The fake target's next token after ``t`` (its argmax)."""
    return (3 * t + 1) % V


class FakeTarget:
    """The target's drafting interface (``engine.target.TargetAccess``) over a model whose
    hidden state is the one-hot token and whose LM head puts logit 8 on :func:`nxt`; it
    records every draft forward and captures no queries (views fall back to recency)."""

    layer_names = ["model.layers.0.attn"]
    key_layout = None

    def __init__(self, hidden_for_fused: torch.Tensor | None = None):
        self.query_rows: dict[int, int] = {}
        self.forwards: list[dict] = []
        self.draft_prenorm = None
        self._verify_hidden = hidden_for_fused
        self.lm_head = torch.zeros(V, V)
        for t in range(V):
            self.lm_head[t, nxt(t)] = 8.0

    def draft_forward(self, runner, token_ids, positions, slots, tables, seq_lens, request_uids):
        self.forwards.append(dict(ids=list(token_ids), positions=list(positions), slots=list(slots),
                                  tables=[t.copy() for t in tables], seq_lens=list(seq_lens)))
        self.query_rows = {}
        return torch.nn.functional.one_hot(torch.as_tensor(token_ids), V).float()

    def logits(self, hidden):
        return hidden @ self.lm_head

    def importance(self, block_ids, q_row, num_groups):
        return None

    def verification_hidden(self, token_indices):
        h = self._verify_hidden
        return None if h is None else h.index_select(0, torch.as_tensor(token_indices))

    @property
    def has_verification_hidden(self) -> bool:
        return self._verify_hidden is not None

    def end_step(self) -> None:
        self._verify_hidden = None


def make_proposer(target=None, *, max_model_len=4096, engine_seed=0, **settings) -> TokenSwiftProposer:
    cfg = TokenSwiftConfig.parse({"use_heads": False, "ngram_topk": 0, "num_speculative_tokens": K,
                                  "kv_budget": 64, "sink_tokens": 16, "log_interval_s": 0, **settings})
    return TokenSwiftProposer.from_settings(cfg, num_spec_tokens=K, block_size=BS, max_model_len=max_model_len,
                                            vocab_size=V, target=target or FakeTarget(), engine_seed=engine_seed)


class Batch:
    """vLLM's persistent batch as the step input reads it: token ids and block tables per row."""

    def __init__(self, *prompts, max_len=512):
        self.tokens = np.zeros((len(prompts), max_len), dtype=np.int32)
        self.lens = []
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = p
            self.lens.append(len(p))
        self.blocks = np.arange(len(prompts) * (max_len // BS), dtype=np.int32).reshape(len(prompts), -1) + 100
        self.ids = [f"r{i}" for i in range(len(prompts))]

    def append(self, row: int, toks) -> None:
        n = self.lens[row]
        self.tokens[row, n: n + len(toks)] = toks
        self.lens[row] += len(toks)

    def step(self, rows: dict, sampling=None, num_scheduled=None) -> StepInput:
        """``rows``: batch row -> (tokens sampled, drafts verified); the sampled tokens are
        appended to the row first (as vLLM does before proposing)."""
        reqs = []
        for i, (sampled, k) in sorted(rows.items()):
            self.append(i, sampled)
            reqs.append(RequestStep(i, self.ids[i], list(sampled), k, self.lens[i] - 1,
                                    verify_index=-1, has_slot=True,
                                    sampling_params=(sampling or {}).get(i)))
        n_sched = num_scheduled if num_scheduled is not None else sum(1 + k for _, k in rows.values())
        return StepInput(reqs, list(self.ids), n_sched, self.tokens, self.blocks)


def greedy_params(**kw):
    return SimpleNamespace(temperature=0.0, min_p=0.0, repetition_penalty=1.0, extra_args=None, seed=None, **kw)


def sampled_params(seed=None, **kw):
    base = dict(temperature=1.0, min_p=0.0, repetition_penalty=1.0, extra_args=None)
    base.update(kw)
    return SimpleNamespace(seed=seed, **base)


# ============================================================== whole steps
def test_paper_policy_drafts_the_targets_argmax_and_books_the_verification():
    """Step 1 (the first token after the prompt): one draft forward for both requests, the
    newest token's real slot and position, the chain the fake target's argmax. Step 2: the
    verification of that chain is booked (one chain, one token verified, accepted), the
    tables extend, and the next chains follow the new newest tokens."""
    prop = make_proposer(policy="paper")
    b = Batch([1, 2, 3], [5, 6, 7, 8, 9])
    p1 = prop.propose_step(b.step({0: ([4], 0), 1: ([10], 0)}))
    assert p1.draft_token_ids == [[nxt(4)], [nxt(10)]] and p1.draft_probs is None
    (fwd,) = prop.target_access.forwards
    assert fwd["ids"] == [4, 10] and fwd["positions"] == [3, 5] and fwd["seq_lens"] == [4, 6]
    assert fwd["slots"] == [100 * BS + 3, b.blocks[1, 0] * BS + 5]
    assert [st.last.kind for st in prop.states.values()] == [FORWARD, FORWARD]
    assert prop.stats.steps_by_kind[FORWARD] == 2 and prop.stats.draft_tokens == 2
    # request 0 accepted its draft (sampled: the draft, then the bonus); request 1 rejected it
    p2 = prop.propose_step(b.step({0: ([nxt(4), 7], 1), 1: ([11], 1)}))
    assert p2.draft_token_ids == [[nxt(7)], [nxt(11)]]
    s = prop.stats
    assert (s.verified_drafts, s.verified_tokens, s.accepted_tokens, s.accepted_heads) == (2, 2, 1, 1)
    assert s.accepted_per_pos == [1] and s.draft_steps == 2
    assert prop.states["r0"].steps == 2 and prop.states["r0"].last.step == 2
    assert prop.tokenswift_stats()["num_live_requests"] == 2


def test_each_option_of_a_scripted_policy_reaches_vllm_as_planned():
    """A drafting strategy of one's own (named by class path, as a user would) gives one
    request each option; the proposer hands over the n-gram chain of a looping text, the
    draft forward's chain, nothing for ``none``, and books each as the policy's kind."""
    prop = make_proposer(policy=f"{__name__}:ScriptedPolicy", ngram_topk=20)
    assert type(prop.policy) is ScriptedPolicy
    loop = [1, 2, 3, 4, 5] * 6
    b = Batch(loop, [11, 13, 17, 19, 23, 29], loop)
    prop.policy.kinds = {"r0": NGRAM, "r1": FORWARD, "r2": NONE}
    out = prop.propose_step(b.step({0: ([1], 0), 1: ([1], 0), 2: ([1], 0)}))
    ng, fw, none = out.draft_token_ids
    assert ng == [2, 3, 4, 5]                         # the loop's continuation, K tokens
    assert fw == [nxt(1)]                             # l_0 (nothing repeats to extend it with)
    assert none == []
    assert [prop.states[r].last.kind for r in ("r0", "r1", "r2")] == [NGRAM, FORWARD, NONE]
    assert prop.states["r0"].last.sources == (SOURCE_NGRAM,) * 4
    assert len(prop.target_access.forwards) == 1 and prop.target_access.forwards[0]["ids"] == [1]
    assert prop.stats.drafts_skipped_forward == 1 and prop.stats.steps_by_kind[NONE] == 1


def test_rows_without_room_or_slot_get_no_draft_and_are_counted():
    prop = make_proposer(policy="paper", max_model_len=8)
    b = Batch([1, 2, 3, 4, 5], [1, 2])
    step = b.step({0: ([6], 0), 1: ([3], 0)})
    step.requests[1] = RequestStep(1, "r1", [3], 0, step.requests[1].pos, has_slot=False)
    out = prop.propose_step(step)
    # request 0 is at position 5 of 8: room min(K, 8 - 6 - 1) = 1; request 1 has no slot
    assert out.draft_token_ids == [[nxt(6)], []]
    assert prop.stats.skipped_no_slot == 1 and set(prop.states) == {"r0", "r1"}
    assert prop.states["r1"].last == Proposal()


def test_sampled_requests_hand_over_the_distribution_they_were_drawn_from():
    """A sampled request's draft is drawn from q (softmax of the target's logits at the
    request's temperature) with its own seeded RNG; the proposal carries q for that
    position (rows in batch order), and the greedy request's row is a point mass."""
    prop = make_proposer(policy="paper")
    b = Batch([1, 2, 3], [4, 5])
    out = prop.propose_step(b.step({0: ([4], 0), 1: ([6], 0)}, sampling={0: sampled_params(seed=7, temperature=2.0)}))
    (d0,), (d1,) = out.draft_token_ids
    q = torch.softmax(prop.target_access.lm_head[4] / 2.0, -1)
    assert out.draft_probs.shape == (2, K, V)
    torch.testing.assert_close(out.draft_probs[0, 0], q)
    assert d1 == nxt(6) and out.draft_probs[1, 0].tolist() == torch.nn.functional.one_hot(
        torch.tensor(nxt(6)), V).float().tolist()
    again = make_proposer(policy="paper")      # same seed, same draw: independent of the engine's past
    b2 = Batch([1, 2, 3], [4, 5])
    assert again.propose_step(b2.step({0: ([4], 0), 1: ([6], 0)},
                                      sampling={0: sampled_params(seed=7, temperature=2.0)})).draft_token_ids[0] == [d0]


def test_released_requests_leave_no_state_and_return_fresh():
    prop = make_proposer(policy="paper")
    b = Batch([1, 2, 3], [4, 5])
    prop.propose_step(b.step({0: ([4], 0), 1: ([6], 0)}))
    old = prop.states["r0"]
    assert prop.release_requests(["r0", "unknown"]) == 1 and set(prop.states) == {"r1"}
    prop.propose_step(b.step({0: ([nxt(4)], 1), 1: ([nxt(6)], 1)}))
    assert prop.states["r0"] is not old and prop.states["r0"].uid != old.uid
    assert len(prop.states["r0"].ngrams or []) == 0          # ngram_topk=0: no table
    assert prop.stats.verified_drafts == 1                    # only r1's chain was booked


def test_the_adaptive_policy_learns_costs_from_pure_decode_steps_only():
    """Whole steps under the default policy: every row gets a valid option, the cost model
    observes a step only when no prefill shared it (num_scheduled_tokens counts one token
    per decode row plus the drafts verified)."""
    prop = make_proposer(ngram_topk=20)
    loop = [7, 8, 9, 10] * 8
    b = Batch(loop)
    toks = [7]
    k = 0
    for i in range(12):
        out = prop.propose_step(b.step({0: (toks, k)}, num_scheduled=(100 if i == 5 else None)))
        (chain,) = out.draft_token_ids
        assert prop.states["r0"].last.kind in KINDS and len(chain) <= K
        # the target accepts what follows the loop
        want = [loop[(b.lens[0] + j) % 4] for j in range(len(chain) + 1)]
        acc = 0
        while acc < len(chain) and chain[acc] == want[acc]:
            acc += 1
        toks, k = want[: acc + 1], len(chain)
    steps_seen = len(prop.policy.costs._step)
    assert steps_seen == 12 - 2          # the first step (nothing before it) and the one with prefill
    assert prop.stats.accepted_ngram > 0


class ScriptedPolicy(DraftingPolicy):
    """Each request's option from :attr:`kinds` (req id -> kind), chains kept whole."""

    kinds: dict = {}

    def plan(self, rows, step, has_fused):
        n = len(rows)
        return StepPlan(list(rows), [self.kinds.get(r.req_id, NONE) for r in rows], [False] * n, -1.0,
                        [{} for _ in range(n)])


def test_policies_are_chosen_by_name_or_class_path_in_one_place():
    assert policy_class("adaptive") is AdaptivePolicy
    assert policy_class(f"{__name__}:ScriptedPolicy") is ScriptedPolicy
    for bad, match in (("nope", "unknown drafting policy"), ("no.such.module:X", "cannot be imported"),
                       ("vllm_tokenswift.core.step:Row", "not a subclass")):
        with pytest.raises(TokenSwiftConfigError, match=match):
            policy_class(bad)
    with pytest.raises(ValueError, match="policy must be one of"):
        TokenSwiftConfig.parse({"use_heads": False, "policy": "no-colon"})


# ============================================================== parts
def _state(prop, rid, params):
    return prop._new_state(RequestStep(0, rid, [1], 0, 1, sampling_params=params))


def test_seeded_draws_reproduce_per_request_and_across_ranks():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    a, b = make_proposer(), make_proposer()    # b: another tensor-parallel rank, or another run
    sa = _state(a, "r1", sampled_params(seed=1234))
    draw(_state(b, "x", sampled_params()), probs)   # whatever else the other rank drew before
    sb = _state(b, "r1", sampled_params(seed=1234))
    assert draw(sa, probs) == draw(sb, probs)
    assert draw(sa, probs) == draw(sb, probs)  # and the streams stay in step
    sc = _state(a, "r1", sampled_params(seed=99))
    draws = [draw(sc, probs) for _ in range(5)]
    sd = _state(b, "r1", sampled_params(seed=1234))
    assert draws != [draw(sd, probs) for _ in range(5)]


def test_unseeded_requests_use_engine_seed_and_request_id():
    a, b = make_proposer(engine_seed=7), make_proposer(engine_seed=7)
    s1, s2 = _state(a, "q", sampled_params()), _state(b, "q", sampled_params())
    assert s1.seed == s2.seed  # identical on every rank (no Python hash salt)
    assert _state(a, "z", sampled_params()).seed != s1.seed
    assert _state(make_proposer(engine_seed=8), "q", sampled_params()).seed != s1.seed


def test_incremental_penalty_history_matches_recount():
    prop = make_proposer()
    vocab = 40
    rng = np.random.default_rng(0)
    toks = rng.integers(0, vocab, size=(1, 300)).astype(np.int32)
    st = _state(prop, "r", sampled_params())
    st.window = 16
    for pos in [20, 21, 25, 60, 61, 200, 299]:
        got = penalty_mask(st, toks[0], pos, vocab, "cpu")
        want = torch.zeros(vocab, dtype=torch.bool)
        want[torch.as_tensor(toks[0, max(0, pos + 1 - 16): pos + 1].astype(np.int64))] = True
        assert torch.equal(got, want), pos
    st2 = _state(prop, "r", sampled_params())  # global penalty (no window): all tokens so far
    for pos in [10, 50, 51, 299]:
        got = penalty_mask(st2, toks[0], pos, vocab, "cpu")
        want = torch.zeros(vocab, dtype=torch.bool)
        want[torch.as_tensor(toks[0, : pos + 1].astype(np.int64))] = True
        assert torch.equal(got, want), pos


def test_draft_probs_buffer_rows_and_positions():
    buf = DraftProbBuffer(4, 6)
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]])
    dp = buf.fill([[1, 2, 5], [], [3]], {0: q}, "cpu")
    assert dp.shape == (3, 4, 6)
    torch.testing.assert_close(dp[0, :2], q)                              # sampled positions: q
    assert dp[0, 2].tolist() == [0, 0, 0, 0, 0, 1.0]                     # n-gram position: one-hot
    assert dp[2, 0].tolist() == [0, 0, 0, 1.0, 0, 0]                     # greedy row: one-hot
    # next step: stale values of other positions are never read by vLLM, rows rewritten
    assert buf.fill([[4], [], [0]], {}, "cpu")[0, 0].tolist() == [0, 0, 0, 0, 1.0, 0]


def test_tp_broadcast_from_rank0_is_float32_only_and_exact_enough(monkeypatch):
    """vLLM's CPU all-gather has no float64 kernel: the broadcast sends float32 hi/lo pairs
    and every rank rebuilds rank 0's values (to ~1e-14 relative)."""
    from vllm_tokenswift.engine import tensor_parallel as tp

    sent = []

    def fake_gather(t):
        assert t.dtype == torch.float32 and t.dim() == 1
        sent.append(t)
        return torch.stack([t, t + 1.0])   # rank 1 holds other values; row 0 wins

    monkeypatch.setattr(tp, "tp_all_gather", fake_gather)
    x = np.array([0.1, 12.345678901234, 1e-7, 3.0e5 + 1 / 3, 0.0])
    got = tp.tp_broadcast_from_rank0(x)
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
    st = _state(make_proposer(), "r", sampled_params(seed=5))
    draws = np.array([draw(st, q) for _ in range(20000)])     # [N, 2]
    for d in range(2):
        counts = np.bincount(draws[:, d], minlength=12)
        support = q[d].numpy() > 0
        assert counts[~support].sum() == 0
        exp = q[d].numpy()[support].astype(np.float64)
        _, p = chisquare(counts[support], exp / exp.sum() * counts.sum())
        assert p > 1e-3, (d, counts)
    with pytest.raises(RuntimeError):
        draw(st, torch.zeros(1, 12))   # torch.multinomial's own error for a row without mass


# ============================================================== the adaptive policy
def _adaptive(**settings):
    prop = make_proposer(policy="adaptive", **settings)
    return prop, prop.policy


def _row(st, rid="r", room=4, ngram=None, batch_row=0):
    return Row(batch_row, rid, st, pos=10, room=room, context=[1, 2], ngram=ngram)


def _book(policy, st, k, a, tokens=None):
    policy.account([Verified(st, st.last, k, a, tokens)])


def _took(policy, st, kind, forced=False, alongside=False):
    policy._book_exploration(st, Proposal(kind, step=st.steps, forced=forced, alongside_forced=alongside))


def test_exploration_backs_off_while_forced_tries_are_not_taken_up():
    """The adaptive policy forces a try of the draft forward every ``explore_gap`` steps of
    a request; each forced try doubles the gap (up to ``policy_tuning.explore_max``), a
    voluntary choice resets it."""
    every, most = PolicyTuning().explore_every, PolicyTuning().explore_max
    prop, policy = _adaptive()
    st = _state(prop, "r", sampled_params(seed=1))
    r = _row(st)

    def forced_at(step):
        st.steps = step
        return policy.row_options(r, 0, False).forced

    assert st.explore_gap == every
    assert forced_at(every - 1) is None and forced_at(every) == FORWARD
    gaps = []
    tried = 0
    for _ in range(8):   # forced tries, never chosen voluntarily
        step = tried + st.explore_gap
        assert forced_at(step - 1) is None and forced_at(step) == FORWARD
        _took(policy, st, FORWARD, forced=True)
        tried = step
        gaps.append(st.explore_gap)
    assert gaps == [96, 192, 384, 768, 768, 768, 768, 768] and most == 768
    _took(policy, st, NGRAM)                # other options leave the gap alone
    assert st.explore_gap == most
    _took(policy, st, FORWARD)              # chosen on its own: back to the short gap
    assert st.explore_gap == every
    assert forced_at(st.steps + every) == FORWARD


def test_the_next_step_books_the_exploration_of_the_proposal_it_verifies():
    """Exploration bookkeeping rides on the proposal: the step that verifies a forced try
    doubles the gap; a proposal with nothing planned books nothing."""
    prop, policy = _adaptive()
    st = _state(prop, "r", sampled_params(seed=1))
    st.steps = 60
    st.last = Proposal(FORWARD, (SOURCE_HEADS,), (0.5,), span=1, step=60, forced=True)
    _book(policy, st, 1, 0, [3])
    assert st.tried[FORWARD] == 60 and st.explore_gap == 96
    st.last = Proposal()
    _book(policy, st, 0, 0, [3])
    assert st.explore_gap == 96 and st.tried == {FORWARD: 60}


def test_exploration_waits_while_full_chains_are_accepted():
    """A forced try of the draft forward is deferred while the request's last chain was
    full length (num_speculative_tokens) and wholly accepted, and happens at the first
    step after a chain that was not."""
    prop, policy = _adaptive()
    policy.calibration = pol.Calibration(positions=4)
    st = _state(prop, "r", sampled_params(seed=1))
    r = _row(st)
    st.steps = PolicyTuning().explore_every

    def forced():
        return policy.row_options(r, 0, False).forced

    _book(policy, st, 4, 4)            # 4 of 4 accepted: the chain could not have been longer
    assert st.all_accepted and forced() is None
    _book(policy, st, 3, 3)            # shorter than num_speculative_tokens
    assert not st.all_accepted and forced() == FORWARD
    _book(policy, st, 4, 4)
    assert forced() is None
    _book(policy, st, 4, 2)            # a rejection
    assert forced() == FORWARD


def test_exploration_waits_while_the_ngram_chain_yields_more_than_a_try_could():
    """A due forced try is skipped while the request's n-gram chain is expected to yield at
    least the tried option's own positions (4 for the draft forward at room 4), taken when
    it is expected to yield less, always taken with ``explore_beside_ngram``, and never
    forced with ``explore_every=0``; the tuning's gaps set the request's first gap."""

    def forced(tuning, conf):
        # heads on: the draft forward's own positions are l_0..l_3, 4 at room 4
        cfg = TokenSwiftConfig.parse({"use_heads": True, "heads": "/h", "policy_tuning": tuning})
        policy = AdaptivePolicy(cfg, 4)
        policy.calibration = pol.Calibration(positions=4, prior_weight=1e9)  # prob = bin centre
        prop = make_proposer(policy_tuning=tuning)
        st = _state(prop, "r", greedy_params())
        st.steps = st.explore_gap
        r = _row(st, ngram=Chain([5, 6, 7, 8, 9, 10], [SOURCE_NGRAM] * 6, 0.0, confs=[conf] * 6))
        opts = policy.row_options(r, 0, False)
        return st.explore_gap, float(np.sum(opts.cums[NGRAM])), opts.forced

    gap, ngram_yield, f = forced({}, 0.99)          # 6 tokens at 0.95 each: 4.35 expected
    assert gap == 48 and ngram_yield == pytest.approx(sum(0.95 ** j for j in range(1, 7)))
    assert ngram_yield >= 4 and f is None
    gap, ngram_yield, f = forced({}, 0.75)          # 0.75 each: 2.47 expected < 4
    assert ngram_yield < 4 and f == FORWARD
    assert forced({"explore_beside_ngram": True}, 0.99)[2] == FORWARD
    assert forced({"explore_every": 0, "explore_max": 10}, 0.75)[2] is None
    assert forced({"explore_every": 10, "explore_max": 10}, 0.75)[:1] == (10,)


def test_greedy_acceptance_does_not_calibrate_sampled_chains():
    """N-gram chains verified for a greedy request (accepted when they are the target's
    argmax) leave the calibration of a sampled request's chains (accepted with the
    target's probability) at its prior, and raise the greedy one."""
    prop, policy = _adaptive()
    policy.calibration = pol.Calibration(positions=4)
    greedy = _state(prop, "g", greedy_params())
    assert not greedy.sampled
    chain = Chain([5, 6, 7, 8], [SOURCE_NGRAM] * 4, 0.0, [0.55] * 4)
    prior = policy.calibrated_cum(chain, sampled=True).copy()
    for _ in range(50):
        greedy.last = Proposal(NGRAM, tuple(chain.sources), tuple(chain.confs))
        _book(policy, greedy, 4, 4)
    np.testing.assert_allclose(policy.calibrated_cum(chain, sampled=True), prior)
    assert policy.calibrated_cum(chain, sampled=False)[-1] > prior[-1] + 0.3


def test_a_draft_forward_whose_chain_was_cut_away_is_booked():
    """The draft forward ran but the cut left no draft: the request's forward estimate
    books position 0 as reached and not accepted (the forward realised nothing), and a
    chain cut to one accepted token books position 1 so."""
    prop, policy = _adaptive()
    st = _state(prop, "r", sampled_params(seed=1))
    fwd = policy.estimates_of(st)[FORWARD]
    st.last = Proposal(FORWARD, (), (), span=4)
    _book(policy, st, 0, 0)
    assert fwd.reached[0] == pytest.approx(1.0) and fwd.accepted[0] == 0.0
    st.last = Proposal(FORWARD, (0,), (0.9,), span=4)
    _book(policy, st, 1, 1)
    assert fwd.reached[1] > 0.9 and fwd.accepted[1] == 0.0 and fwd.accepted[0] > 0.9


def test_due_exploration_tries_wait_for_an_aligned_engine_step():
    """A request whose forced try is due takes it only on an engine step that is a
    multiple of EXPLORE_ALIGN, so requests that fell due at different steps of a batch
    try together (one draft forward for all of them)."""
    every = PolicyTuning().explore_every
    prop, policy = _adaptive()
    a, b = _state(prop, "a", sampled_params(seed=2)), _state(prop, "b", sampled_params(seed=2))
    ra, rb = _row(a, "a"), _row(b, "b", batch_row=1)
    a.steps, b.steps = every + 3, every     # both due, "a" for 3 steps already
    forced = {step: (policy.row_options(ra, step, False).forced, policy.row_options(rb, step, False).forced)
              for step in range(1, 2 * EXPLORE_ALIGN + 1)}
    assert [s for s, f in forced.items() if f != (None, None)] == [EXPLORE_ALIGN, 2 * EXPLORE_ALIGN]
    assert forced[EXPLORE_ALIGN] == (FORWARD, FORWARD)


def test_a_choice_made_alongside_a_forced_try_backs_off_like_a_try():
    """A request that takes the draft forward on a step where another request was forced
    to try it (its fixed cost paid anyway) doubles its exploration gap like a forced try;
    only a choice made with nobody forced resets the gap."""
    every = PolicyTuning().explore_every
    prop, policy = _adaptive()
    st = _state(prop, "r", sampled_params(seed=1))
    _took(policy, st, FORWARD, alongside=True)
    assert st.explore_gap == 2 * every
    _took(policy, st, FUSED, alongside=True)
    assert st.explore_gap == 4 * every
    _took(policy, st, NGRAM, alongside=True)      # no fixed cost: gap unchanged
    assert st.explore_gap == 4 * every
    _took(policy, st, FORWARD)
    assert st.explore_gap == every


def test_the_cut_keeps_the_first_token_past_it():
    """The adaptive policy's cut: where the calibrated cumulative acceptance falls to the
    threshold (or at the row's room; at least one token for a forced row); the first token
    past the cut comes with it, none when the chain was kept whole."""
    prop, policy = _adaptive()
    st = _state(prop, "g", greedy_params())
    conf = [0.95, 0.95, 0.55, 0.95]

    def cut(ch, threshold, cum=None, room=4, forced=False, first=None):
        plan = StepPlan([_row(st, room=room)], [NGRAM], [forced], threshold, [{}], threshold_first=first)
        return policy.cut(plan, 0, ch, cum)

    cum = np.asarray([0.9, 0.8, 0.2, 0.1])      # cut at 2 by threshold 0.5
    c = cut(Chain([5, 6, 7, 8], [SOURCE_FUSED] * 4, 0.0, list(conf)), 0.5, cum)
    assert c.chain.tokens == [5, 6] and c.past_cut == (7, SOURCE_FUSED, 0.55)
    c = cut(Chain([5, 6], [SOURCE_NGRAM] * 2, 0.0, [0.95, 0.95]), -1.0)       # kept whole
    assert c.chain.tokens == [5, 6] and c.past_cut is None
    c = cut(Chain([5, 6, 7], [SOURCE_NGRAM] * 3, 0.0, [0.95] * 3), 0.0, room=2)  # cut by the room
    assert c.past_cut == (7, SOURCE_NGRAM, 0.95)
    c = cut(Chain([5, 6], [SOURCE_NGRAM] * 2, 0.0, [0.95] * 2), 0.99, np.asarray([0.5, 0.4]), forced=True)
    assert c.chain.tokens == [5] and c.past_cut == (6, SOURCE_NGRAM, 0.95)
    # a request's first draft priced below the later ones: its own, lower threshold
    c = cut(Chain([5, 6], [SOURCE_NGRAM] * 2, 0.0, [0.95] * 2), 0.5, np.asarray([0.45, 0.3]), first=0.4)
    assert c.chain.tokens == [5] and c.past_cut == (6, SOURCE_NGRAM, 0.95)
    c = cut(Chain([5, 6], [SOURCE_NGRAM] * 2, 0.0, [0.95] * 2), 0.5, np.asarray([0.45, 0.3]))
    assert c.chain.tokens == []


def test_a_sampled_chain_drawn_from_q_is_cut_by_its_options_acceptance_not_by_its_confidence():
    """A self-speculative chain of a sampled request: its tokens are drawn from q, whose
    largest probability (the confidence, 0.15 here) does not tell how often such a token is
    accepted (``min(1, p/q)``). Before any verification the cut takes the chain option's
    acceptance estimate as the prior (its initial 0.6 > the threshold 0.45: one token kept,
    0.36 for two is below it), not the bin centre 0.15 (which emptied every such chain not
    forced, so its bins never learnt, and booked the option as rejected at position 0).
    The same chain for a greedy request (argmax tokens: the confidence is the target's
    probability of the token) keeps the bin centre and is cut away; n-gram tokens of a
    sampled request (point masses) keep it too."""
    from vllm_tokenswift.core.chain import SOURCE_CHAIN
    from vllm_tokenswift.core.step import CHAIN

    prop, policy = _adaptive()
    sampled, greedy = _state(prop, "s", sampled_params()), _state(prop, "g", greedy_params())

    def cut(st, sources, kind=CHAIN, threshold=0.45):
        plan = StepPlan([_row(st)], [kind], [False], threshold, [{}])
        return policy.cut(plan, 0, Chain([5, 6], list(sources), 0.0, [0.15, 0.15])).chain.tokens

    assert cut(sampled, [SOURCE_CHAIN] * 2) == [5]
    assert cut(greedy, [SOURCE_CHAIN] * 2) == []
    assert cut(sampled, [SOURCE_NGRAM] * 2, kind=NGRAM) == []
    # the prior is the request's own estimate of the option: after the chain option was
    # verified and rejected at position 0 many times, the same chain is cut away
    for _ in range(40):
        sampled.last = Proposal(CHAIN, (SOURCE_CHAIN,), (0.9,), span=1)
        _book(policy, sampled, 1, 0)
    assert policy.acceptance.probs(policy.estimates_of(sampled), CHAIN)[0] < 0.2
    assert cut(sampled, [SOURCE_CHAIN] * 2) == []
    # and the calibration still learns the bin: chains verified at confidence 0.15 and
    # accepted lift position 0 above the threshold again (position 1, never verified,
    # is at its prior 0.6: both kept)
    for _ in range(60):
        sampled.last = Proposal(CHAIN, (SOURCE_CHAIN,), (0.15,), span=1)
        _book(policy, sampled, 1, 1)
    assert cut(sampled, [SOURCE_CHAIN] * 2) == [5, 6]


def test_the_hand_over_records_the_token_past_the_cut_or_the_ngram_chains_first():
    """A row whose chain was cut records the token past the cut; a row that drafted nothing
    records its n-gram chain's first token (the next step's output tells whether it would
    have been accepted)."""
    prop = make_proposer(policy=f"{__name__}:ScriptedPolicy", ngram_topk=20)
    prop.policy.kinds = {"r0": NONE, "r1": NGRAM}
    loop = [1, 2, 3, 4, 5] * 6
    b = Batch(loop, loop, max_len=64)
    prop.propose_step(b.step({0: ([1], 0), 1: ([1], 0)}))
    none, ng = prop.states["r0"].last, prop.states["r1"].last
    assert none.kind == NONE and none.next[:2] == (2, SOURCE_NGRAM)   # the n-gram chain's first token
    assert ng.kind == NGRAM and len(ng.sources) == K and ng.next is None   # built to the room: nothing past it


def test_the_token_past_the_cut_is_observed_when_the_output_tells_it():
    """The account observes the recorded token past the cut iff every draft proposed was
    verified and accepted: accepted iff the bonus token equals it; for a greedy request
    whatever its source, for a sampled one only an n-gram token (a point mass)."""
    prop, policy = _adaptive()
    policy.calibration = pol.Calibration(positions=4, decay=1.0)
    greedy = _state(prop, "g", greedy_params())
    sampled = _state(prop, "s", sampled_params(seed=1))

    def booked(st, last, k, a, tokens):
        policy.calibration.reached.clear()
        policy.calibration.accepted.clear()
        st.last = last
        _book(policy, st, k, a, tokens)
        return dict(policy.calibration.reached), dict(policy.calibration.accepted)

    two = Proposal(NGRAM, (SOURCE_NGRAM,) * 2, (0.95, 0.95), next=(7, SOURCE_NGRAM, 0.55))
    both = {(SOURCE_NGRAM, 0, 9): 1.0, (SOURCE_NGRAM, 1, 9): 1.0}
    assert booked(greedy, two, 2, 2, [5, 6, 7]) == ({**both, (SOURCE_NGRAM, 2, 5): 1.0},
                                                    {**both, (SOURCE_NGRAM, 2, 5): 1.0})
    assert booked(greedy, two, 2, 2, [5, 6, 4]) == ({**both, (SOURCE_NGRAM, 2, 5): 1.0},
                                                    {**both, (SOURCE_NGRAM, 2, 5): 0.0})
    reached, _ = booked(greedy, two, 2, 1, [5, 4])                       # a rejection: the output diverged
    assert (SOURCE_NGRAM, 2, 5) not in reached
    reached, _ = booked(greedy, two, 1, 1, [5, 7])                       # the scheduler verified fewer
    assert (SOURCE_NGRAM, 2, 5) not in reached and (SOURCE_NGRAM, 1, 5) not in reached
    none = Proposal(NONE, (), (), next=(9, SOURCE_NGRAM, 0.35))
    assert booked(greedy, none, 0, 0, [9]) == ({(SOURCE_NGRAM, 0, 3): 1.0}, {(SOURCE_NGRAM, 0, 3): 1.0})
    assert booked(greedy, Proposal(NONE), 0, 0, [9]) == ({}, {})
    assert booked(greedy, two, 2, 2, None)[0] == both                      # no tokens given: as before
    # sampled: a token drawn from q is not observed; an n-gram token is, with the sampled key
    drawn = Proposal(FUSED, (SOURCE_FUSED,) * 2, (0.95, 0.95), next=(7, SOURCE_FUSED, 0.55))
    assert (SOURCE_FUSED + 10, 2, 5) not in booked(sampled, drawn, 2, 2, [5, 6, 7])[0]
    assert (SOURCE_NGRAM + 10, 2, 5) in booked(sampled, two, 2, 2, [5, 6, 7])[0]
    policy.cfg = policy.cfg.model_copy(update={"policy_tuning": PolicyTuning(observe_past_cut=False)})
    assert booked(greedy, two, 2, 2, [5, 6, 7]) == (both, both)            # the setting off: verified tokens only
    assert booked(greedy, none, 0, 0, [9]) == ({}, {})


def test_the_rows_ngram_chain_scores_a_context_seen_once_with_the_escape_count():
    """The proposer's n-gram chains (the ``ngram`` option and the extension of sampled
    chains) score a 3-token context's most frequent continuation ``c / (t + 1)`` where
    ``policy_tuning.ngram_escape`` asks for it: by default (``"sampled"``) for sampled
    requests only, with ``true`` for greedy ones too, with ``false`` for none (``c / t``)."""
    from vllm_tokenswift.core.ngram import NGramTable

    def chain(temperature, **tuning):
        prop = make_proposer(ngram_topk=20, policy_tuning=tuning)
        st = _state(prop, "r", sampled_params(seed=1, temperature=temperature))
        assert isinstance(st.ngrams, NGramTable) and st.sampled == (temperature > 0)
        # (1, 2, 3) seen once, followed by 4; (2, 3, 4) seen once, followed by 5;
        # (3, 4, 5) twice, followed by 6 both times
        st.ngrams.extend([1, 2, 3, 4, 5, 6, 9, 3, 4, 5, 6, 1, 2, 3])
        ch = request_ngram_chain(st.ngrams, [9, 1, 2, 3], 3, st.sampled, prop.cfg.policy_tuning)
        assert ch.tokens == [4, 5, 6]
        return ch.confs

    escaped, plain = pytest.approx([1 / 2, 1 / 2, 2 / 3]), pytest.approx([1.0, 1.0, 1.0])
    assert chain(1.0) == escaped and chain(0.0) == plain               # default: "sampled"
    assert chain(1.0, ngram_escape=True) == escaped and chain(0.0, ngram_escape=True) == escaped
    assert chain(1.0, ngram_escape=False) == plain and chain(0.0, ngram_escape=False) == plain
