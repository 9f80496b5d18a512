"""Unit tests of chain selection (candidates -> one verified chain)."""

import pytest

from vllm_tokenswift.core.chain import SOURCE_HEADS, SOURCE_NGRAM, score_chain, select_chain
from vllm_tokenswift.core.ngram import NGramTable


def probs_from(table):
    def prob(d, tok):
        return table[d].get(tok, 0.0) if d < len(table) else None
    return prob


def test_score_chain_exact_without_ngrams():
    p = probs_from([{5: 0.5}, {6: 0.4}, {7: 0.5}])
    s, qs = score_chain([5, 6, 7], [1], p, None, 3)
    assert qs == [0.5, 0.4, 0.5]
    assert s == pytest.approx(0.5 + 0.2 + 0.1)


def test_heads_only_picks_top_path():
    tree = [[5], [6, 60, 600], [7, 70, 700], [8, 80, 800]]
    p = probs_from([{5: 0.9}, {6: 0.6, 60: 0.3, 600: 0.1}, {7: 0.5, 70: 0.4}, {8: 0.5, 80: 0.2}])
    ch = select_chain([1, 2, 3], tree, p, None, ngram_topk=0, max_len=4)
    assert ch.tokens == [5, 6, 7, 8]
    assert ch.sources == [SOURCE_HEADS] * 4
    assert ch.expected_len == pytest.approx(0.9 + 0.54 + 0.27 + 0.135)


def test_ngram_candidate_wins_when_history_supports_it():
    table = NGramTable(4)
    # history repeats "5 11 12 13" many times
    table.extend([1, 2, 3] + [5, 11, 12, 13] * 10 + [4])
    tree = [[5], [6], [7], [8]]
    p = probs_from([{5: 0.9, 11: 0.0}, {6: 0.3}, {7: 0.3}, {8: 0.3}])
    ch = select_chain(table.tokens, tree, p, table, ngram_topk=5, max_len=4)
    assert ch.tokens == [5, 11, 12, 13]
    assert ch.sources == [SOURCE_NGRAM] * 4


def test_extension_beyond_heads_up_to_max_len():
    table = NGramTable(3)
    seq = [20, 21, 22, 23, 24, 25, 26, 27]
    table.extend(seq * 6)
    context = seq * 6  # ends with 27; history says 20 follows
    tree = [[20], [21], [22], [23]]
    p = probs_from([{20: 0.9}, {21: 0.9}, {22: 0.9}, {23: 0.9}])
    ch = select_chain(context, tree, p, table, ngram_topk=5, max_len=7, min_conf=0.3)
    assert ch.tokens == [20, 21, 22, 23, 24, 25, 26]
    assert ch.sources[4:] == [SOURCE_NGRAM] * 3
    # max_len caps the chain, and k=0 disables n-gram use entirely
    assert select_chain(context, tree, p, table, ngram_topk=5, max_len=2).tokens == [20, 21]
    assert select_chain(context, tree, p, table, ngram_topk=0, max_len=7).tokens == [20, 21, 22, 23]


def test_extension_stops_below_min_conf():
    table = NGramTable(2)
    table.extend([1, 2, 1, 3, 1, 4, 1, 5])  # after 1: four equally likely tokens
    p = probs_from([{1: 0.9}])
    ch = select_chain([9, 5], [[1]], p, table, ngram_topk=5, max_len=4, min_conf=0.3)
    # candidate n-gram [1, 2]: E = 0.9 + 0.9*0.25; the continuation after 2 (always 1, f=1)
    # would need a cumulative estimate 0.225 >= min_conf, so the chain is not extended
    assert ch.tokens == [1, 2]
    assert ch.expected_len == pytest.approx(0.9 + 0.9 * 0.25)


def test_ngram_chain_for_adaptive_drafting():
    from vllm_tokenswift.core.chain import ngram_chain

    table = NGramTable(3)
    table.extend([5, 6, 7, 8] * 5)  # after (7, 8) always 5 (4 times), after (8, 5) always 6 (4), ...
    ch = ngram_chain([7, 8], table, max_len=4, min_conf=0.3, escape=True)
    assert ch.tokens == [5, 6, 7, 8]
    assert ch.sources == [SOURCE_NGRAM] * 4
    # each confidence keeps one count for a continuation not seen yet, c / (c + 1):
    # (7, 8) -> 5 and (8, 5) -> 6 were seen 4 times, (5, 6) -> 7 and (6, 7) -> 8 5 times
    assert ch.confs == pytest.approx([0.8, 0.8, 5 / 6, 5 / 6])
    assert ch.expected_len == pytest.approx(0.8 + 0.64 + 0.64 * 5 / 6 + 0.64 * 25 / 36)
    plain = ngram_chain([7, 8], table, max_len=4, min_conf=0.3, escape=False)
    assert plain.tokens == [5, 6, 7, 8] and plain.expected_len == pytest.approx(4.0)
    assert ngram_chain([1, 2], table, max_len=4, min_conf=0.3, escape=True).tokens == []  # unseen context


