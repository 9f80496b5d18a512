"""Unit tests of the per-request n-gram table (token reutilization, Sec 3.2)."""

import random
from collections import Counter

import pytest

from vllm_tokenswift.core.ngram import NGramTable, _SortedByCount


def brute_counts(tokens, n):
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def test_counts_and_topk_order_exact():
    t = NGramTable(3)
    toks = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3]
    t.extend(toks)
    assert t.count([1, 2, 3]) == 3
    assert t.count([1, 2, 4]) == 1
    assert t.count([2, 3, 1]) == 2
    assert t.num_ngrams == len(brute_counts(toks, 3))
    assert t.topk(1, 5) == [((1, 2, 3), 3), ((1, 2, 4), 1)]
    assert t.topk(1, 1) == [((1, 2, 3), 3)]
    assert t.topk(7, 5) == []
    assert t.topk(1, 0) == []


def test_incremental_equals_batch_and_bruteforce():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(5000)]
    inc = NGramTable(4)
    for i in range(0, len(toks), 37):  # uneven increments, like accepted chunks
        inc.extend(toks[i:i + 37])
    batch = NGramTable(4)
    batch.extend(toks)
    ref = brute_counts(toks, 4)
    assert inc.counts == batch.counts == dict(ref)
    for first in range(6):
        got = inc.topk(first, 1000)
        exp = sorted((c for g, c in ref.items() if g[0] == first), reverse=True)
        assert [c for _, c in got] == exp  # sorted by count, all present
        assert {g for g, _ in got} == {g for g in ref if g[0] == first}
        assert inc.topk(first, 3) == got[:3]


def test_sync_indexes_only_new_tokens():
    t = NGramTable(2)
    assert t.sync([5, 6, 7]) == 3
    assert t.sync([5, 6, 7]) == 0
    assert t.sync([5, 6, 7, 5, 6]) == 2
    assert len(t) == 5
    assert t.count([5, 6]) == 2


def test_cond_prob_and_best_next():
    t = NGramTable(3)
    t.extend([9, 1, 2, 3, 1, 2, 3, 1, 2, 4])
    # context (1, 2) continues with 3 twice and 4 once
    assert t.cond_prob([0, 1, 2], 3) == pytest.approx(2 / 3)
    assert t.cond_prob([1, 2], 4) == pytest.approx(1 / 3)
    assert t.cond_prob([1, 2], 5) == 0.0
    assert t.cond_prob([2], 3) == 0.0  # context shorter than n-1
    tok, f = t.best_next([7, 1, 2])
    assert (tok, f) == (3, pytest.approx(2 / 3))
    assert t.best_next([8, 8]) is None
    # with the escape count: 2 / (3 + 1); (3, 1), seen twice, always followed by 2: 2/3
    assert t.best_next([7, 1, 2], escape=True) == (3, pytest.approx(2 / 4))
    assert t.best_next([3, 1], escape=True) == (2, pytest.approx(2 / 3))
    assert t.best_next([3, 1]) == (2, pytest.approx(1.0))
    assert t.best_next([8, 8], escape=True) is None


def test_invalid_order():
    with pytest.raises(ValueError):
        NGramTable(1)


def test_recent_next_follows_the_latest_occurrence_of_the_long_context():
    """``recent_next``: the token after the latest earlier occurrence of the last ``long_n``
    tokens, or at a branch point the most frequent of the tokens that followed them, with
    the larger of that token's n-gram conditional frequency and the long context's own
    record, whose prior is the record of all contexts of that length; None for an unseen
    long context, a short context or ``long_n`` 0."""
    t = NGramTable(3, long_n=4)
    # 1 2 3 4 is followed by 5 twice, then by 9 (the latest); (3, 4) alone is followed by
    # 5 twice and 9 once
    t.extend([1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 9, 0])
    assert t.best_next([3, 4]) == (5, pytest.approx(2 / 3))
    # (1, 2, 3, 4) recurred twice; "the branch taken last time" was taken again once
    # (5 after 5), not the second time (9 after 5). All 4-token contexts together
    # recurred 7 times and were followed as before 6 times (only (1, 2, 3, 4) -> 9
    # broke the rule): rate (6 + 1) / (7 + 2) = 7/9, so the record is
    # (1 + 2·7/9) / (2 + 2) = 23/36 for "5 followed it again" (count 2, less 1)
    assert t.after_record[(1, 2, 3, 4)] == (2, 1)
    assert t.level_record[4] == [7, 6] and t.level_rate(4) == pytest.approx(7 / 9)
    assert t.level_record[8] == [3, 2] and t.level_record[16] == [0, 0]
    # a branch point: 5 followed (1, 2, 3, 4) twice, 9 once (the latest); the most
    # frequent wins, with the better of its n-gram frequency 2/3 and the record 23/36
    assert t.after_branches == {(1, 2, 3, 4): {5: 2, 9: 1}}
    assert t.recent_next([0, 1, 2, 3, 4]) == (5, pytest.approx(2 / 3))
    assert t.after[(1, 2, 3, 4)] == 16 and t.tokens[16] == 9
    assert t.recent_next([7, 2, 3, 4]) is None          # these 4 tokens never occurred
    assert t.recent_next([3, 4]) is None                # shorter than long_n
    assert t.recent_next([2, 3, 4, 9, 0]) is None        # occurred, but as the newest tokens only
    assert NGramTable(3, long_n=0).recent_next([1, 2, 3, 4]) is None
    with pytest.raises(ValueError, match="long_n"):
        NGramTable(4, long_n=3)


