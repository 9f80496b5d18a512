"""docs/research/greedy_replay.py: TokenSwift's n-gram drafting replayed over a fixed greedy output."""

import random

import pytest
from research_utils import load_research


@pytest.fixture(scope="module")
def replay():
    return load_research("greedy_replay")


def test_replay_accounts_every_token_and_drafts_full_chains_on_a_loop(replay):
    """Every step after the prefill yields its accepted drafts plus one token; on an exact 20-token loop the
    n-gram path drafts full-length chains that are wholly accepted once the loop has been
    seen (the last 180 tokens take at most 180 / (k + 1) + 2 steps)."""
    rng = random.Random(0)
    prompt = [rng.randrange(100, 200) for _ in range(50)]
    period = [rng.randrange(3, 60) for _ in range(20)]
    out = period * 20
    costs = {"a": 35.0, "g": 0.5, "b": 3.0, "f0": 35.0, "f1": 0.0, "h0": 35.0, "h1": 0.0}
    k = 8
    r = replay.replay_tokenswift(prompt, out, k, costs)
    assert r["steps"] + r["accepted"] == len(out) - 1     # the prefill sampled out[0]
    assert r["accepted"] <= r["drafted"]
    assert len(r["steps_at"]) == len(out)
    assert all(b >= a for a, b in zip(r["steps_at"], r["steps_at"][1:]))
    # each step costs a, plus b per draft token, plus g when it drafts: between the two
    # extremes of g's share
    base = r["steps"] * 35.0 + 3.0 * r["drafted"]
    assert base <= r["ms"] <= base + 0.5 * r["steps"]
    assert r["steps_at"][-1] - r["steps_at"][-181] <= 180 // (k + 1) + 2
    assert r["steps"] < len(out) / 4


def test_greedy_verification_stops_at_the_first_mismatch(replay):
    seq = [1, 2, 3, 4, 5, 6]
    assert replay._accepted(seq, 1, [3, 4, 9, 6]) == 2
    assert replay._accepted(seq, 1, [9]) == 0
    assert replay._accepted(seq, 0, []) == 0


def test_a_position_estimated_below_the_cut_recovers_on_a_loop(replay, monkeypatch):
    """The exploration trap of the calibration, replayed: positions 1.. start at an
    acceptance of 0.5 (as after text that did not repeat) and a draft token costs 12 ms
    against a 32 ms step (batch 8 on the CPU), so chains are cut after one token. On an
    exact loop, the token past the cut, observed from each step's output, raises the
    estimates until the chains grow: the last 180 tokens take at most 45 steps (4 tokens
    per step or more). Without the observation (``observe_past_cut=False``, as the
    proposer's ``policy_tuning.observe_past_cut`` false; or ``Calibration.observe`` a
    no-op) the cut never moves: every step yields exactly 2 tokens."""
    from vllm_tokenswift.core.policy import decision as pol
    from vllm_tokenswift.core.chain import SOURCE_NGRAM

    def seeded(k):
        c = pol.Calibration(positions=k)
        for b in range(c.num_bins):
            c.reached[(SOURCE_NGRAM, 0, b)], c.accepted[(SOURCE_NGRAM, 0, b)] = 50.0, 45.0
            for j in range(1, k):
                c.reached[(SOURCE_NGRAM, j, b)], c.accepted[(SOURCE_NGRAM, j, b)] = 50.0, 25.0
        return c

    rng = random.Random(0)
    prompt = [rng.randrange(100, 200) for _ in range(50)]
    out = [rng.randrange(3, 60) for _ in range(20)] * 60
    costs = {"a": 32.0, "g": 0.0, "b": 12.0}
    r = replay.replay_tokenswift(prompt, out, 8, costs, calibration=seeded(8))
    assert r["steps_at"][-1] - r["steps_at"][-181] <= 45
    r = replay.replay_tokenswift(prompt, out, 8, costs, calibration=seeded(8), observe_past_cut=False)
    assert r["steps_at"][-1] - r["steps_at"][-181] == 90
    monkeypatch.setattr(pol.Calibration, "observe", lambda *a, **k: None)       # the flag is all it takes
    r = replay.replay_tokenswift(prompt, out, 8, costs, calibration=seeded(8))
    assert r["steps_at"][-1] - r["steps_at"][-181] == 90
