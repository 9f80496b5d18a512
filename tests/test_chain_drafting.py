"""Self-speculative chains (the ``chain`` option, ``policy="triforce"``) without vLLM: the real
proposer driven through whole steps with the fake target of ``test_proposer_unit``.

* greedy: forward ``j`` feeds the chain's token ``j`` at ``pos + j`` into that position's
  real slot, over the view plus the chain so far (the table grows into the next block);
* sampled: the tokens and the draft distributions handed to the rejection sampler are
  exactly those of sequential draws from q built with the request's penalty (counting the
  chain drawn so far, as verification does), temperature and min_p;
* the lookahead slots bound the chain; no slot outside the request's own blocks is written;
* the penalty history of a chain position equals a recount;
* the cost-aware decision's new entries (``L`` forwards for ``L`` chain tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_proposer_unit import BS, V, Batch, FakeTarget, greedy_params, make_proposer, nxt, sampled_params

from vllm_tokenswift.core.chain import SOURCE_CHAIN
from vllm_tokenswift.core.config import TokenSwiftConfig, TokenSwiftConfigError
from vllm_tokenswift.core.draft_sampling import chain_penalty_mask, draft_distributions, draw
from vllm_tokenswift.core.policy import check_policy
from vllm_tokenswift.core.policy import decision as dec
from vllm_tokenswift.core.request_state import new_request_state
from vllm_tokenswift.core.step import CHAIN, NONE, RequestStep, StepInput


def _step(b: Batch, rows: dict, sampling=None, num_slots=None) -> StepInput:
    """As ``Batch.step``, with per-row allocated KV slots (``num_slots``: row -> slots)."""
    st = b.step(rows, sampling)
    if num_slots:
        st.requests = [RequestStep(r.batch_row, r.req_id, r.sampled, r.num_verified, r.pos, r.verify_index,
                                   r.has_slot, r.sampling_params, num_slots.get(r.batch_row, r.num_slots))
                       for r in st.requests]
    return st


def test_greedy_chain_drafts_token_by_token_into_the_lookahead_slots():
    prop = make_proposer(policy="triforce", chain_length=3)
    b = Batch(list(range(1, 16)), [5, 6, 7, 8, 9])      # row 0: x at position 15, the last of block 0
    p = prop.propose_step(b.step({0: ([20], 0), 1: ([10], 0)}))
    assert p.draft_token_ids == [[nxt(20), nxt(nxt(20)), nxt(nxt(nxt(20)))],
                                 [nxt(10), nxt(nxt(10)), nxt(nxt(nxt(10)))]]
    assert p.draft_probs is None                         # greedy: point masses
    f = prop.target_access.forwards
    assert len(f) == 3
    assert [x["ids"] for x in f] == [[20, 10], [nxt(20), nxt(10)], [nxt(nxt(20)), nxt(nxt(10))]]
    assert [x["positions"] for x in f] == [[15, 5], [16, 6], [17, 7]]
    assert [x["seq_lens"] for x in f] == [[16, 6], [17, 7], [18, 8]]
    # the real slots of positions pos + j: row 0 moves into its second block
    blk0, blk1 = b.blocks[0, 0], b.blocks[0, 1]
    assert [x["slots"][0] for x in f] == [blk0 * BS + 15, blk1 * BS + 0, blk1 * BS + 1]
    assert [x["slots"][1] for x in f] == [b.blocks[1, 0] * BS + j for j in (5, 6, 7)]
    # the view (one block) followed by the request's next block once the chain reaches it
    assert f[0]["tables"][0][0].tolist()[:1] == [blk0]
    assert f[1]["tables"][0][0].tolist()[:2] == [blk0, blk1]
    assert f[1]["tables"][0][1].tolist()[0] == b.blocks[1, 0]
    st0 = prop.states["r0"]
    assert st0.last.kind == CHAIN and st0.last.sources == (SOURCE_CHAIN,) * 3 and st0.last.span == 3
    assert prop.stats.steps_by_kind[CHAIN] == 2 and prop.stats.draft_tokens_chain == 6
    assert prop.stats.chain_forwards == 3 and prop.stats.chain_forward_rows == 6
    # the next step books the verification by source: 2 of row 0's 3 accepted
    prop.propose_step(b.step({0: ([nxt(20), nxt(nxt(20)), 3], 3), 1: ([4], 3)}))
    assert prop.stats.accepted_chain == 2 and prop.stats.accepted_tokens == 2
    assert prop.stats.accepted_by_kind[CHAIN] == 2


def test_the_allocated_slots_bound_the_chain_and_no_other_block_is_written():
    prop = make_proposer(policy="triforce", chain_length=4)
    b = Batch(list(range(1, 15)), list(range(1, 30)), [7, 8])
    # row 0: x at 14, slots up to 15 allocated (2 forwards); row 1: x at 29, 3 slots; row 2: none past x
    step = _step(b, {0: ([3], 0), 1: ([4], 0), 2: ([5], 0)}, num_slots={0: 16, 1: 32, 2: 3})
    p = prop.propose_step(step)
    assert [len(d) for d in p.draft_token_ids] == [2, 3, 1]
    f = prop.target_access.forwards
    assert [len(x["ids"]) for x in f] == [3, 2, 1]        # rows drop out as their chains end
    for x in f:
        for slot, table in zip(x["slots"], x["tables"][0]):
            owner = [r for r in range(3) if slot // BS in b.blocks[r]]
            assert len(owner) == 1 and slot // BS in table.tolist()
    # exactly the slots of positions pos + j in each row's own blocks
    slot = lambda r, p: int(b.blocks[r, p // BS]) * BS + p % BS   # noqa: E731
    assert [x["slots"] for x in f] == [[slot(0, 14), slot(1, 29), slot(2, 2)], [slot(0, 15), slot(1, 30)],
                                       [slot(1, 31)]]
    # no room at all (slots end at x): no chain, no forward for that row
    prop2 = make_proposer(policy="triforce", chain_length=2)
    b2 = Batch([1, 2, 3])
    p2 = prop2.propose_step(_step(b2, {0: ([4], 0)}, num_slots={0: 3}))
    assert p2.draft_token_ids == [[]] and prop2.target_access.forwards == []
    assert prop2.states["r0"].last.kind == NONE


class SoftTarget(FakeTarget):
    """The fake target with a flatter LM head (logit 2 on ``nxt``, 1 on ``t``): draws vary."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.zeros(V, V)
        for t in range(V):
            self.lm_head[t, nxt(t)] = 2.0
            self.lm_head[t, t] += 1.0


