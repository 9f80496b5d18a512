"""Step 4 of the proposer: the drafting itself (paper Sec 3.2-3.4).

:class:`Drafter` turns a :class:`~vllm_tokenswift.core.step.StepPlan` into chains:

* **fused rows**: the dependent heads on the pre-norm hidden state the verification
  forward computed at the position before the newest token (no forward);
* **forward rows**: their budgeted KV views planned (:class:`~vllm_tokenswift.core.kv_view.DraftViews`)
  and **one** forward of the target model for all of them, one token each
  (:meth:`TargetAccess.draft_forward <vllm_tokenswift.engine.target.TargetAccess.draft_forward>`),
  which gives ``l_0`` and the heads ``l_1..l_3``;
* both: each request's repetition penalty, temperature and min_p on the draft logits
  (Sec 3.4, :func:`~vllm_tokenswift.core.draft_sampling.draft_distributions`), then the
  chain: greedy requests take the best chain from the token tree and the n-gram candidates
  (:mod:`vllm_tokenswift.core.chain`; the paper's selection when the policy asks for
  :attr:`~vllm_tokenswift.core.policy.DraftingPolicy.paper_chains`), sampled requests draw
  each position from its draft distribution q with the request's own RNG;
* **chain rows** (self-speculative chains, the paper's TriForce* baseline): the draft
  forward run ``m`` times, one token per request each time, forward ``j`` over the
  request's budgeted view plus the chain drafted so far (the chain's K/V written into the
  request's own lookahead slots ``pos + j``, which the next verification overwrites); the
  next token taken from ``l_0`` (argmax of its processed distribution for greedy
  requests; drawn from q for sampled ones, q built with the request's penalty counting
  the chain drawn so far, temperature and min_p, and handed to the rejection sampler);
* **n-gram rows**: their n-gram chain.

Every chain is cut by the policy (:meth:`DraftingPolicy.cut
<vllm_tokenswift.core.policy.DraftingPolicy.cut>`). The target is anything with
:class:`~vllm_tokenswift.engine.target.TargetAccess`'s drafting interface (a fake in the
proposer's unit test).
"""

from __future__ import annotations

import time

import torch

import numpy as np

from vllm_tokenswift.core.chain import (SOURCE_CHAIN, SOURCE_FUSED, SOURCE_HEADS, Chain, build_chain, extend_chain,
                                        ngram_escape, request_ngram_chain, select_chain)
from vllm_tokenswift.core.config import TokenSwiftConfig
from vllm_tokenswift.core.draft_sampling import draft_distributions, draw
from vllm_tokenswift.core.kv_view import DraftViews
from vllm_tokenswift.core.step import CHAIN, FORWARD, FUSED, NGRAM, Drafts, StepInput, StepPlan