def test_ngram_chain_takes_the_branch_the_long_context_took():
    """Text that repeats with a branch the 2-token n-gram context cannot tell apart:
    after (3, 4) came 5 twice and 9 once, but the 4-token context (1, 2, 3, 4) was
    followed by 9 — the chain copies that branch and goes on with what followed it; each
    confidence is the larger of the n-gram frequency and the long context's record,
    whose prior is the rate of all contexts of that length."""
    from vllm_tokenswift.core.chain import ngram_chain

    table = NGramTable(3, long_n=4)
    table.extend([7, 8, 3, 4, 5, 0, 7, 8, 3, 4, 5, 0, 1, 2, 3, 4, 9, 0, 1, 2, 3, 4])
    ch = ngram_chain(table.tokens[-4:], table, max_len=3, min_conf=0.01, escape=True)
    assert ch.tokens == [9, 0, 1]
    # 9: (1, 2, 3, 4) never recurred, so its record is the 4-token contexts' rate alone:
    # 4 recurrences, 3 followed as before ((3, 4, 5, 0) went on with 1, not 7),
    # (3 + 1) / (4 + 2) = 2/3, above the n-gram frequency 1/3
    assert table.level_record[4] == [4, 3]
    assert table.after_branches == {(3, 4, 5, 0): {7: 1, 1: 1}}
    assert ch.confs == pytest.approx([2 / 3, 1.0, 1.0])
    # without the long index the most frequent continuation wins
    short = NGramTable(3, long_n=0)
    short.extend(table.tokens)
    assert ngram_chain(short.tokens[-4:], short, max_len=3, min_conf=0.01, escape=True).tokens == [5, 0, 7]


def test_build_chain_extends_past_the_heads_along_the_long_context_branch():
    """The adaptive policy's chain builder extends the heads' chain with the same rule as
    the n-gram-only chains: the continuation of the last long_n tokens (here the branch
    9), not the most frequent 2-token continuation (5)."""
    from vllm_tokenswift.core.chain import build_chain

    table = NGramTable(3, long_n=4)
    table.extend([7, 8, 3, 4, 5, 0, 7, 8, 3, 4, 5, 0, 1, 2, 3, 4, 9, 0, 1, 2, 3])
    # one draft distribution, certain of 4; the chain continues from (1, 2, 3, 4)
    ch = build_chain(table.tokens[-4:], [[4]], probs_from([{4: 1.0}]), table, [[]], max_len=4,
                     min_conf=0.01, escape=True)
    assert ch.tokens == [4, 9, 0, 1]
    assert ch.sources == [SOURCE_HEADS, SOURCE_NGRAM, SOURCE_NGRAM, SOURCE_NGRAM]
    # q of the head token mixes p = 1 with the n-gram frequency of 4 after (2, 3): 1.0
    # 9: (1, 2, 3, 4) never recurred; the 4-token contexts' rate: 3 recurrences, 2 followed
    # as before, (2 + 1) / (3 + 2) = 3/5
    assert table.level_record[4] == [3, 2]
    assert ch.confs == pytest.approx([1.0, 3 / 5, 1.0, 1.0])
    assert ch.expected_len == pytest.approx(1.0 + 3 * 3 / 5)


def _reference_select_chain(context, tree, prob, table, ngram_topk, max_len, min_conf, mix):
    """select_chain as it was before the depth-first tree search: every path of the tree
    scored separately, and the O(k²·n) back-off frequencies (the exhaustive definition)."""
    import itertools

    from vllm_tokenswift.core.chain import Chain, extend_chain, within_frequencies

    num_dists = len(tree)
    use_ng = table is not None and ngram_topk > 0
    tab = table if use_ng else None
    best_tokens, best_src_ng, best_back, best_score = [], False, None, -1.0
    for path in itertools.product(*[tree[d] for d in range(min(num_dists, max_len))]):
        s, _ = score_chain(path, context, prob, tab, num_dists, mix)
        if s > best_score:
            best_score, best_tokens, best_src_ng = s, list(path), False
    if use_ng:
        for skip, first in ((False, tree[0][0]), (True, context[-1])):
            grams = table.topk(first, ngram_topk)
            for gram, _ in grams:
                cand = list(gram[1:] if skip else gram)[:max_len]
                back = within_frequencies(grams, gram, skip)
                s, _ = score_chain(cand, context, prob, tab, num_dists, mix, back)
                if s > best_score:
                    best_score, best_tokens, best_src_ng, best_back = s, cand, True, back
    chain = Chain(best_tokens, [SOURCE_NGRAM if best_src_ng else SOURCE_HEADS] * len(best_tokens),
                  best_score)
    if use_ng and len(best_tokens) < max_len:
        _, qs = score_chain(best_tokens, context, prob, tab, num_dists, mix, best_back)
        cum = 1.0
        for q in qs:
            cum *= q
        extend_chain(chain, context, table, max_len, min_conf, cum, prob, num_dists, mix)
    return chain


@pytest.mark.parametrize("seed", range(40))
def test_select_chain_equals_exhaustive_reference(seed):
    """The depth-first tree search and the O(k·n) back-off frequencies give exactly the
    chain (tokens, sources, expected length as a float) of the exhaustive search."""
    import random

    rng = random.Random(seed)
    vocab = rng.randint(3, 12)               # small vocabularies: many repeats and ties
    n = rng.choice([2, 3, 4])
    hist = [rng.randrange(vocab) for _ in range(rng.randint(0, 300))]
    table = NGramTable(n)
    table.extend(hist)
    context = hist[-20:] if len(hist) >= 2 else [rng.randrange(vocab), rng.randrange(vocab)]
    widths = [1] + [rng.randint(0, 4) if rng.random() < 0.1 else rng.randint(1, 4) for _ in range(3)]
    tree = [rng.sample(range(vocab), min(w, vocab)) for w in widths]
    dists = [{t: rng.choice([0.0, 0.1, 0.25, 0.5, rng.random()]) for t in range(vocab)} for _ in tree]
    prob = probs_from(dists)
    topk = rng.choice([0, 2, 5])
    max_len = rng.randint(1, 8)
    want = _reference_select_chain(context, tree, prob, table, topk, max_len, 0.3, 0.5)
    got = select_chain(context, tree, prob, table, topk, max_len, min_conf=0.3, mix=0.5)
    assert (got.tokens, got.sources, got.expected_len) == (want.tokens, want.sources, want.expected_len)
