"""From TokenSwift's candidates to the one draft chain vLLM verifies (paper Sec 3.2).

The paper verifies a tree: ``[1, 3, 3, 3]`` candidates from ``l_0..l_3`` plus the
top-k n-grams that start with ``argmax l_0``, with tree attention. vLLM 0.32's
rejection sampler verifies one chain per request, so this module picks, from
the same candidate set, the chain with the highest *estimated expected
accepted length*.

Estimator (documented in the README, "Chain selection"). For a chain
``c_1..c_L`` drafted after the newest token ``x``::

    q_i = λ·p_i(c_i) + (1-λ)·f(c_i | ctx_i)   if i <= D and the n-gram context ctx_i was seen
        = p_i(c_i)                             if i <= D and it was not (or n-grams are off)
        = f(c_i | ctx_i)                       if i >  D (n-gram extension past the heads)
    E[accepted] = Σ_{j=1..L} Π_{i<=j} q_i

``p_i`` is the draft distribution at depth i (``l_{i-1}`` after the request's
penalty, temperature and min_p), ``f`` the n-gram table's conditional frequency
of ``c_i`` after the previous ``n-1`` tokens of ``history + x + c_<i`` (backing
off, for a retrieved n-gram whose full context was never seen, to its frequency
among the retrieved n-grams that share its prefix: :func:`within_frequencies`), ``D`` the
number of draft distributions and ``λ`` = 0.5. Under the usual independence
assumption, ``Π_{i<=j} q_i`` is the probability that the first ``j`` drafts are
all accepted, so the sum is the expected number of accepted drafts.

Candidates: every path of the tree (``Π tree[i]`` paths), the top-k n-grams
starting with ``argmax l_0`` (paper) and the top-k n-grams starting with ``x``
(their tail; the token ``x`` is already certain). The winner is then extended
with the table's most frequent continuations while the cumulative acceptance
estimate stays at least ``min_conf``, up to ``max_len`` tokens.

Any chain built only from the context is lossless: vLLM treats custom drafts as
point masses and its rejection sampler decides acceptance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_tokenswift.core.ngram import NGramTable

#: weight λ of the draft distribution against the n-gram frequency
DEFAULT_MIX = 0.5

SOURCE_HEADS = 0   # l_0..l_3 of the draft forward
SOURCE_NGRAM = 1   # n-gram table
SOURCE_FUSED = 2   # heads applied to the verification forward's hidden state (no draft forward)
SOURCE_CHAIN = 3   # l_0 of each forward of a self-speculative chain (the target over its view)


@dataclass
class Chain:
    """A chosen draft chain.

    Attributes:
        tokens: draft token ids ``c_1..c_L`` (L <= max_len).
        sources: per token, :data:`SOURCE_HEADS`, :data:`SOURCE_FUSED` or
            :data:`SOURCE_NGRAM` (which predictor put it in the chain; for metrics:
            n-gram acceptance β, and for the policy's calibration).
        expected_len: the estimator's expected accepted length E[accepted].
        confs: per token, the estimator's own acceptance estimate ``q_i`` (the
            drafting policy calibrates it against measured acceptance); may be empty
            for chains built by :func:`select_chain`.
    """

    tokens: list[int]
    sources: list[int]
    expected_len: float
    confs: list[float] = field(default_factory=list)

    def truncate(self, n: int) -> "Chain":
        """Keep the first ``n`` tokens (in place); returns self."""
        del self.tokens[n:], self.sources[n:], self.confs[n:]
        return self


def mix_estimate(p: float | None, f: float | None, mix: float = DEFAULT_MIX) -> float:
    """One token's acceptance estimate ``q`` (module doc): ``λ·p + (1-λ)·f`` when both the
    draft probability ``p`` and the n-gram frequency ``f`` are known, the known one
    alone otherwise, 0 when neither is."""
    if p is None:
        return f if f is not None else 0.0
    return p if f is None else mix * p + (1.0 - mix) * f


def score_chain(chain: Sequence[int], context: list[int], prob: Callable[[int, int], float | None],
                table: NGramTable | None, num_dists: int, mix: float = DEFAULT_MIX,
                backoff: Sequence[float | None] | None = None) -> tuple[float, list[float]]:
    """Expected accepted length of ``chain`` and its per-token q_i (see module doc).

    Args:
        chain: draft tokens ``c_1..c_L``.
        context: the request's tokens up to and including ``x`` (only the last
            ``n-1`` are read).
        prob: ``prob(depth, token)`` -> ``p_depth(token)`` or None if unknown.
        table: the request's n-gram table, or None when n-grams are off.
        num_dists: D, the number of draft distributions.
        backoff: per chain position, an n-gram frequency to use when the full
            ``(n-1)``-token context was never seen (see :func:`within_frequencies`).
    """
    m = table.n - 1 if table is not None else 0
    tail = list(context[-m:]) if m else []
    cum = 1.0
    total = 0.0
    qs = []
    for i, tok in enumerate(chain):
        f = None
        if table is not None:
            ctx = tuple(tail[-m:])
            cnt = table.ctx_counts.get(ctx) if len(ctx) == m else None
            if cnt:
                f = table.counts.get(ctx + (tok,), 0) / cnt
            elif backoff is not None and i < len(backoff):
                f = backoff[i]
        q = mix_estimate(prob(i, tok) if i < num_dists else None, f, mix)
        cum *= q
        total += cum
        qs.append(q)
        if m:
            tail.append(tok)
    return total, qs


def within_frequencies(grams: Sequence[tuple[tuple[int, ...], int]], gram: tuple[int, ...],
                       skip_first: bool) -> list[float | None]:
    """Back-off frequencies of ``gram``'s tokens among the retrieved n-grams.

    ``f_i = S(g_1..g_i) / S(g_1..g_{i-1})`` where ``S(prefix)`` sums the counts of the
    retrieved n-grams (all sharing ``g_1``) that start with ``prefix``: the
    paper's top-k frequency statistics, conditioned on the chain so far. With
    ``skip_first`` (n-grams keyed on the newest token ``x``) the chain is
    ``g_2..g_n``; otherwise position 1 (``g_1 = argmax l_0``) gets None.
    """
    out: list[float | None] = [] if skip_first else [None]
    for i in range(2, len(gram) + 1):
        den = sum(c for g, c in grams if g[: i - 1] == gram[: i - 1])
        num = sum(c for g, c in grams if g[:i] == gram[:i])
        out.append(num / den if den else None)
    return out


def select_chain(context: list[int], tree_tokens: Sequence[Sequence[int]],
                 prob: Callable[[int, int], float | None], table: NGramTable | None,
                 ngram_topk: int, max_len: int, min_conf: float = 0.3,
                 mix: float = DEFAULT_MIX) -> Chain:
    """Pick the draft chain with the highest estimated expected accepted length.

    Args:
        context: request tokens so far, ending with the newest token ``x``.
        tree_tokens: per depth d (0..D-1), the top ``tree[d]`` tokens of the draft
            distribution ``l_d`` (most probable first); ``tree_tokens[0][0]`` is
            ``argmax l_0``.
        prob: ``prob(d, token)`` gives ``p_d(token)`` (None if not available).
        table: the request's n-gram table (None or ``ngram_topk == 0``: no n-grams).
        ngram_topk: k, n-grams retrieved per first token.
        max_len: longest chain (``num_speculative_tokens``).
        min_conf: stop n-gram extension when the cumulative estimate drops below this.
    Returns:
        :class:`Chain` (at least one token when ``max_len >= 1``).
    """
    num_dists = len(tree_tokens)
    use_ng = table is not None and ngram_topk > 0
    tab = table if use_ng else None
    best_tokens: list[int] = []
    best_src_ng = False
    best_back: list[float | None] | None = None
    best_score = -1.0

    depth = min(num_dists, max_len)
    best_score, best_tokens = _best_tree_path(tree_tokens, depth, context, prob, tab, num_dists, mix)

    if use_ng:
        cands: list[tuple[list[int], list[float | None]]] = []
        for skip, first in ((False, tree_tokens[0][0]), (True, context[-1])):
            grams = table.topk(first, ngram_topk)
            freq = backoff_frequencies(grams)     # == within_frequencies for every gram
            for gram, _cnt in grams:
                chain = list(gram[1:] if skip else gram)[:max_len]
                back = [] if skip else [None]
                back += [freq[gram[:i]] for i in range(2, len(gram) + 1)]
                cands.append((chain, back))
        for cand, back in cands:
            s, _ = score_chain(cand, context, prob, tab, num_dists, mix, back)
            if s > best_score:
                best_score, best_tokens, best_src_ng, best_back = s, cand, True, back

    sources = [SOURCE_NGRAM if best_src_ng else SOURCE_HEADS] * len(best_tokens)
    chain = Chain(best_tokens, sources, best_score)
    if use_ng and len(best_tokens) < max_len:
        _, qs = score_chain(best_tokens, context, prob, tab, num_dists, mix, best_back)
        cum = 1.0
        for q in qs:
            cum *= q
        extend_chain(chain, context, table, max_len, min_conf, cum, prob, num_dists, mix)
    return chain


def _best_tree_path(tree_tokens: Sequence[Sequence[int]], depth: int, context: list[int],
                    prob: Callable[[int, int], float | None], table: NGramTable | None,
                    num_dists: int, mix: float) -> tuple[float, list[int]]:
    """The path through the token tree (one token of ``tree_tokens[d]`` per depth ``d <
    depth``) with the largest :func:`score_chain` score, and that score (``-1.0, []``
    when a level is empty).

    Same result as scoring every path of ``itertools.product`` with
    :func:`score_chain` (same floating-point operations in the same order, first
    maximum kept), but level by level: each tree node's estimate ``q`` and its n-gram
    lookups are computed once instead of once per path through it (39 instead of 81
    for the paper's ``[1, 3, 3, 3]`` tree), ``p_d(c)`` once per depth and token (it does
    not depend on the path), and the paths of the last level are compared in
    ``itertools.product`` order."""
    m = table.n - 1 if table is not None else 0
    counts = table.counts if table is not None else None
    ctx_counts = table.ctx_counts if table is not None else None
    # a node: (path, Π q so far, Σ of the prefixes' Π q, the last m tokens before its children)
    nodes: list[tuple[tuple[int, ...], float, float, tuple[int, ...]]] = [
        ((), 1.0, 0.0, tuple(context[-m:]) if m else ())]
    for i in range(depth):
        toks = tree_tokens[i]
        ps = [prob(i, tok) if i < num_dists else None for tok in toks]
        nxt = []
        for path, cum, total, tail in nodes:
            cnt = ctx_counts.get(tail) if ctx_counts is not None and len(tail) == m else None
            for tok, p in zip(toks, ps):
                q = mix_estimate(p, counts.get(tail + (tok,), 0) / cnt if cnt else None, mix)
                c = cum * q
                nxt.append((path + (tok,), c, total + c, (tail + (tok,))[-m:] if m else tail))
        nodes = nxt
    best_total, best_path = -1.0, ()
    for path, _cum, total, _tail in nodes:
        if total > best_total:
            best_total, best_path = total, path
    return best_total, list(best_path)


def extend_chain(chain: Chain, context: list[int], table: NGramTable, max_len: int, min_conf: float,
                 cum: float = 1.0, prob: Callable[[int, int], float | None] | None = None,
                 num_dists: int = 0, mix: float = DEFAULT_MIX, recent: bool = False,
                 escape: bool = False) -> Chain:
    """Append the table's most frequent continuations to ``chain`` (in place) while the
    cumulative acceptance estimate stays >= ``min_conf``, up to ``max_len`` tokens.

    Args:
        cum: the estimate ``Π q_i`` of the chain so far (1.0 for an empty chain).
        prob: draft distributions for depths below ``num_dists`` (mixed in with λ).
        recent: prefer the continuation of the last 32, 16 or ``table.long_n`` tokens
            (:meth:`NGramTable.recent_next`: the token after their latest earlier
            occurrence, or at a branch point their most frequent continuation; ``context``
            must then hold :attr:`NGramTable.context_len` tokens) over the most frequent n-gram continuation, and back
            off to the short contexts (:meth:`NGramTable.short_next`) when neither is known.
        escape: the most frequent continuation's confidence keeps one count for a
            continuation not seen yet (:meth:`NGramTable.best_next` with ``escape``).
    Each appended token adds its estimate to ``expected_len`` (``+= Π q_i``) and, when
    the chain keeps one confidence per token (``len(confs) == len(tokens)``), its own
    ``q_i`` to ``confs``.
    """
    track = len(chain.confs) == len(chain.tokens)
    keep = table.context_len if recent else table.n - 1
    ext_ctx = list(context[-keep:]) + chain.tokens
    while len(chain.tokens) < max_len:
        nxt = ((table.recent_next(ext_ctx) if recent else None) or table.best_next(ext_ctx, escape)
               or (table.short_next(ext_ctx) if recent else None))
        if nxt is None:
            break
        tok, f = nxt
        d = len(chain.tokens)
        if prob is not None and d < num_dists:
            f = mix_estimate(prob(d, tok), f, mix)
        if cum * f < min_conf:
            break
        cum *= f
        chain.expected_len += cum
        chain.tokens.append(tok)
        chain.sources.append(SOURCE_NGRAM)
        if track:
            chain.confs.append(f)
        ext_ctx.append(tok)
    return chain


def ngram_chain(context: list[int], table: NGramTable, max_len: int, min_conf: float,
                escape: bool = False) -> Chain:
    """Chain from the n-gram table alone (no draft forward): repeatedly, the continuation
    of the longest matched long context (:meth:`NGramTable.recent_next`: the token after
    its latest earlier occurrence, or at a branch point its most frequent continuation),
    else the most frequent continuation of the last ``n-1`` tokens, else the token after
    the latest occurrence of the last 2 or 1 tokens (:meth:`NGramTable.short_next`), while
    ``Π f_i >= min_conf`` (``f_i``: the confidence of the token taken). ``expected_len`` is
    ``Σ_j Π_{i<=j} f_i``; ``confs`` holds each ``f_i``. ``context``: the request's tokens
    up to the newest (at least the last :attr:`NGramTable.context_len`). ``escape``: the
    most frequent continuation's confidence is ``c / (t + 1)`` rather than ``c / t``
    (:meth:`NGramTable.best_next`; ``policy_tuning.ngram_escape``)."""
    return extend_chain(Chain([], [], 0.0), context, table, max_len, min_conf, recent=True,
                        escape=escape)


#: a request's n-gram chain is built down to this cumulative frequency (the policy cuts it)
NGRAM_FLOOR = 0.05


def ngram_escape(tuning, sampled: bool) -> bool:
    """Whether a request's n-gram chains score a 3-token context's most frequent
    continuation ``c / (t + 1)`` (``policy_tuning.ngram_escape``: True, False, or
    ``"sampled"``: for sampled requests only)."""
    esc = tuning.ngram_escape
    return esc is True or (esc == "sampled" and sampled)


def request_ngram_chain(table: NGramTable, context: list[int], room: int, sampled: bool, tuning) -> Chain:
    """A request's n-gram chain after ``context`` (its tokens up to the newest, at least the
    table's :attr:`~vllm_tokenswift.core.ngram.NGramTable.context_len`), at most ``room``
    tokens, built down to :data:`NGRAM_FLOOR` (the policy cuts it), with the escape count
    where ``policy_tuning.ngram_escape`` asks for it (:func:`ngram_escape`)."""
    return ngram_chain(context, table, room, NGRAM_FLOOR, ngram_escape(tuning, sampled))


# ------------------------------------------------------------------ fast path (adaptive policy)
def backoff_frequencies(grams: Sequence[tuple[tuple[int, ...], int]]) -> dict[tuple[int, ...], float]:
    """For every prefix ``g_1..g_i`` (i >= 2) of the retrieved n-grams, the frequency
    ``S(g_1..g_i) / S(g_1..g_{i-1})`` (``S`` sums counts of retrieved n-grams with that
    prefix): :func:`within_frequencies` for all grams at once, in O(k·n) instead of
    O(k²·n)."""
    sums: dict[tuple[int, ...], int] = {}
    for g, c in grams:
        for i in range(1, len(g) + 1):
            pre = g[:i]
            sums[pre] = sums.get(pre, 0) + c
    out = {}
    for pre, s_i in sums.items():
        if len(pre) >= 2:
            den = sums.get(pre[:-1], 0)
            out[pre] = s_i / den if den else 0.0
    return out


def build_chain(context: Sequence[int], top_tokens: Sequence[Sequence[int]],
                prob: Callable[[int, int], float | None], table: NGramTable | None,
                grams: Sequence[Sequence[tuple[tuple[int, ...], int]]], max_len: int,
                source: int = SOURCE_HEADS, mix: float = DEFAULT_MIX, min_conf: float = 0.05,
                skip_first_gram: Sequence[bool] = (), escape: bool = False) -> Chain:
    """Best draft chain from ``D`` draft distributions plus n-gram candidates, in
    O(D·w + k·n) dictionary lookups (the adaptive policy's chain builder).

    Tree part: depth by depth, the candidate (among the top ``w`` of ``l_d``) with the
    highest estimate ``q = λ·p_d(c) + (1-λ)·f(c | ctx)`` (``q = p_d(c)`` where the
    n-gram context was never seen) given the tokens chosen so far. Maximising each
    ``q_i`` in turn maximises ``E = Σ_j Π_{i<=j} q_i`` whenever the n-gram term does
    not change the order, which is the usual case; the paper's exhaustive search
    over the ``[1, 3, 3, 3]`` tree is :func:`select_chain` (``policy="paper"``).
    N-gram part: every retrieved n-gram is scored like :func:`score_chain`, with the
    back-off frequencies of :func:`backoff_frequencies`. The best chain is then
    extended with the table's most frequent continuations while ``Π q_i >= min_conf``
    (the policy cuts it further with calibrated estimates), taking first the continuation
    of the matched long context (:func:`extend_chain` with ``recent``), as the
    n-gram-only chains do.

    Args:
        context: request tokens up to the newest token ``x``.
        top_tokens: per depth d, candidate tokens of ``l_d`` (most probable first).
        prob: ``prob(d, token)`` -> ``p_d(token)`` or None.
        table: the request's n-gram table (None: no n-grams).
        grams: per n-gram group, ``table.topk(first, k)`` (retrieved once per step).
        max_len: longest chain.
        source: the source recorded for tree tokens (heads of the draft forward or
            fused heads).
        skip_first_gram: per group, True when its n-grams start with ``x`` itself
            (the chain is their tail), False when they start with the first draft.
        escape: the extension's most frequent continuations are scored ``c / (t + 1)``
            (:meth:`NGramTable.best_next`; ``policy_tuning.ngram_escape``).
    Returns:
        :class:`Chain` with ``confs`` = the per-token ``q_i``.
    """
    D = len(top_tokens)
    m = table.n - 1 if table is not None else 0
    tail = list(context[-m:]) if m else []

    def f_of(ctx_tail, tok):
        if not m:
            return None
        ctx = tuple(ctx_tail[-m:])
        cnt = table.ctx_counts.get(ctx) if len(ctx) == m else None
        return table.counts.get(ctx + (tok,), 0) / cnt if cnt else None

    # tree part: greedy by depth
    toks: list[int] = []
    qs: list[float] = []
    for d in range(min(D, max_len)):
        best_t, best_q = None, -1.0
        for tok in top_tokens[d]:
            q = mix_estimate(prob(d, tok), f_of(tail, tok), mix)
            if q > best_q:
                best_t, best_q = tok, q
        if best_t is None:
            break
        toks.append(int(best_t))
        qs.append(best_q)
        tail.append(int(best_t))
    best = (toks, qs, source)
    best_e = _expected(qs)

    # n-gram part
    if table is not None:
        for gi, group in enumerate(grams):
            if not group:
                continue
            skip = skip_first_gram[gi] if gi < len(skip_first_gram) else False
            freq = backoff_frequencies(group)
            for gram, _cnt in group:
                cand = list(gram[1:] if skip else gram)[:max_len]
                ctx_tail = list(context[-m:])
                cq = []
                for i, tok in enumerate(cand):
                    f = f_of(ctx_tail, tok)
                    if f is None:
                        pre = tuple(gram[: i + 2]) if skip else tuple(gram[: i + 1])
                        f = freq.get(pre) if len(pre) >= 2 else None
                    cq.append(mix_estimate(prob(i, tok) if i < D else None, f, mix))
                    ctx_tail.append(tok)
                e = _expected(cq)
                if e > best_e:
                    best, best_e = (cand, cq, SOURCE_NGRAM), e
    toks, qs, src = best
    chain = Chain(list(toks), [src] * len(toks), best_e, list(qs))
    if table is not None and len(chain.tokens) < max_len:
        cum = 1.0
        for q in qs:
            cum *= q
        extend_chain(chain, context, table, max_len, min_conf, cum, prob, D, mix, recent=True,
                     escape=escape)
    return chain


def _expected(qs: Sequence[float]) -> float:
    cum, tot = 1.0, 0.0
    for q in qs:
        cum *= q
        tot += cum
    return tot