def test_recent_next_branch_counts_ties_go_to_the_latest_and_longer_contexts_count_too():
    """Branch counts start when a context is first followed by a second token (its first
    token then counts every earlier occurrence); among equally frequent continuations the
    latest wins; the longer contexts (hash-keyed) keep their own counts and win over a
    branch point of the shorter context."""
    t = NGramTable(2, long_n=2)
    t.extend([1, 2, 7, 1, 2, 7, 1, 2, 8])
    assert t.after_branches == {(1, 2): {7: 2, 8: 1}}      # (2, 7), (7, 1): one continuation
    assert t.after_record[(1, 2)] == (2, 1)
    # 7 followed (1, 2) twice: record (2 - 1 + 2·ρ) / (2 + 2); n-gram frequency of 7 after 2
    assert t.recent_next([0, 1, 2]) == (7, pytest.approx(max(2 / 3, (1 + 2 * t.level_rate(2)) / 4)))
    t.extend([1, 2, 8])                  # 7 and 8 now twice each: the latest (8) wins
    assert t.after_branches[(1, 2)] == {7: 2, 8: 2}
    assert t.recent_next([0, 1, 2])[0] == 8
    u = NGramTable(2, long_n=2)
    u.extend([5, 6, 1, 2, 7, 9, 6, 1, 2, 8, 5, 6, 1, 2, 7, 4, 6, 1, 2])
    # (1, 2) was followed by 7, 8, 7; (2, 7) and the 4-token context (6, 1, 2, 7) by 9, then 4
    assert u.after_branches == {(1, 2): {7: 2, 8: 1}, (2, 7): {9: 1, 4: 1}}
    assert u.longer_branches[0] == {}                              # 8-token contexts
    assert list(u.longer_branches[1].values()) == [{9: 1, 4: 1}]   # 4-token contexts
    assert u.recent_next([0, 1, 2])[0] == 7           # the 2-token branch point's most frequent
    assert u.recent_next([9, 6, 1, 2])[0] == 8        # the 4-token match wins over it
    assert u.recent_next([6, 1, 2, 7])[0] == 4        # a tie at the 4-token level: the latest


def test_recent_next_confidence_grows_with_an_exact_loop():
    """A loop the 2-token n-gram context cannot tell apart (after (1, 2): 3, 4, 3, 4, ...
    alternate at the same 2-token context), but whose 4-token context always repeats
    its branch: the rule's record, not the n-gram frequency, gives the confidence."""
    t = NGramTable(3, long_n=4)
    loop = [1, 2, 3, 0, 1, 2, 4, 0]
    t.extend(loop * 6)
    tok, f = t.recent_next(t.tokens)
    nxt = t.tokens[len(loop) * 6 - len(loop)]  # what followed the last occurrence
    assert tok == nxt == 1
    ctx_tok, ctx_f = t.recent_next(t.tokens + [1, 2])   # (0, 1, 2) ambiguous for n = 3
    assert t.cond_prob([1, 2], ctx_tok) == pytest.approx(0.5, abs=0.1)
    seen, hits = t.after_record[tuple((t.tokens + [1, 2])[-4:])]
    assert hits == seen and seen >= 4
    # the longest context that occurred before (4·long_n = 16 tokens, two loop periods)
    # answers, with its own record (3 of 3) and the 16-token level's rate as prior:
    # every 16-token context that recurred (24) was followed as before
    seen16, hits16 = t.longer_record[0][hash(tuple((t.tokens + [1, 2])[-16:]))]
    assert (seen16, hits16) == (3, 3)
    assert t.level_record[16] == [24, 24] and t.level_rate(16) == pytest.approx(25 / 26)
    assert ctx_f == pytest.approx((3 + 2 * 25 / 26) / (3 + 2))
    assert ctx_f >= 0.98


