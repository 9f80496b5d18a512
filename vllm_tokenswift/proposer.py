"""TokenSwiftProposer: the vLLM-facing proposer (``method="custom_class"``).

Per engine step, for every running request whose newest token ``x`` (position
``p``) was just sampled, :meth:`TokenSwiftProposer.propose_with_runner`:

1. updates the request's n-gram table with its new tokens (Sec 3.2);
2. plans its budgeted draft KV view (``kv_view``; Sec 3.3), re-selecting it from
   block importances when the recent part overflows the budget;
3. runs **one** forward of the target model for all such requests (one token
   each) against their views — the target drafts for itself — and reads the
   pre-final-norm hidden state, giving ``l_0`` (LM head) and ``l_1..l_3``
   (dependent heads, ``heads``);
4. applies each request's penalty, temperature and min_p to those distributions
   (Sec 3.4; ``penalty``);
5. picks one chain per request from the ``[1,3,3,3]`` tree and the n-gram
   candidates (``chain``) and returns it to vLLM, whose rejection sampler
   verifies it against the full model: the output equals plain decoding.

How it reaches the runner: vLLM's ``custom_class`` proposers only get token ids.
The plugin (``plugin.py``) reroutes ``GPUModelRunner.propose_draft_token_ids``
(inherited by the CPU runner) to :meth:`propose_with_runner` for this class.

KV safety: the draft forward writes ``x``'s K/V (computed from partial
attention in layers >= 1) into ``x``'s real slot; the next verification step
schedules ``x`` at ``p`` again and overwrites that slot in every layer before
attention reads it, and prefix caching only hashes full blocks of computed
tokens, so verification never reads draft K/V.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vllm_tokenswift.chain import SOURCE_HEADS, Chain, extend_chain, ngram_chain, select_chain
from vllm_tokenswift.config import ADDITIONAL_CONFIG_KEY, TokenSwiftConfig, TokenSwiftConfigError
from vllm_tokenswift.kv_view import (KEY_READERS, RequestView, ViewPlanner, block_importance,
                                     detect_key_layout, sum_over_ranks)
from vllm_tokenswift.metrics import TokenSwiftStats
from vllm_tokenswift.ngram import NGramTable
from vllm_tokenswift.penalty import window_from_params

logger = logging.getLogger("vllm_tokenswift")


@dataclass
class _RequestState:
    """Everything the proposer keeps per running request (freed on finish,
    abort, preemption and resumption)."""

    ngrams: NGramTable | None
    view: RequestView = field(default_factory=RequestView)
    last_sources: list[int] = field(default_factory=list)
    temperature: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    window: int = 0
    q_row: int = -1          # row of this request in the last draft forward's captured queries
    q_step: int = -1         # step id of that capture


class TokenSwiftProposer:
    """TokenSwift drafting for vLLM's V1 engine (paper Sec 3.2-3.4).

    Built by vLLM as ``Class(vllm_config)`` (``custom_class`` proposer) in the
    worker on the last pipeline stage. Settings come from
    ``vllm_config.additional_config["tokenswift"]`` (put there by the plugin).

    Raises (at engine start-up):
        TokenSwiftConfigError: invalid settings, pipeline parallelism > 1, a
            sliding-window/hybrid model, or the plugin's runner patch missing.
        vllm_tokenswift.heads.HeadsLoadError: heads that do not fit the target.
    """

    def __init__(self, vllm_config):
        from vllm_tokenswift.compat import check_vllm_version

        check_vllm_version()
        self.vllm_config = vllm_config
        raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            raise TokenSwiftConfigError(
                'TokenSwiftProposer needs its settings in additional_config["tokenswift"]; '
                'use speculative_config={"method": "tokenswift", ...} with the vllm-tokenswift plugin'
            )
        self.cfg = raw if isinstance(raw, TokenSwiftConfig) else TokenSwiftConfig.parse(dict(raw))
        sc = vllm_config.speculative_config
        self.num_spec_tokens = int(sc.num_speculative_tokens)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise TokenSwiftConfigError(
                "TokenSwift does not support pipeline parallelism (pipeline_parallel_size > 1): "
                "the drafter runs the target model's own forward, which lives across stages"
            )
        hf = vllm_config.model_config.hf_text_config
        if getattr(hf, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(hf, "layer_types", None) or [])):
            raise TokenSwiftConfigError(
                "TokenSwift supports full-attention decoder models only (this model uses "
                "sliding-window or hybrid attention layers)")
        # tensor parallelism: every TP rank runs this proposer on its own heads' Q/KV
        self.tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.cfg.check_block_size(self.block_size)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.states: dict[str, _RequestState] = {}
        self.stats = TokenSwiftStats()
        self.target = None  # NOT self.model: vLLM treats drafter.model as a draft model
        self.heads = None
        self._planner: ViewPlanner | None = None
        self._layer_names: list[str] = []
        self._capture = False
        self._prenorm: torch.Tensor | None = None
        self._q: dict[str, torch.Tensor] = {}
        self._probe_key: torch.Tensor | None = None
        self._key_layout: str | None = None
        self._layout_checked = False
        self._step = 0
        self._hooks = []

    # ----------------------------------------------------------------- set-up
    def load_model(self, target_model) -> None:
        """Keep a reference to the target, load the heads and install capture hooks.

        Called by vLLM right after the target model is loaded (before the KV cache
        exists). Hooks only act inside the draft forward (eager mode).
        """
        from vllm_tokenswift import plugin

        if not plugin.runner_patch_active():
            raise TokenSwiftConfigError(
                "vllm_tokenswift's runner patch is not active: load the plugin (it is a "
                "vllm.general_plugins entry point; check VLLM_PLUGINS) instead of naming "
                "the proposer class directly")
        self.target = target_model
        hf = self.vllm_config.model_config.hf_text_config
        hidden = int(hf.hidden_size)
        eps = float(getattr(hf, "rms_norm_eps", 1e-6))
        dtype = self.vllm_config.model_config.dtype
        device = next(target_model.parameters()).device
        norm = getattr(getattr(target_model, "model", None), "norm", None)
        if norm is None:
            raise TokenSwiftConfigError(
                f"{type(target_model).__name__} has no model.norm: TokenSwift needs a "
                "Llama/Qwen2-style decoder (final norm before the LM head)")
        if self.cfg.use_heads and self.cfg.num_heads > 0:
            from vllm_tokenswift.heads import load_heads

            self.heads = load_heads(self.cfg.heads, hidden_size=hidden, num_heads=self.cfg.num_heads,
                                    eps=eps, dtype=dtype, device=device)
            logger.info("TokenSwift: loaded %d draft heads from %s", self.heads.num_heads, self.cfg.heads)
        if self.tp_size > 1:
            lp = getattr(target_model, "logits_processor", None)
            if lp is not None and not getattr(lp, "use_all_gather", True):
                # every rank needs the draft logits (identical chains, q and RNG draws)
                raise TokenSwiftConfigError(
                    "TokenSwift with tensor_parallel_size > 1 needs the logits gathered on every "
                    "rank (Platform.use_all_gather()); this platform gathers them on rank 0 only")
        self._hooks.append(norm.register_forward_hook(self._norm_hook))
        from vllm.model_executor.layers.attention.attention import Attention

        ctx = self.vllm_config.compilation_config.static_forward_context
        names = [n for n, m in ctx.items() if isinstance(m, Attention)]
        if not names:
            raise TokenSwiftConfigError("no attention layers found in the target model")
        self._layer_names = sorted(names, key=_layer_index)
        for name in self._layer_names:
            self._hooks.append(ctx[name].register_forward_pre_hook(self._make_attn_hook(name)))
        groups = len(self._layer_names) if self.cfg.view_granularity == "layer" else 1
        self._planner = ViewPlanner(self.cfg.kv_budget, self.cfg.sink_tokens, self.block_size,
                                    self.cfg.draft_kv, groups)

    def _norm_hook(self, module, inputs, output):
        if self._capture:
            if isinstance(output, tuple) and len(output) > 1 and output[1] is not None:
                self._prenorm = output[1]
            elif len(inputs) > 1 and inputs[1] is not None:
                self._prenorm = inputs[0] + inputs[1]
            else:
                self._prenorm = inputs[0]

    def _make_attn_hook(self, name: str):
        def hook(module, args):
            if self._capture and args:
                self._q[name] = args[0]
                if self._probe_key is None and name == self._layer_names[0] and len(args) > 1:
                    self._probe_key = args[1]
        return hook

    # ----------------------------------------------------------------- state
    def _forget(self, scheduler_output, live: dict) -> None:
        """Free the state of finished, aborted, preempted and resumed requests.

        Finished requests are also caught when they left the batch in a step that
        ran no proposer (vLLM flushes finished ids with an empty step)."""
        drop = set(scheduler_output.finished_req_ids or ())
        drop |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        cached = scheduler_output.scheduled_cached_reqs
        drop |= set(getattr(cached, "resumed_req_ids", None) or ())
        for rid in drop:
            self.states.pop(rid, None)
        if len(self.states) > len(live):
            for rid in [r for r in self.states if r not in live]:
                del self.states[rid]

    def _new_state(self, runner, req_id: str) -> _RequestState:
        req = runner.requests.get(req_id)
        sp = getattr(req, "sampling_params", None)
        ng = NGramTable(self.cfg.ngram_n) if self.cfg.ngram_topk > 0 else None
        st = _RequestState(ngrams=ng)
        if sp is not None:
            st.temperature = float(sp.temperature)
            st.min_p = float(sp.min_p or 0.0)
            st.repetition_penalty = float(sp.repetition_penalty)
            st.window = window_from_params(sp)
        return st

    def tokenswift_stats(self) -> dict:
        """Counters and derived figures (see :class:`~vllm_tokenswift.metrics.TokenSwiftStats`)."""
        d = self.stats.summary(self.num_spec_tokens)
        d["key_layout"] = self._key_layout
        d["num_live_requests"] = len(self.states)
        return d

    def reset_tokenswift_stats(self) -> None:
        self.stats = TokenSwiftStats()

    # ----------------------------------------------------------------- vLLM API
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        """vLLM's plain ``custom_class`` entry point; unused while the plugin's runner
        patch is active (checked at start-up). Returns no drafts."""
        return [[] for _ in sampled_token_ids]

    @torch.inference_mode()
    def propose_with_runner(self, runner, scheduler_output, sampled, sampling_metadata=None, **_):
        """Draft one chain per request (the plugin calls this after bookkeeping).

        Args:
            runner: vLLM's ``GPUModelRunner`` (or ``CPUModelRunner``).
            scheduler_output: this step's ``SchedulerOutput``.
            sampled: per batch row, the tokens sampled this step (accepted drafts +
                bonus); ``[]`` for rows mid-prefill or discarded.
        Returns:
            ``list[list[int]]``: per batch row, the draft chain (``[]`` = no draft).
        """
        t0 = self.stats.step_started()
        self._step += 1
        ib = runner.input_batch
        self._forget(scheduler_output, ib.req_id_to_index)
        bt = ib.block_table[0]
        bt_np = bt.block_table.np
        nblk = bt.num_blocks_per_row
        req_ids = ib.req_ids
        out: list[list[int]] = [[] for _ in range(len(sampled))]
        bs = self.block_size
        spec = scheduler_output.scheduled_spec_decode_tokens

        rows, states, positions = [], [], []
        for i, s in enumerate(sampled):
            if not s or i >= len(req_ids):
                continue
            rid = req_ids[i]
            p = int(ib.num_tokens_no_spec[i]) - 1
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = self._new_state(runner, rid)
            else:
                self.stats.record_verification(st.last_sources, len(spec.get(rid, ())), len(s) - 1)
            st.last_sources = []
            if st.ngrams is not None:
                st.ngrams.extend(ib.token_ids_cpu[i, len(st.ngrams): p + 1].tolist())
            room = self.max_model_len - (p + 1) - 1
            if room <= 0:
                continue
            if p // bs >= nblk[i]:
                self.stats.skipped_no_slot += 1
                continue
            if st.ngrams is not None and self.cfg.skip_draft_conf <= 1.0:
                ng = ngram_chain(ib.token_ids_cpu[i, max(0, p + 2 - st.ngrams.n): p + 1].tolist(),
                                 st.ngrams, min(room, self.num_spec_tokens), self.cfg.ngram_min_conf)
                if ng.tokens and ng.expected_len >= self.cfg.skip_draft_conf * self.num_spec_tokens:
                    out[i] = ng.tokens
                    st.last_sources = ng.sources
                    self.stats.record_chain(ng.sources)
                    self.stats.drafts_skipped_forward += 1
                    continue
            rows.append(i)
            states.append(st)
            positions.append(p)
        if not rows:
            self.stats.time_draft_s += time.perf_counter() - t0
            return out

        plans = self._plan_views(runner, rows, states, positions)
        t1 = time.perf_counter()
        logits = self._draft_forward(runner, rows, positions, plans, ib, bt_np)
        self.stats.time_draft_forward_s += time.perf_counter() - t1
        for r, (i, st) in enumerate(zip(rows, states)):
            st.q_row, st.q_step = r, self._step
        self.stats.draft_steps += 1

        chains, probs, q_depths = self._choose_chains(ib, rows, states, positions, logits)
        for i, st, p, ch in zip(rows, states, positions, chains):
            room = self.max_model_len - (p + 1) - 1
            toks = ch.tokens[: min(room, self.num_spec_tokens)]
            out[i] = toks
            st.last_sources = ch.sources[: len(toks)]
            self.stats.record_chain(st.last_sources)
        if q_depths:
            self._set_draft_probs(runner, out, rows, probs, q_depths)
        self.stats.time_draft_s += time.perf_counter() - t0
        self.stats.maybe_log(self.cfg.log_interval_s, self.num_spec_tokens)
        return out

    # ----------------------------------------------------------------- views
    def _plan_views(self, runner, rows, states, positions) -> list:
        """Plan every drafting request's view, (re-)selecting those that need it.

        Under tensor parallelism the importances of all re-selected requests are summed
        over the TP ranks in one collective before the top-k (:func:`sum_over_ranks`),
        so all ranks select the same blocks, the ones single-rank TokenSwift would
        select. Whether a request re-selects depends only on positions and step
        counters, identical on all ranks, so every rank reaches the collective (none
        when nothing re-selects, and none at all with one rank).
        """
        planner = self._planner
        plans = [planner.plan(st.view, p) for st, p in zip(states, positions)]
        todo, imps = [], []
        for r, (i, st, p, plan) in enumerate(zip(rows, states, positions, plans)):
            if plan.needs_selection and st.q_step == self._step - 1 and st.q_row >= 0 and self._q:
                todo.append(r)
                imps.append(self._importance(runner, i, st, p))
        if todo and self.tp_size > 1:
            imps = sum_over_ranks(imps, _tp_all_gather)
        for r, imp in zip(todo, imps):
            planner.select(states[r].view, positions[r], imp)
            self.stats.view_selections += 1
            plans[r] = planner.plan(states[r].view, positions[r])
        for plan in plans:
            if plan.full:
                self.stats.views_full += 1
            else:
                self.stats.views_budgeted += 1
        return plans

    def _importance(self, runner, row: int, st: _RequestState, p: int) -> list[np.ndarray] | None:
        """Per group, block importance of blocks ``sink..last-1`` for this request."""
        if self._key_layout is None:
            return None  # recency fallback (layout unknown)
        planner = self._planner
        s = planner.sink_blocks
        last = p // self.block_size
        if last - s <= 0:
            return [np.zeros(0)] * planner.num_groups
        ids_np = runner.input_batch.block_table[0].block_table.np[row, s:last]
        ctx = self.vllm_config.compilation_config.static_forward_context
        reader = KEY_READERS[self._key_layout]
        per_layer = []
        for name in self._layer_names:
            kv = ctx[name].kv_cache
            if isinstance(kv, (list, tuple)):
                kv = kv[0]
            ids = torch.as_tensor(ids_np, dtype=torch.long, device=kv.device)
            keys = reader(kv, ids)
            q = self._q[name][st.q_row]
            hq = q.numel() // keys.shape[-1]
            per_layer.append(block_importance(q.reshape(hq, keys.shape[-1]), keys).cpu().numpy())
        if planner.num_groups == 1:
            return [np.sum(per_layer, axis=0)]
        return per_layer

    # ----------------------------------------------------------------- forward
    def _draft_forward(self, runner, rows, positions, plans, ib, bt_np) -> torch.Tensor:
        """One target forward over the views; returns draft logits ``[n, D, V]`` float32."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = len(rows)
        dev = runner.device
        bs = self.block_size
        ids = torch.as_tensor([int(ib.token_ids_cpu[i, p]) for i, p in zip(rows, positions)],
                              dtype=torch.long)
        pos = torch.as_tensor(positions, dtype=torch.long)
        slots = torch.as_tensor([int(bt_np[i, p // bs]) * bs + p % bs for i, p in zip(rows, positions)],
                                dtype=torch.long)
        seq = torch.as_tensor([pl.seq_len for pl in plans], dtype=torch.int32)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        uniform = all(len(pl.blocks) == 1 for pl in plans)
        n_groups = 1 if uniform else len(self._layer_names)

        def table(g: int) -> torch.Tensor:
            width = max(len(pl.blocks[g if len(pl.blocks) > 1 else 0]) for pl in plans)
            t = np.zeros((n, width), dtype=np.int32)
            for r, (i, pl) in enumerate(zip(rows, plans)):
                b = pl.blocks[g if len(pl.blocks) > 1 else 0]
                t[r, : len(b)] = bt_np[i, b]
            return torch.from_numpy(t).to(dev)

        pos_d, slots_d = pos.to(dev), slots.to(dev)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev),
            seq_lens_cpu_upper_bound=seq, num_reqs=n, num_actual_tokens=n, max_query_len=1,
            max_seq_len=int(seq.max()), block_table_tensor=table(0), slot_mapping=slots_d,
            causal=True, positions=pos_d, is_prefilling=torch.zeros(n, dtype=torch.bool))
        layer_group = {name: i for i, name in enumerate(self._layer_names)}
        md, sm = {}, {}
        tables = {0: cm.block_table_tensor}
        for groups in runner.attn_groups:
            for g in groups:
                builder = g.get_metadata_builder()
                if n_groups == 1:
                    m = builder.build_for_drafting(_kernel_blocks(g, cm), 0)
                    for ln in g.layer_names:
                        md[ln], sm[ln] = m, slots_d
                    continue
                for ln in g.layer_names:
                    gi = layer_group.get(ln, 0)
                    if gi not in tables:
                        tables[gi] = table(gi)
                    m = builder.build_for_drafting(
                        _kernel_blocks(g, replace(cm, block_table_tensor=tables[gi])), 0)
                    md[ln], sm[ln] = m, slots_d
        self._q = {}
        self._prenorm = None
        probe = not self._layout_checked
        self._probe_key = None if probe else self._probe_key
        self._capture = True
        try:
            with set_forward_context(md, self.vllm_config, num_tokens=n, slot_mapping=sm,
                                     skip_compiled=True):
                hidden = self.target(input_ids=ids.to(dev), positions=pos_d)
        finally:
            self._capture = False
        if probe:
            self._detect_layout(slots[0].item())
        h = hidden if isinstance(hidden, torch.Tensor) else hidden[0]
        h = h[:n]
        outs = (self.heads(self._prenorm[:n].to(h.dtype))
                if self.heads is not None and self._prenorm is not None else [])
        logits = self.target.compute_logits(torch.cat([h] + outs, dim=0) if outs else h)
        if logits is None:
            raise RuntimeError("TokenSwift: compute_logits returned no logits on this rank")
        logits = logits.view(1 + len(outs), n, -1).transpose(0, 1)
        return logits[..., : self.vocab_size].float()

    def _detect_layout(self, slot: int) -> None:
        """Find the KV cache key layout from the key the first draft forward wrote.

        With tensor parallelism the ranks agree (one collective, on the first draft
        forward, which all ranks run): if any rank cannot read its keys, all fall back
        to recency, so no rank skips the importance collective the others enter."""
        self._layout_checked = True
        layout = self._find_layout(slot)
        if self.tp_size > 1:
            ok = _tp_all_gather(torch.tensor([1.0 if layout is not None else 0.0]))
            if layout is not None and bool((ok < 0.5).any()):
                logger.warning("TokenSwift: another tensor-parallel rank could not read its KV keys; "
                               "view selection falls back to recency on all ranks")
                layout = None
        self._key_layout = layout
        if layout is not None:
            logger.info("TokenSwift: KV cache key layout %s", layout)

    def _find_layout(self, slot: int) -> str | None:
        key = self._probe_key
        if key is None:
            logger.warning("TokenSwift: could not capture a key; view selection falls back to recency")
            return None
        ctx = self.vllm_config.compilation_config.static_forward_context
        kv = ctx[self._layer_names[0]].kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        hkv = kv.shape[1] if kv.dim() == 4 else None
        k = key[0]
        d = None
        for cand in (kv.shape[-1] // 2, kv.shape[-1]):
            if hkv and k.numel() == hkv * cand:
                d = cand
                break
        if d is None:
            logger.warning("TokenSwift: unknown KV cache shape %s; view selection uses recency",
                           tuple(kv.shape))
            return None
        layout = detect_key_layout(kv, slot, self.block_size, k.reshape(hkv, d))
        if layout is None:
            logger.warning("TokenSwift: KV cache layout not recognised (shape %s); view selection "
                           "falls back to recency", tuple(kv.shape))
        return layout

    # ----------------------------------------------------------------- chains
    def _set_draft_probs(self, runner, out, rows, probs: torch.Tensor, q_depths: dict) -> None:
        """Give vLLM's rejection sampler the draft distributions q of sampled drafts.

        Standard speculative sampling (accept with min(1, p/q), else resample from
        (p - q)+) is lossless when each draft token was drawn from the q given here;
        tokens chosen deterministically (n-gram candidates, greedy rows) get a
        one-hot q, which is exactly vLLM's point-mass treatment.
        Shape: ``[num_batch_rows, num_speculative_tokens, V]`` float32, rows in
        ``input_batch.req_ids`` order (vLLM ``GPUModelRunner._draft_probs``).
        """
        n_rows = len(out)
        k = self.num_spec_tokens
        v = probs.shape[-1]
        dev = probs.device
        dp = torch.zeros((n_rows, k, v), dtype=torch.float32, device=dev)
        oi, oj, ot = [], [], []
        for i, toks in enumerate(out):
            for j, t in enumerate(toks):
                oi.append(i)
                oj.append(j)
                ot.append(t)
        if oi:
            dp[torch.as_tensor(oi, device=dev), torch.as_tensor(oj, device=dev),
               torch.as_tensor(ot, device=dev)] = 1.0
        qi, qj, qr, qd = [], [], [], []
        for r, depths in q_depths.items():
            i = rows[r]
            for j, d in enumerate(depths[: len(out[i])]):
                if d is not None:
                    qi.append(i)
                    qj.append(j)
                    qr.append(r)
                    qd.append(d)
        if qi:
            dp[torch.as_tensor(qi, device=dev), torch.as_tensor(qj, device=dev)] = \
                probs[torch.as_tensor(qr, device=dev), torch.as_tensor(qd, device=dev)]
        runner._draft_probs = dp
        runner._draft_prob_req_ids = list(runner.input_batch.req_ids[:n_rows])

    def _choose_chains(self, ib, rows, states, positions, logits: torch.Tensor):
        """Penalise/filter the draft distributions, then pick a chain per request.

        Greedy requests: :func:`~vllm_tokenswift.chain.select_chain` (argmax tree paths
        and n-grams). Randomly sampled requests: each depth's token is *sampled* from
        its draft distribution q (so vLLM can verify with the true q and accept with
        probability ``Σ min(p, q)`` instead of ``p(token)``), then the chain is
        extended with confident n-gram continuations (point masses).

        Returns:
            ``(chains, probs [n, D, V], sampled)`` where ``sampled[r]`` lists, per chain
            position of row r, the depth whose q the token was drawn from (None for a
            point mass); rows absent from ``sampled`` are all point masses.
        """
        cfg = self.cfg
        n, ndist, _ = logits.shape
        if cfg.draft_penalty:
            logits = self._apply_request_filters(ib, rows, states, positions, logits)
        probs = torch.softmax(logits, dim=-1)
        tmax = max(cfg.tree[:ndist])
        top_p, top_i = probs.topk(tmax, dim=-1)
        top_i = top_i.cpu().numpy()
        contexts, cand_tokens = [], []
        for r, (i, st, p) in enumerate(zip(rows, states, positions)):
            tail = st.ngrams.n if st.ngrams is not None else 1
            ctx = ib.token_ids_cpu[i, max(0, p + 1 - tail): p + 1].tolist()
            contexts.append(ctx)
            toks = set(int(t) for t in top_i[r].reshape(-1))
            if st.ngrams is not None:
                for first in (int(top_i[r, 0, 0]), ctx[-1]):
                    for gram, _ in st.ngrams.topk(first, cfg.ngram_topk):
                        toks.update(gram)
            cand_tokens.append(sorted(toks))
        # one gather of p_d(token) for every candidate token at every depth
        width = max(len(t) for t in cand_tokens)
        idx = np.zeros((n, width), dtype=np.int64)
        for r, t in enumerate(cand_tokens):
            idx[r, : len(t)] = t
        gathered = probs.gather(2, torch.from_numpy(idx).to(probs.device).unsqueeze(1).expand(n, ndist, width))
        gathered = gathered.cpu().numpy()
        chains = []
        sampled: dict[int, list[int | None]] = {}
        random_rows = [r for r, st in enumerate(states) if st.temperature > 1e-5]
        draw_of = {r: j for j, r in enumerate(random_rows)}
        draws = None
        if random_rows:
            idx = torch.as_tensor(random_rows, dtype=torch.long, device=probs.device)
            sub = probs[idx].reshape(len(random_rows) * ndist, -1)
            draws = torch.multinomial(sub, 1).view(len(random_rows), ndist).cpu().tolist()
        for r, st in enumerate(states):
            if r in draw_of:
                depth = min(ndist, self.num_spec_tokens)
                toks = draws[draw_of[r]][:depth]
                ch = Chain(list(toks), [SOURCE_HEADS] * depth, float(depth))
                if st.ngrams is not None and cfg.ngram_topk > 0:
                    extend_chain(ch, contexts[r], st.ngrams, self.num_spec_tokens, cfg.ngram_min_conf)
                sampled[r] = list(range(depth)) + [None] * (len(ch.tokens) - depth)
                chains.append(ch)
                continue
            lut = {tok: j for j, tok in enumerate(cand_tokens[r])}
            g = gathered[r]

            def prob(d, tok, lut=lut, g=g):
                j = lut.get(tok)
                return None if j is None or d >= g.shape[0] else float(g[d, j])

            tree_tokens = [top_i[r, d, : cfg.tree[d]].tolist() for d in range(ndist)]
            chains.append(select_chain(contexts[r], tree_tokens, prob, st.ngrams, cfg.ngram_topk,
                                       self.num_spec_tokens, cfg.ngram_min_conf))
        return chains, probs, sampled

    def _apply_request_filters(self, ib, rows, states, positions, logits: torch.Tensor) -> torch.Tensor:
        """The request's repetition penalty (windowed or global), temperature and min_p on
        every draft distribution, as the target's sampler will apply them (Sec 3.4).
        The draft prefix of the chain is not added to the history (approximation)."""
        from vllm._custom_ops import apply_repetition_penalties

        n, ndist, v = logits.shape
        pen_rows = [r for r, st in enumerate(states) if st.repetition_penalty != 1.0]
        if pen_rows:
            mask = torch.zeros((len(pen_rows), v), dtype=torch.bool)
            for j, r in enumerate(pen_rows):
                st, i, p = states[r], rows[r], positions[r]
                start = max(0, p + 1 - st.window) if st.window else 0
                hist = torch.from_numpy(ib.token_ids_cpu[i, start: p + 1].astype(np.int64))
                mask[j, hist[hist < v]] = True
            mask = mask.to(logits.device)
            idx = torch.as_tensor(pen_rows, dtype=torch.long, device=logits.device)
            sub = logits[idx].reshape(len(pen_rows) * ndist, v).contiguous()
            pens = torch.as_tensor([states[r].repetition_penalty for r in pen_rows],
                                   dtype=torch.float32, device=logits.device)
            m = mask.repeat_interleave(ndist, dim=0)
            apply_repetition_penalties(sub, m, torch.zeros_like(m), pens.repeat_interleave(ndist))
            logits[idx] = sub.view(len(pen_rows), ndist, v)
        temps = torch.as_tensor([st.temperature if st.temperature > 1e-5 else 1.0 for st in states],
                                dtype=torch.float32, device=logits.device)
        logits = logits / temps.view(n, 1, 1)
        mp_rows = [r for r, st in enumerate(states) if st.min_p > 0 and st.temperature > 1e-5]
        if mp_rows:
            from vllm_tokenswift.penalty import apply_min_p

            idx = torch.as_tensor(mp_rows, dtype=torch.long, device=logits.device)
            sub = logits[idx].reshape(len(mp_rows) * ndist, v)
            mp = torch.as_tensor([states[r].min_p for r in mp_rows], dtype=torch.float32,
                                 device=logits.device).repeat_interleave(ndist)
            logits[idx] = apply_min_p(sub, mp).view(len(mp_rows), ndist, v)
        return logits


def _tp_all_gather(t: torch.Tensor) -> torch.Tensor:
    """Gather a 1-D tensor from every tensor-parallel rank: ``[world, n]`` on the CPU,
    rows in rank order (vLLM's TP group, on the device its communicator uses)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    dev = getattr(group, "device", None) or t.device
    out = group.all_gather(t.to(dev).contiguous(), dim=0)
    return out.view(group.world_size, -1).cpu()


def _kernel_blocks(group, cm):
    """Map manager block ids to kernel block ids (a private copy, so per-layer tables
    do not share vLLM's scratch buffer)."""
    if getattr(group, "kernel_block_size", None) is None:
        return cm
    mapped = group.map_to_kernel_block_table(cm.block_table_tensor).clone()
    return replace(cm, block_table_tensor=mapped)


def _layer_index(name: str) -> tuple:
    parts = []
    for tok in name.split("."):
        parts.append((0, int(tok), "") if tok.isdigit() else (1, 0, tok))
    return tuple(parts)