def test_sampled_chain_hands_over_exactly_the_sequential_draws():
    """Tokens and q equal a replay: a fresh state with the same seed draws position j from
    q_j = draft distribution of the fake target's logits after the newest token or chain
    token j-1, with the windowed penalty over the window *including the chain so far*."""
    prompt = [1, 2, 3, 2, 9, 11, 4]
    params = sampled_params(seed=7, temperature=0.8, min_p=0.05, repetition_penalty=1.5,
                            extra_args={"repetition_penalty_window": 5})
    prop = make_proposer(SoftTarget(), policy="triforce", chain_length=4)
    b = Batch(prompt)
    out = prop.propose_step(b.step({0: ([6], 0)}, sampling={0: params}))
    toks = out.draft_token_ids[0]
    assert len(toks) == 4
    # replay
    st = new_request_state("r0", params, ngram_n=4, use_ngrams=False, explore_every=0, engine_seed=0)
    row = b.tokens[0]
    pos = len(prompt)
    lm = SoftTarget().lm_head
    chain, qs = [], []
    for j in range(4):
        t_in = 6 if j == 0 else chain[-1]
        logits = (torch.nn.functional.one_hot(torch.tensor([t_in]), V).float() @ lm).view(1, 1, V)
        q = draft_distributions([st], [row], [pos], logits, chains=[list(chain)])[0, 0]
        chain.append(draw(st, q[None])[0])
        qs.append(q)
    assert toks == chain
    assert torch.equal(out.draft_probs[0, :4], torch.stack(qs))
    # the penalty of position j counted the chain: q_1 penalises the first draw
    mask1 = chain_penalty_mask(st, row, pos, chain[:1], V, "cpu")
    assert bool(mask1[chain[0]])
    assert prop.states["r0"].last.kind == CHAIN


def test_chain_penalty_history_equals_a_recount():
    rng = np.random.default_rng(3)
    for window in (0, 3, 6, 40):
        row = rng.integers(0, V, size=60).astype(np.int32)
        params = sampled_params(repetition_penalty=1.3, extra_args={"repetition_penalty_window": window}
                                if window else None)
        st = new_request_state("r", params, ngram_n=4, use_ngrams=False, explore_every=0, engine_seed=0)
        for pos in (10, 11, 30, 31, 58):
            for j in range(5):
                chain = rng.integers(0, V, size=j).tolist()
                seq = row[: pos + 1].tolist() + chain
                hist = seq[max(0, len(seq) - window):] if window else seq
                want = torch.zeros(V, dtype=torch.bool)
                want[torch.as_tensor(hist, dtype=torch.long)] = True
                got = chain_penalty_mask(st, row, pos, chain, V, "cpu")
                assert torch.equal(got, want), (window, pos, j)