def test_short_next_backs_off_to_shorter_contexts_with_their_own_record():
    """``short_next``: for contexts the (n-1)-gram never saw, the token after the latest
    earlier occurrence of the last 2 tokens, else of the last 1 (n = 4), with confidence
    hits / (repeats + 1) from that short context's own record once it recurred, before
    that the rate of all short contexts of its length."""
    t = NGramTable(4, long_n=8)
    assert t.short_lens == (2, 1)
    # (3, 4) is followed by 5, 5, then 6; 7 is followed by 8 once
    t.extend([3, 4, 5, 1, 3, 4, 5, 2, 3, 4, 6, 7, 8])
    assert t.short_record[0][(3, 4)] == (2, 1)    # recurred twice, same branch once
    assert t.short_next([0, 3, 4]) == (6, pytest.approx(1 / 3))
    assert t.best_next([0, 3, 4]) is None          # the 3-token context (0, 3, 4) is unseen
    # no 2-token match for (9, 7): the 1-token context 7 (seen once, never recurred)
    # gets the rate of all 1-token contexts: 5 recurrences (3, 4, 5, 3, 4), 3 followed as
    # before -> (3 + 1) / (5 + 2)
    assert t.short_record[1].get((7,)) is None
    assert t.level_record[1] == [5, 3] and t.level_record[2] == [3, 1]
    assert t.short_next([9, 7]) == (8, pytest.approx(4 / 7))
    assert t.short_next([9, 9]) is None
    assert NGramTable(4, short=False).short_lens == ()
    assert NGramTable(3).short_lens == (1,) and NGramTable(2).short_lens == ()


def test_ngram_chain_trusts_a_short_context_as_far_as_its_record_or_its_length_earned():
    """A chain falls back on a short context with that context's own record once it
    recurred; a context seen once gets the rate of all contexts of its length in this
    request, so it drafts where short contexts were followed as before and stops at the
    floor where they were not."""
    from vllm_tokenswift.core.chain import ngram_chain

    t = NGramTable(4)
    t.extend([1, 2, 9, 5, 1, 2, 9, 6, 1, 2, 9])
    # (7, 1, 2) never occurred; (1, 2) was followed by 9 every time: record (2, 2) -> 2/3
    ch = ngram_chain([7, 1, 2], t, max_len=1, min_conf=0.05, escape=True)
    assert ch.tokens == [9] and ch.confs == [pytest.approx(2 / 3)]
    # a fresh request: (1, 2) seen once, no short context recurred yet: rate 1/2; then
    # the 3-token context (1, 2, 9), seen once, followed by 5: 1 / (1 + 1) with the
    # escape count, 1/1 without
    fresh = NGramTable(4)
    fresh.extend([1, 2, 9, 5])
    ch = ngram_chain([7, 1, 2], fresh, max_len=2, min_conf=0.05, escape=True)
    assert ch.tokens == [9, 5] and ch.confs == [pytest.approx(0.5), pytest.approx(0.5)]
    ch = ngram_chain([7, 1, 2], fresh, max_len=2, min_conf=0.05, escape=False)
    assert ch.tokens == [9, 5] and ch.confs == [pytest.approx(0.5), pytest.approx(1.0)]
    # (1, 2) recurred three times with a new successor each time: 2-token contexts are
    # followed as before at rate (0 + 1) / (3 + 2); (8, 9), seen once, gets that 1/5
    branchy = NGramTable(4)
    branchy.extend([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 8, 9, 10, 0])
    assert branchy.level_record[2] == [3, 0]
    assert ngram_chain([7, 8, 9], branchy, max_len=2, min_conf=0.3, escape=True).tokens == []
    ch = ngram_chain([7, 8, 9], branchy, max_len=2, min_conf=0.09, escape=True)
    assert ch.tokens == [10, 0] and ch.confs == [pytest.approx(0.2), pytest.approx(0.5)]
    assert ngram_chain([7, 8, 9], branchy, max_len=2, min_conf=0.11, escape=True).tokens == [10]


def test_recent_next_tells_a_repeated_phrase_apart_by_the_longer_context():
    """A loop that says the same 8-token phrase twice per period, followed once by 7 and
    once by 9 (seen at 6K tokens of SmolLM2's greedy output: chains were cut at that
    point every period): the last 8 tokens alone alternate between the branches and
    their record falls to about 1/2, the 16-token context always knows the branch."""
    phrase = [1, 2, 3, 4, 5, 6, 7, 8]
    period = phrase + [70] + [20, 21, 22] + phrase + [90] + [30, 31]
    t = NGramTable(4)            # long_n 8, longer contexts 16 and 32
    assert t.longer_lens == (32, 16) and t.context_len == 32
    t.extend(period * 12)
    for cut in range(len(period)):    # predict every position of the next period
        ctx = t.tokens + period[:cut]
        tok, f = t.recent_next(ctx)
        assert tok == period[cut], cut
        assert f > 0.9
    seen, hits = t.after_record[tuple(phrase)]
    assert hits == 0 and seen > 10            # the 8-token context alone: always the other branch
    only8 = NGramTable(4)
    only8.longer_lens, only8.longer_after, only8.longer_record = (), [], []
    only8.extend(period * 12)
    # without the longer contexts: the phrase is a branch point followed 12 times by 70
    # and 12 times by 90 (the latest wins the tie); its record is how often that
    # continuation followed it again, (12 - 1 + 2·ρ8) / (23 + 2), about 1/2 like the
    # 3-gram frequency, although 8-token contexts of this loop are mostly followed as before
    assert only8.after_record[tuple(phrase)] == (23, 0) and only8.level_rate(8) > 0.9
    assert only8.after_branches[tuple(phrase)] == {70: 12, 90: 12}
    assert only8.recent_next(t.tokens + period[:12] + phrase) == (
        90, pytest.approx((11 + 2 * only8.level_rate(8)) / 25))


