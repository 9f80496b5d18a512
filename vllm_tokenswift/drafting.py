"""Step 4 of the proposer: the drafting itself (paper Sec 3.2-3.4).

:class:`Drafter` turns a :class:`~vllm_tokenswift.drafting_policy.StepPlan` into chains:

* **fused rows**: the dependent heads on the pre-norm hidden state the verification
  forward computed at the position before the newest token (no forward);
* **forward rows**: their budgeted KV views planned (:class:`~vllm_tokenswift.kv_view.DraftViews`)
  and **one** forward of the target model for all of them, one token each
  (:class:`~vllm_tokenswift.draft_forward.TargetAccess`), which gives ``l_0`` and the
  heads ``l_1..l_3``;
* both: each request's repetition penalty, temperature and min_p on the draft logits
  (Sec 3.4), then the chain: greedy requests take the best chain from the token tree and
  the n-gram candidates (:mod:`vllm_tokenswift.chain`), sampled requests draw each
  position from its draft distribution q with the request's own RNG; every chain is cut
  by the plan;
* **n-gram rows**: their n-gram chain, cut by the plan.

It also hands the draft distributions of sampled drafts to vLLM's rejection sampler
(:meth:`Drafter.set_draft_probs`, step 5). The functions :func:`draw` and
:func:`penalty_mask` are engine-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_tokenswift import policy as pol
from vllm_tokenswift.chain import (SOURCE_FUSED, SOURCE_HEADS, Chain, build_chain, extend_chain,
                                   ngram_chain, select_chain)
from vllm_tokenswift.config import TokenSwiftConfig
from vllm_tokenswift.drafting_policy import StepPlan
from vllm_tokenswift.kv_view import DraftViews
from vllm_tokenswift.request_state import RequestState, Row

#: n-gram chains are built down to this cumulative frequency (the policy cuts them)
NGRAM_FLOOR = 0.05


def ngram_escape(tuning, sampled: bool) -> bool:
    """Whether a request's n-gram chains score a 3-token context's most frequent
    continuation ``c / (t + 1)`` (``policy_tuning.ngram_escape``: True, False, or
    ``"sampled"``: for sampled requests only)."""
    esc = tuning.ngram_escape
    return esc is True or (esc == "sampled" and sampled)


def row_ngram_chain(st: RequestState, context: list[int], room: int, tuning) -> Chain:
    """The request's n-gram chain after ``context`` (its tokens up to the newest, at least
    the table's :attr:`~vllm_tokenswift.ngram.NGramTable.context_len`), at most ``room``
    tokens, built down to :data:`NGRAM_FLOOR` (the policy cuts it), with the escape count
    where ``policy_tuning.ngram_escape`` asks for it (:func:`~vllm_tokenswift.chain.ngram_chain`)."""
    return ngram_chain(context, st.ngrams, room, NGRAM_FLOOR, ngram_escape(tuning, st.sampled))


def draw(st: RequestState, probs: torch.Tensor) -> list[int]:
    """One token per depth from ``probs`` ``[depth, V]`` (float, rows summing to ~1)
    with the request's own RNG (seeded by its ``seed``, else by the engine seed and
    its id): reproducible per request, independent of the batch, identical on every
    tensor-parallel rank.

    Inverse-CDF sampling: one uniform ``u`` per depth from the request's generator,
    the token is the first whose float64 cumulative probability exceeds ``u·total``
    (``searchsorted``, right side, so a zero-probability token is never drawn). It
    costs one cumulative sum over the vocabulary instead of ``torch.multinomial``'s
    generic path; rows without positive mass fall back to ``torch.multinomial``
    (which raises its usual error on invalid rows).

    Returns:
        ``depth`` token ids.
    """
    if st.generator is None or st.generator.device != probs.device:
        st.generator = torch.Generator(device=probs.device)
        st.generator.manual_seed(st.seed)
    depth = probs.shape[0]
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool(torch.all(total > 0)):
        return torch.multinomial(probs, 1, generator=st.generator).view(-1).tolist()
    u = torch.rand((depth, 1), generator=st.generator, dtype=torch.float64, device=probs.device)
    tok = torch.searchsorted(cdf, u * total, right=True).clamp_(max=probs.shape[-1] - 1)
    return tok.view(-1).tolist()


def penalty_mask(st: RequestState, token_row: np.ndarray, pos: int, v: int, device) -> torch.Tensor:
    """``[V]`` bool: tokens in the request's penalty history (the last ``st.window``
    tokens of prompt + output up to position ``pos``, or all of them), from counts kept
    incrementally on the state: only the tokens that entered or left the window since
    the last call are read.

    Args:
        st: the request's state (``pen_counts``/``pen_lo``/``pen_hi`` updated in place).
        token_row: the request's token ids (vLLM's ``input_batch.token_ids_cpu`` row).
        pos: position of the newest token.
        v: vocabulary size (token ids >= v are ignored).
    """
    hi = pos + 1
    lo = max(0, hi - st.window) if st.window else 0
    if st.pen_counts is None or st.pen_counts.device != torch.device(device) or lo < st.pen_lo \
            or hi < st.pen_hi or lo >= st.pen_hi:
        st.pen_counts = torch.zeros(v, dtype=torch.int32, device=device)
        st.pen_lo = st.pen_hi = lo
    if hi > st.pen_hi:
        add = torch.as_tensor(token_row[st.pen_hi: hi].astype(np.int64), device=device)
        add = add[add < v]
        st.pen_counts.index_add_(0, add, torch.ones_like(add, dtype=torch.int32))
    if lo > st.pen_lo:
        sub = torch.as_tensor(token_row[st.pen_lo: lo].astype(np.int64), device=device)
        sub = sub[sub < v]
        st.pen_counts.index_add_(0, sub, torch.full_like(sub, -1, dtype=torch.int32))
    st.pen_lo, st.pen_hi = lo, hi
    return st.pen_counts > 0


@dataclass
class Drafts:
    """What :meth:`Drafter.draft` produced for one step.

    Attributes:
        chains: row index (into the plan's rows) -> its cut :class:`Chain` (missing: the
            option produced none).
        q_rows: row index -> ``(q [D, V] float, depths)``: the draft distributions its
            sampled tokens were drawn from.
        forward: ``(seconds, rows)`` of the draft forward, or None.
        fused: ``(seconds, rows)`` of the fused heads, or None.
        forward_selected: the draft forward (re-)selected a request's KV view (drafted
            over its whole context, or scored all its blocks' importance): its time is
            not a budgeted forward's (see ``StepCosts.of_drafting``).
    """

    chains: dict = field(default_factory=dict)
    q_rows: dict = field(default_factory=dict)
    forward: tuple | None = None
    fused: tuple | None = None
    forward_selected: bool = False


class Drafter:
    """Drafts the chains a :class:`StepPlan` asks for (module doc).

    Args:
        cfg: the engine's TokenSwift settings.
        access: the target model's hooks (:class:`~vllm_tokenswift.draft_forward.TargetAccess`).
        views: the draft forward's KV views (:class:`~vllm_tokenswift.kv_view.DraftViews`).
        stats: the engine's :class:`~vllm_tokenswift.metrics.TokenSwiftStats` (timers, counters).
        vocab_size: the target's vocabulary size V.
        num_spec_tokens: ``num_speculative_tokens`` k.
    """

    def __init__(self, cfg: TokenSwiftConfig, access, views: DraftViews | None, stats, vocab_size: int,
                 num_spec_tokens: int):
        self.cfg = cfg
        self.access = access
        self.views = views
        self.stats = stats
        self.vocab_size = vocab_size
        self.num_spec_tokens = num_spec_tokens
        self.heads = None
        self.last_forward_step = -1   # step of the latest draft forward (whose queries are held)
        self._dp_buf: torch.Tensor | None = None
        self._tokens: np.ndarray | None = None

    def draft(self, runner, plan: StepPlan, step: int) -> Drafts:
        """Draft every row of ``plan`` with its option: fused heads, the draft forward,
        the n-gram chain (``none`` rows get nothing). ``step``: the engine step counter."""
        self._tokens = runner.input_batch.token_ids_cpu
        out = Drafts()
        fused = plan.rows_of(pol.FUSED)
        if fused:
            self._fused(plan, fused, out)
        forward = plan.rows_of(pol.FORWARD)
        if forward:
            self._forward(runner, plan, forward, out, step)
        for j in plan.rows_of(pol.NGRAM):
            out.chains[j] = plan.cut_ngram(j)
        return out

    # ----------------------------------------------------------------- fused heads
    def _fused(self, plan: StepPlan, idx: list[int], out: Drafts) -> None:
        t = time.perf_counter()
        h = self.access.verification_hidden([plan.rows[j].verify_index for j in idx])
        if h is None:
            return
        outs = self.heads(h.to(next(self.heads.parameters()).dtype))
        n = len(idx)
        logits = self.access.logits(torch.cat(outs, dim=0)).view(len(outs), n, -1).transpose(0, 1)
        self._chains_from_logits(plan, idx, logits, out, SOURCE_FUSED, tree=self.cfg.tree[1:], with_l0=False)
        dt = time.perf_counter() - t
        self.stats.time_fused_s += dt
        out.fused = (dt, n)

    # ----------------------------------------------------------------- draft forward
    def _forward(self, runner, plan: StepPlan, idx: list[int], out: Drafts, step: int) -> None:
        t = time.perf_counter()
        bt_np = runner.input_batch.block_table[0].block_table.np
        sel = [plan.rows[j] for j in idx]
        batch_rows = [r.batch_row for r in sel]
        views = [r.state.view for r in sel]
        positions = [r.pos for r in sel]
        has_q = self.access.has_queries
        query_rows = [r.state.q_row if has_q and r.state.q_step == self.last_forward_step else -1 for r in sel]
        selections = [v.selections for v in views]
        plans = self.views.plan(bt_np, batch_rows, views, positions, query_rows)
        out.forward_selected = (any(pl.needs_selection for pl in plans)
                                or any(v.selections != n for v, n in zip(views, selections)))
        tables = self.views.block_tables(bt_np, batch_rows, plans)
        ids = [int(runner.input_batch.token_ids_cpu[r.batch_row, r.pos]) for r in sel]
        slots = self.views.slots(bt_np, batch_rows, positions)
        t1 = time.perf_counter()
        h = self.access.draft_forward(runner, ids, positions, slots, tables, [pl.seq_len for pl in plans])
        pre = self.access.draft_prenorm
        outs = (self.heads(pre[: len(sel)].to(h.dtype))
                if self.heads is not None and pre is not None else [])
        logits = self.access.logits(torch.cat([h] + outs, dim=0) if outs else h)
        logits = logits.view(1 + len(outs), len(sel), -1).transpose(0, 1)
        self.stats.time_draft_forward_s += time.perf_counter() - t1
        self.stats.draft_steps += 1
        for k, r in enumerate(sel):
            r.state.q_row, r.state.q_step = k, step
        self.last_forward_step = step
        if self.access.has_queries:
            self.views.select_after_forward(bt_np, batch_rows, views, positions, plans)
        if self.cfg.policy == "paper":
            self._paper_chains(plan, idx, logits, out)
        else:
            self._chains_from_logits(plan, idx, logits, out, SOURCE_HEADS, tree=self.cfg.tree, with_l0=True)
        out.forward = (time.perf_counter() - t, len(sel))

    # ----------------------------------------------------------------- chains
    def _chains_from_logits(self, plan: StepPlan, idx, logits, out: Drafts, source, tree,
                            with_l0: bool) -> None:
        """Chains from draft logits ``[n, D, V]`` of the rows ``idx`` (adaptive policy)."""
        cfg = self.cfg
        sel, probs = self._draft_probs(plan.rows, idx, logits)
        n, D, _ = probs.shape
        greedy = [k for k, r in enumerate(sel) if not r.state.sampled]
        if greedy:
            w = max(tree[:D])
            gidx = torch.as_tensor(greedy, dtype=torch.long, device=probs.device)
            top_p, top_i = probs.index_select(0, gidx).topk(w, dim=-1)
            top_p, top_i = top_p.cpu().numpy(), top_i.cpu().numpy()
            for gk, k in enumerate(greedy):
                r = sel[k]
                st = r.state
                lut = [dict(zip(top_i[gk, d, : tree[d]].tolist(), top_p[gk, d, : tree[d]].tolist()))
                       for d in range(D)]
                toks = [list(lut[d].keys()) for d in range(D)]

                def prob(d, tok, lut=lut):
                    return lut[d].get(tok) if d < len(lut) else None

                groups, skips = [], []
                if st.ngrams is not None:
                    firsts = [(toks[0][0], False), (r.context[-1], True)] if with_l0 else [(r.context[-1], True)]
                    for first, skip in firsts:
                        groups.append(st.ngrams.topk(first, cfg.ngram_topk))
                        skips.append(skip)
                ch = build_chain(r.context, toks, prob, st.ngrams, groups, r.room, source=source,
                                 skip_first_gram=skips, escape=ngram_escape(cfg.policy_tuning, st.sampled))
                out.chains[idx[k]] = plan.cut(ch, r)
        sampled = [k for k, r in enumerate(sel) if r.state.sampled]
        if sampled:
            peak = probs.amax(dim=-1).cpu().numpy()       # [n, D]: confidence of q, not of a draw
        for k in sampled:
            r = sel[k]
            st = r.state
            depth = min(D, r.room)
            draws = draw(st, probs[k, :depth])
            ch = Chain(list(draws), [source] * depth, 0.0, peak[k, :depth].tolist())
            if st.ngrams is not None and depth < r.room:
                ext = row_ngram_chain(st, list(r.context) + ch.tokens, r.room - depth, cfg.policy_tuning)
                ch.tokens += ext.tokens
                ch.sources += ext.sources
                ch.confs += ext.confs
            out.chains[idx[k]] = plan.cut(ch, r)
            out.q_rows[idx[k]] = (probs[k], list(range(depth)))

    def _draft_probs(self, rows, idx, logits) -> tuple[list[Row], torch.Tensor]:
        """The rows ``idx`` and their draft distributions: softmax of ``logits``
        ``[n, D, V]`` after each request's penalty, temperature and min_p (with
        ``draft_penalty``), float, same shape."""
        sel = [rows[j] for j in idx]
        if self.cfg.draft_penalty:
            logits = self.apply_request_filters(sel, logits)
        return sel, torch.softmax(logits, dim=-1)

    def _paper_chains(self, plan: StepPlan, idx, logits, out: Drafts) -> None:
        """The paper policy's chains: the best path of the ``[1, 3, 3, 3]`` tree and the
        n-grams (:func:`select_chain`) for greedy requests; draws from q plus confident
        n-gram continuations for sampled ones."""
        cfg = self.cfg
        sel, probs = self._draft_probs(plan.rows, idx, logits)
        n, D, _ = probs.shape
        tmax = max(cfg.tree[:D])
        top_p, top_i = probs.topk(tmax, dim=-1)
        top_p, top_i = top_p.cpu().numpy(), top_i.cpu().numpy()
        for k, r in enumerate(sel):
            st = r.state
            if st.sampled:
                depth = min(D, r.room)
                draws = draw(st, probs[k, :depth])
                ch = Chain(list(draws), [SOURCE_HEADS] * depth, float(depth), [1.0] * depth)
                if st.ngrams is not None and cfg.ngram_topk > 0:
                    extend_chain(ch, r.context, st.ngrams, r.room, cfg.ngram_min_conf)
                    ch.confs = [1.0] * len(ch.tokens)
                out.chains[idx[k]] = ch.truncate(min(len(ch.tokens), r.room))
                out.q_rows[idx[k]] = (probs[k], list(range(depth)))
                continue
            lut = [dict(zip(top_i[k, d].tolist(), top_p[k, d].tolist())) for d in range(D)]

            def prob(d, tok, lut=lut):
                return lut[d].get(tok) if d < len(lut) else None

            tree_tokens = [top_i[k, d, : cfg.tree[d]].tolist() for d in range(D)]
            ch = select_chain(r.context, tree_tokens, prob, st.ngrams, cfg.ngram_topk, r.room,
                              cfg.ngram_min_conf)
            ch.confs = [1.0] * len(ch.tokens)
            out.chains[idx[k]] = ch

    def apply_request_filters(self, sel: list[Row], logits: torch.Tensor) -> torch.Tensor:
        """The request's repetition penalty (windowed or global), temperature and min_p on
        every draft distribution ``logits`` ``[n, D, V]``, as the target's sampler will
        apply them (Sec 3.4). The penalty history is kept incrementally per request
        (:func:`penalty_mask`); the draft prefix of the chain is not added
        (approximation)."""
        from vllm._custom_ops import apply_repetition_penalties

        n, ndist, v = logits.shape
        pen = [k for k, r in enumerate(sel) if r.state.repetition_penalty != 1.0]
        if pen:
            mask = torch.stack([penalty_mask(sel[k].state, self._tokens[sel[k].batch_row], sel[k].pos, v,
                                             logits.device) for k in pen])
            idx = torch.as_tensor(pen, dtype=torch.long, device=logits.device)
            sub = logits[idx].reshape(len(pen) * ndist, v).contiguous()
            pens = torch.as_tensor([sel[k].state.repetition_penalty for k in pen],
                                   dtype=torch.float32, device=logits.device)
            m = mask.repeat_interleave(ndist, dim=0)
            apply_repetition_penalties(sub, m, torch.zeros_like(m), pens.repeat_interleave(ndist))
            logits[idx] = sub.view(len(pen), ndist, v)
        temps = torch.as_tensor([r.state.temperature if r.state.sampled else 1.0 for r in sel],
                                dtype=torch.float32, device=logits.device)
        logits = logits / temps.view(n, 1, 1)
        mp = [k for k, r in enumerate(sel) if r.state.min_p > 0 and r.state.sampled]
        if mp:
            from vllm_tokenswift.penalty import apply_min_p

            idx = torch.as_tensor(mp, dtype=torch.long, device=logits.device)
            sub = logits[idx].reshape(len(mp) * ndist, v)
            mpv = torch.as_tensor([sel[k].state.min_p for k in mp], dtype=torch.float32,
                                  device=logits.device).repeat_interleave(ndist)
            logits[idx] = apply_min_p(sub, mpv).view(len(mp), ndist, v)
        return logits

    # ----------------------------------------------------------------- hand-over (step 5)
    def set_draft_probs(self, runner, rows: list[Row], out: list[list[int]], q_rows: dict) -> None:
        """Give vLLM's rejection sampler the draft distributions q of sampled drafts.

        Standard speculative sampling (accept with min(1, p/q), else resample from
        (p - q)+) is lossless when each draft token was drawn from the q given here;
        tokens chosen deterministically (n-gram candidates, greedy rows) get a
        one-hot q, which is exactly vLLM's point-mass treatment. vLLM reads only
        ``[row, :num_draft]`` of each row (``_get_spec_decode_draft_probs``), so the
        buffer is kept between steps and only the positions proposed now are written.
        Sets ``runner._draft_probs``: ``[num_batch_rows, num_speculative_tokens, V]``
        float32, rows in ``input_batch.req_ids`` order (vLLM ``GPUModelRunner._draft_probs``),
        and ``runner._draft_prob_req_ids``.
        """
        n_rows = len(out)
        dev, v = torch.device(runner.device), self.vocab_size
        k = self.num_spec_tokens
        buf = self._dp_buf
        if buf is None or buf.shape[0] < n_rows or buf.device != dev or buf.shape[2] != v:
            buf = self._dp_buf = torch.zeros((max(n_rows, 8), k, v), dtype=torch.float32, device=dev)
        oi, oj, ot = [], [], []
        for i, toks in enumerate(out):
            for j, t in enumerate(toks):
                oi.append(i)
                oj.append(j)
                ot.append(t)
        if oi:
            ii = torch.as_tensor(oi, device=dev)
            jj = torch.as_tensor(oj, device=dev)
            buf[ii, jj] = 0.0
            buf[ii, jj, torch.as_tensor(ot, device=dev)] = 1.0
        for j, (probs, depths) in q_rows.items():
            i = rows[j].batch_row
            d = min(len(depths), len(out[i]))
            if d:
                buf[i, :d] = probs[:d]
        runner._draft_probs = buf[:n_rows]
        runner._draft_prob_req_ids = list(runner.input_batch.req_ids[:n_rows])