class Drafter:
    """Drafts the chains a :class:`StepPlan` asks for (module doc).

    Args:
        cfg: the engine's TokenSwift settings.
        target: the target model's drafting interface (``engine.target.TargetAccess``).
        policy: the engine's drafting policy (its :meth:`cut` trims every chain).
        stats: the engine's :class:`~vllm_tokenswift.core.stats.TokenSwiftStats` (timers, counters).

    Attributes:
        heads: the dependent draft heads (``core.heads.DraftHeads``), None without heads.
        views: the draft forward's KV views (:class:`DraftViews`), set when the target is attached.
    """

    def __init__(self, cfg: TokenSwiftConfig, target, policy, stats):
        self.cfg = cfg
        self.target = target
        self.policy = policy
        self.stats = stats
        self.heads = None
        self.views: DraftViews | None = None

    def draft(self, step: StepInput, plan: StepPlan) -> Drafts:
        """Every row of ``plan`` drafted with its option: fused heads, the draft forward, the
        self-speculative chain, the n-gram chain (``none`` rows get nothing)."""
        out = Drafts()
        fused = plan.rows_of(FUSED)
        if fused:
            self._fused(step, plan, fused, out)
        forward = plan.rows_of(FORWARD)
        if forward:
            self._forward(step, plan, forward, out)
        chained = plan.rows_of(CHAIN)
        if chained:
            self._chain(step, plan, chained, out)
        for j in plan.rows_of(NGRAM):
            r = plan.rows[j]
            ch = r.ngram if r.ngram is not None else Chain([], [], 0.0)
            out.chains[j] = self.policy.cut(plan, j, ch, plan.cums[j].get(NGRAM) if plan.cums else None)
        return out

    # ----------------------------------------------------------------- fused heads
    def _fused(self, step: StepInput, plan: StepPlan, idx: list[int], out: Drafts) -> None:
        t = time.perf_counter()
        h = self.target.verification_hidden([plan.rows[j].verify_index for j in idx])
        if h is None:
            return
        outs = self.heads(h.to(next(self.heads.parameters()).dtype))
        n = len(idx)
        logits = self.target.logits(torch.cat(outs, dim=0)).view(len(outs), n, -1).transpose(0, 1)
        self._chains(step, plan, idx, logits, out, SOURCE_FUSED, tree=self.cfg.tree[1:], with_l0=False)
        dt = time.perf_counter() - t
        self.stats.time_fused_s += dt
        out.fused = (dt, n)

    # ----------------------------------------------------------------- draft forward
    def _forward(self, step: StepInput, plan: StepPlan, idx: list[int], out: Drafts) -> None:
        t = time.perf_counter()
        bt = step.block_table
        sel = [plan.rows[j] for j in idx]
        batch_rows = [r.batch_row for r in sel]
        views = [r.state.view for r in sel]
        positions = [r.pos for r in sel]
        held = self.target.query_rows
        query_rows = [held.get(r.state.uid, -1) for r in sel]
        selections = [v.selections for v in views]
        plans = self.views.plan(bt, batch_rows, views, positions, query_rows)
        out.forward_selected = (any(pl.needs_selection for pl in plans)
                                or any(v.selections != n for v, n in zip(views, selections)))
        tables = self.views.block_tables(bt, batch_rows, plans)
        ids = [int(step.token_ids[r.batch_row, r.pos]) for r in sel]
        slots = self.views.slots(bt, batch_rows, positions)
        t1 = time.perf_counter()
        h = self.target.draft_forward(step.runner, ids, positions, slots, tables, [pl.seq_len for pl in plans],
                                      [r.state.uid for r in sel])
        pre = self.target.draft_prenorm
        outs = (self.heads(pre[: len(sel)].to(h.dtype))
                if self.heads is not None and pre is not None else [])
        logits = self.target.logits(torch.cat([h] + outs, dim=0) if outs else h)
        logits = logits.view(1 + len(outs), len(sel), -1).transpose(0, 1)
        self.stats.time_draft_forward_s += time.perf_counter() - t1
        self.stats.draft_steps += 1
        if self.target.query_rows:
            self.views.select_after_forward(bt, batch_rows, views, positions, plans)
        if self.policy.paper_chains:
            self._paper_chains(step, plan, idx, logits, out)
        else:
            self._chains(step, plan, idx, logits, out, SOURCE_HEADS, tree=self.cfg.tree, with_l0=True)
        out.forward = (time.perf_counter() - t, len(sel))

    # ----------------------------------------------------------------- self-speculative chains
    def _chain(self, step: StepInput, plan: StepPlan, idx: list[int], out: Drafts) -> None:
        """The self-speculative chains of the rows ``idx`` (module doc): forward ``j`` feeds
        each still-drafting request its token at ``pos + j`` (``x``, then the chain's
        tokens), writes its K/V into the request's real slot of that position and attends
        to the request's budgeted view plus positions ``pos + 1 .. pos + j``: the view's
        last block is the newest token's own, so the table is the view followed by the
        request's next blocks and the view's length grows by one token per forward.

        Row ``k`` runs ``plan.chain_forwards`` forwards (at most its ``chain_room``, the
        slots vLLM allocated: ``num_lookahead_tokens`` is ``num_speculative_tokens`` for
        TokenSwift engines). Each forward's time goes to ``out.chain`` for the cost model."""
        sel = [plan.rows[j] for j in idx]
        lengths = [plan.chain_forwards(j) for j in idx]
        bt = step.block_table
        bs = self.views.planner.block_size
        batch_rows = [r.batch_row for r in sel]
        views = [r.state.view for r in sel]
        positions = [r.pos for r in sel]
        held = self.target.query_rows
        query_rows = [held.get(r.state.uid, -1) for r in sel]
        selections = [v.selections for v in views]
        t = time.perf_counter()
        plans = self.views.plan(bt, batch_rows, views, positions, query_rows)
        out.forward_selected = (out.forward_selected or any(pl.needs_selection for pl in plans)
                                or any(v.selections != n for v, n in zip(views, selections)))
        base_tables = self.views.block_tables(bt, batch_rows, plans)
        rows_of = [step.token_ids[r.batch_row] for r in sel]
        tokens: list[list[int]] = [[] for _ in sel]
        confs: list[list[float]] = [[] for _ in sel]
        qs: list[list[torch.Tensor]] = [[] for _ in sel]
        greedy = [not r.state.sampled for r in sel]
        for j in range(max(lengths)):
            act = [k for k in range(len(sel)) if lengths[k] > j]
            ids = [int(rows_of[k][positions[k]]) if j == 0 else tokens[k][j - 1] for k in act]
            pos_j = [positions[k] + j for k in act]
            slots = self.views.slots(bt, [batch_rows[k] for k in act], pos_j)
            tables = [self._chain_table(tab, [len(pl.blocks[g if len(pl.blocks) > 1 else 0]) for pl in plans],
                                        bt, act, batch_rows, positions, j, bs)
                      for g, tab in enumerate(base_tables)]
            seq = [plans[k].seq_len + j for k in act]
            t1 = time.perf_counter()
            h = self.target.draft_forward(step.runner, ids, pos_j, slots, tables, seq,
                                          [sel[k].state.uid for k in act])
            logits = self.target.logits(h).unsqueeze(1)                       # [n, 1, V]
            self.stats.time_draft_forward_s += time.perf_counter() - t1
            if j == 0 and self.target.query_rows:
                self.views.select_after_forward(bt, batch_rows, views, positions, plans)
            probs = draft_distributions([sel[k].state for k in act], [rows_of[k] for k in act],
                                        [positions[k] for k in act], logits, filters=self.cfg.draft_penalty,
                                        chains=[tokens[k] for k in act])[:, 0]       # [n, V]
            peak, arg = probs.max(dim=-1)
            peak, arg = peak.tolist(), arg.tolist()
            for i, k in enumerate(act):
                if greedy[k]:
                    tokens[k].append(int(arg[i]))
                else:
                    tokens[k].append(draw(sel[k].state, probs[i: i + 1])[0])
                    qs[k].append(probs[i])
                confs[k].append(float(peak[i]))
            out.chain.append((time.perf_counter() - (t if j == 0 else t1), len(act)))
            self.stats.chain_forwards += 1
            self.stats.chain_forward_rows += len(act)
        self.stats.draft_steps += 1
        for k, r in enumerate(sel):
            ch = Chain(tokens[k], [SOURCE_CHAIN] * len(tokens[k]), 0.0, confs[k])
            out.chains[idx[k]] = self.policy.cut(plan, idx[k], ch)
            if qs[k]:
                out.q_rows[idx[k]] = torch.stack(qs[k])

    @staticmethod
    def _chain_table(table: np.ndarray, view_blocks: list[int], bt: np.ndarray, act: list[int],
                     batch_rows: list[int], positions: list[int], j: int, bs: int) -> np.ndarray:
        """Forward ``j``'s block table ``[len(act), width]`` int32: each active request's
        view (row ``k`` of ``table``: its first ``view_blocks[k]`` entries) followed by the
        physical blocks of the request's positions past the newest token's block, up to
        ``pos + j`` (zero-padded)."""
        extra = [(positions[k] + j) // bs - positions[k] // bs for k in act]
        if not any(extra):
            return table[act]
        width = max(view_blocks[k] + e for k, e in zip(act, extra))
        out = np.zeros((len(act), max(width, table.shape[1])), dtype=np.int32)
        for i, k in enumerate(act):
            nv = view_blocks[k]
            out[i, :nv] = table[k, :nv]
            if extra[i]:
                first = positions[k] // bs + 1
                out[i, nv: nv + extra[i]] = bt[batch_rows[k], first: first + extra[i]]
        return out

    # ----------------------------------------------------------------- chains
    def _distributions(self, step: StepInput, sel: list, logits: torch.Tensor) -> torch.Tensor:
        """q ``[n, D, V]`` of the rows ``sel`` from their draft logits ``[n, D, V]``."""
        return draft_distributions([r.state for r in sel], [step.token_ids[r.batch_row] for r in sel],
                                   [r.pos for r in sel], logits, filters=self.cfg.draft_penalty)

    def _chains(self, step: StepInput, plan: StepPlan, idx, logits, out: Drafts, source, tree,
                with_l0: bool) -> None:
        """Calibrated chains from draft logits ``[n, D, V]`` of the rows ``idx``: greedy rows
        the best chain of the token tree and n-gram candidates (:func:`build_chain`), sampled
        rows draws from q extended by their n-gram chain; each cut by the policy."""
        cfg = self.cfg
        sel = [plan.rows[j] for j in idx]
        probs = self._distributions(step, sel, logits)
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
                out.chains[idx[k]] = self.policy.cut(plan, idx[k], ch)
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
                ext = request_ngram_chain(st.ngrams, list(r.context) + ch.tokens, r.room - depth, st.sampled,
                                          cfg.policy_tuning)
                ch.tokens += ext.tokens
                ch.sources += ext.sources
                ch.confs += ext.confs
            out.chains[idx[k]] = self.policy.cut(plan, idx[k], ch)
            out.q_rows[idx[k]] = probs[k, :depth]

    def _paper_chains(self, step: StepInput, plan: StepPlan, idx, logits, out: Drafts) -> None:
        """The paper's chains: the best path of the ``[1, 3, 3, 3]`` tree and the n-grams
        (:func:`select_chain`) for greedy requests; draws from q plus confident n-gram
        continuations for sampled ones. Kept whole (at most the row's room)."""
        cfg = self.cfg
        sel = [plan.rows[j] for j in idx]
        probs = self._distributions(step, sel, logits)
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
                out.chains[idx[k]] = self.policy.cut(plan, idx[k], ch)
                out.q_rows[idx[k]] = probs[k, :depth]
                continue
            lut = [dict(zip(top_i[k, d].tolist(), top_p[k, d].tolist())) for d in range(D)]

            def prob(d, tok, lut=lut):
                return lut[d].get(tok) if d < len(lut) else None

            tree_tokens = [top_i[k, d, : cfg.tree[d]].tolist() for d in range(D)]
            ch = select_chain(r.context, tree_tokens, prob, st.ngrams, cfg.ngram_topk, r.room,
                              cfg.ngram_min_conf)
            ch.confs = [1.0] * len(ch.tokens)
            out.chains[idx[k]] = self.policy.cut(plan, idx[k], ch)