def _reference_extend(t: NGramTable, new_tokens) -> None:
    """The per-key rules of NGramTable.extend, one token at a time, each context key
    sliced from the token list on its own (the implementation before the one-window
    version; kept as the specification the fast one must reproduce exactly)."""
    n, L, toks = t.n, t.long_n, t.tokens
    levels = t.level_record

    def count_branch(branches, key, prev_tok, tok, seen):
        br = branches.get(key)
        if br is not None:
            br[tok] = br.get(tok, 0) + 1
        elif tok != prev_tok:
            branches[key] = {prev_tok: seen + 1, tok: 1}

    def rule(d, rec, key, tok, m, branches=None):
        prev = d.get(key)
        if prev is not None:
            seen, hits = rec.get(key, (0, 0))
            hit = toks[prev] == tok
            rec[key] = (seen + 1, hits + hit)
            if branches is not None:
                count_branch(branches, key, toks[prev], tok, seen)
            levels[m][0] += 1
            levels[m][1] += hit
        d[key] = len(toks)

    for tok in new_tokens:
        tok = int(tok)
        if L and len(toks) >= L:
            rule(t.after, t.after_record, tuple(toks[-L:]), tok, L, t.after_branches)
            for m, d, rec, br in zip(t.longer_lens, t.longer_after, t.longer_record, t.longer_branches):
                if len(toks) >= m:
                    rule(d, rec, hash(tuple(toks[-m:])), tok, m, br)
        for m, d, rec in zip(t.short_lens, t.short_after, t.short_record):
            if len(toks) >= m:
                rule(d, rec, tuple(toks[-m:]), tok, m)
        toks.append(tok)
        if len(toks) < n:
            continue
        gram = tuple(toks[-n:])
        c = t.counts.get(gram, 0) + 1
        t.counts[gram] = c
        lst = t.by_first.get(gram[0])
        if lst is None:
            lst = t.by_first[gram[0]] = _SortedByCount(t.counts)
        if c == 1:
            lst.add_new(gram)
        else:
            lst.increment(gram, c)
        ctx = gram[:-1]
        t.ctx_counts[ctx] = t.ctx_counts.get(ctx, 0) + 1
        best = t.ctx_best.get(ctx)
        if best is None or c > best[1] or best[0] == gram[-1]:
            t.ctx_best[ctx] = (gram[-1], c)


def _state(t: NGramTable) -> dict:
    return {name: getattr(t, name) for name in NGramTable.__slots__ if name != "by_first"} | {
        "by_first": {k: (v.items, v.pos, v.start) for k, v in t.by_first.items()}}


@pytest.mark.parametrize("n, long_n, short", [(4, None, True), (3, 3, True), (5, 0, False), (2, 8, True)])
def test_extend_reproduces_the_per_key_reference_exactly(n, long_n, short):
    rng = random.Random(n * 100 + (long_n or 0))
    loop = [rng.randrange(40) for _ in range(37)]
    text = [rng.randrange(6) for _ in range(1500)]                   # many short repeats
    text += loop * 20                                                # an exact loop
    text += [x if rng.random() > 0.1 else rng.randrange(40) for x in loop * 15]   # a noisy loop
    fast, ref = NGramTable(n, long_n, short), NGramTable(n, long_n, short)
    i = 0
    while i < len(text):                                             # uneven chunks
        k = rng.choice([1, 1, 3, 8, 64])
        fast.extend(text[i:i + k])
        _reference_extend(ref, text[i:i + k])
        i += k
    assert _state(fast) == _state(ref)
    assert len(fast.after_branches) > 0 and sum(len(d) for d in fast.longer_branches) > 0 or not fast.long_n
    ctx = text[-fast.context_len:]
    assert fast.recent_next(ctx) == ref.recent_next(ctx)
    assert fast.short_next(ctx[-3:]) == ref.short_next(ctx[-3:])