def test_chain_length_is_validated_in_the_front_end():
    with pytest.raises(Exception, match="chain_length=5 exceeds num_speculative_tokens=4"):
        TokenSwiftConfig.parse({"use_heads": False, "num_speculative_tokens": 4, "chain_length": 5})
    cfg = TokenSwiftConfig.parse({"use_heads": False, "num_speculative_tokens": 4, "chain_length": 0,
                                  "policy": "triforce"})
    with pytest.raises(TokenSwiftConfigError, match="chain_length must be >= 1"):
        check_policy(cfg)
    assert TokenSwiftConfig.parse({"use_heads": False, "num_speculative_tokens": 6}).max_chain_length == 6


COSTS = {"a": 0.030, "g": 0.002, "b": 0.001, "f0": 0.006, "f1": 0.0005, "h0": 0.003, "h1": 0.0005}


def test_decision_weighs_chains_by_their_forwards():
    """A chain of L tokens costs L draft forwards: with cheap forwards and a target that
    accepts its own drafts, the decision takes a chain and the length the arithmetic gives;
    with forwards costing a plain step, plain decoding."""
    cum = np.cumprod([0.8] * 4)
    rows = [dec.RowOptions({NONE: np.zeros(0), CHAIN: cum})]
    d = dec.decide(rows, COSTS, min_gain=0.0)
    assert d.kinds == [CHAIN]
    # brute force over L: (1 + Σ_{j<L} cum_j) / (a + g + L·b + L·(f0 + f1))
    best = max(range(1, 5), key=lambda L: (1 + cum[:L].sum()) / (COSTS["a"] + COSTS["g"] + L * COSTS["b"]
                                                                 + L * (COSTS["f0"] + COSTS["f1"])))
    assert d.lengths == [best]
    want_t = COSTS["a"] + COSTS["g"] + best * (COSTS["b"] + COSTS["f0"] + COSTS["f1"])
    assert d.step_seconds == pytest.approx(want_t)
    assert d.throughput == pytest.approx((1 + cum[:best].sum()) / want_t)
    dear = dict(COSTS, f0=0.030)
    assert dec.decide(rows, dear, min_gain=0.0).kinds == [NONE]
    # the quick test agrees: nothing beats plain decoding there, something does with cheap forwards
    cands = dec._candidates(rows)
    assert dec._no_plan_beats(cands, dear, 1 / dear["a"])
    assert not dec._no_plan_beats(cands, COSTS, 1 / COSTS["a"])


def test_the_adaptive_policy_offers_chains_within_the_slots():
    prop = make_proposer(policy="adaptive", chain_length=3)
    b = Batch(list(range(1, 10)), list(range(1, 10)))
    step = _step(b, {0: ([4], 0), 1: ([5], 0)}, sampling={0: greedy_params(), 1: greedy_params()},
                 num_slots={0: 11, 1: 64})
    verified, rows = prop._update(step)
    assert [r.chain_room for r in rows] == [2, 3]       # slots 9, 10 | capped by chain_length
    opts = [prop.policy.row_options(r, 1, False) for r in rows]
    assert [len(o.cums[CHAIN]) for o in opts] == [2, 3]


def test_rows_forced_to_other_options_ride_beside_chains():
    """The cycle policy forces one row onto a chain and another onto the draft forward in
    the same step: the decision gives each its option (no combination may be left out)."""
    cum = np.cumprod([0.7] * 3)
    rows = [dec.RowOptions({NONE: np.zeros(0), CHAIN: cum, "forward": cum[:1]}, forced=CHAIN),
            dec.RowOptions({NONE: np.zeros(0), CHAIN: cum, "forward": cum[:1]}, forced="forward"),
            dec.RowOptions({NONE: np.zeros(0), "forward": cum[:1]}, forced=NONE)]
    d = dec.decide(rows, COSTS, min_gain=0.0)
    assert d.kinds == [CHAIN, "forward", NONE]
    assert d.lengths[0] >= 1 and d.lengths[1] == 1 and d.lengths[2] == 0
