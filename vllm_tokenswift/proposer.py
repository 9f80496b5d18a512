"""TokenSwiftProposer: the vLLM-facing proposer (``method="custom_class"``).

Per engine step, after vLLM has sampled the newest token ``x`` (position ``p``) of
every running request, :meth:`TokenSwiftProposer.propose_with_runner` runs five steps,
one method each:

1. :meth:`~TokenSwiftProposer._account`: book the chains the step verified (per request:
   drafts verified and accepted, the tokens sampled) and what the step cost, in the
   metrics and in the drafting policy (:meth:`DraftingPolicy.account
   <vllm_tokenswift.drafting_policy.DraftingPolicy.account>`: acceptance per source,
   option and position, the token past the cut, the cost model).
2. :meth:`~TokenSwiftProposer._update`: extend each request's n-gram table with its new
   tokens (Sec 3.2) and build its n-gram chain; collect the requests that can draft.
3. :meth:`~TokenSwiftProposer._plan`: the policy decides per request the draft forward
   over its budgeted view, the fused heads on the verification forward's hidden state,
   an n-gram chain alone, or no draft, and how long chains may be
   (:meth:`DraftingPolicy.plan <vllm_tokenswift.drafting_policy.DraftingPolicy.plan>`:
   expected tokens per second from measured costs and acceptance under
   ``policy="adaptive"``, the draft forward every step under ``policy="paper"``).
4. :meth:`~TokenSwiftProposer._draft`: the chains (:class:`~vllm_tokenswift.drafting.Drafter`):
   fused heads; **one** forward of the target over the forward rows' budgeted KV views
   (:class:`~vllm_tokenswift.kv_view.DraftViews`, Sec 3.3) giving ``l_0`` and the heads
   ``l_1..l_3``; each request's penalty, temperature and min_p (Sec 3.4); greedy
   requests take the best chain of the token tree and the n-grams, sampled requests draw
   from q; every chain cut by the plan.
5. :meth:`~TokenSwiftProposer._hand_over`: the chains to vLLM, with the draft
   distributions q of sampled tokens (``GPUModelRunner._draft_probs``), so vLLM's
   rejection sampler verifies them against the full model: the output equals plain
   decoding.

How it reaches the runner: vLLM's ``custom_class`` proposers only get token ids.
The plugin's runner patch (``patches/runner.py``) reroutes
``GPUModelRunner.propose_draft_token_ids`` (inherited by the CPU runner) to
:meth:`propose_with_runner` for this class.

KV safety: the draft forward writes ``x``'s K/V (computed from partial
attention in layers >= 1) into ``x``'s real slot; the next verification step
schedules ``x`` at ``p`` again and overwrites that slot in every layer before
attention reads it, and prefix caching only hashes full blocks of computed
tokens, so verification never reads draft K/V.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from vllm_tokenswift import policy as pol
from vllm_tokenswift.config import TokenSwiftConfigError
from vllm_tokenswift.config import validate as validate_engine_config
from vllm_tokenswift.cpu_attention import verify_attention_counts
from vllm_tokenswift.draft_forward import TargetAccess, tp_all_gather, tp_broadcast_from_rank0
from vllm_tokenswift.drafting import Drafter, row_ngram_chain
from vllm_tokenswift.drafting_policy import DraftingPolicy, StepCosts, StepPlan, Verified, probe_chain
from vllm_tokenswift.kv_view import DraftViews, ViewPlanner
from vllm_tokenswift.metrics import TokenSwiftStats
from vllm_tokenswift.patches.common import finished_request_ids
from vllm_tokenswift.profiling import PROFILE
from vllm_tokenswift.request_state import Proposal, RequestState, Row, new_request_state

logger = logging.getLogger("vllm_tokenswift")


class TokenSwiftProposer:
    """TokenSwift drafting for vLLM's V1 engine (paper Sec 3.2-3.4, plus the cost-aware
    drafting policy of :mod:`vllm_tokenswift.policy`).

    Built by vLLM as ``Class(vllm_config)`` (``custom_class`` proposer) in the
    worker on the last pipeline stage. Settings come from
    ``vllm_config.additional_config["tokenswift"]`` (put there by the plugin).

    Raises (at engine start-up):
        TokenSwiftConfigError: what :func:`vllm_tokenswift.config.validate` refuses (the
            front end ran the same validation when the engine was created), or a model
            without a final norm / attention layers.
        vllm_tokenswift.patches.TokenSwiftPatchError: the plugin's patches missing.
        vllm_tokenswift.heads.HeadsLoadError: heads that do not fit the target.
    """

    def __init__(self, vllm_config):
        from vllm_tokenswift.compat import check_vllm_version

        check_vllm_version()
        self.vllm_config = vllm_config
        # the same validation the front end ran when the engine was created
        self.cfg = validate_engine_config(vllm_config)
        self.num_spec_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        # tensor parallelism: every TP rank runs this proposer on its own heads' Q/KV
        self.tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.engine_seed = int(getattr(vllm_config.model_config, "seed", 0) or 0)
        self.states: dict[str, RequestState] = {}
        self.stats = TokenSwiftStats()
        self.access = TargetAccess(vllm_config, self.block_size, self.vocab_size, self.tp_size)
        self.policy = DraftingPolicy(self.cfg, self.num_spec_tokens,
                                     tp_broadcast=tp_broadcast_from_rank0 if self.tp_size > 1 else None)
        self.drafter = Drafter(self.cfg, self.access, None, self.stats, self.vocab_size, self.num_spec_tokens)
        self._step = 0
        self._last_end: float | None = None
        self._last_overhead = 0.0
        self._last_draft_costs = StepCosts()
        self._runner = None   # the model runner of the latest step (for its attention counters)

    @property
    def heads(self):
        """The dependent draft heads (``heads.DraftHeads``), None without heads."""
        return self.drafter.heads

    @property
    def last_decision(self) -> pol.Decision | None:
        """The adaptive policy's latest :class:`policy.Decision` (None before one)."""
        return self.policy.last_decision

    # ----------------------------------------------------------------- set-up
    def load_model(self, target_model) -> None:
        """Keep a reference to the target, load the heads and install the hooks.

        Called by vLLM right after the target model is loaded (before the KV cache
        exists).

        Raises:
            vllm_tokenswift.patches.TokenSwiftPatchError: a patch it relies on is not
                active (names it).
            TokenSwiftConfigError: the model lacks a final norm / attention layers.
        """
        from vllm_tokenswift import plugin

        plugin.require_patches("the TokenSwift proposer")  # names any missing patch
        hf = self.vllm_config.model_config.hf_text_config
        hidden = int(hf.hidden_size)
        eps = float(getattr(hf, "rms_norm_eps", 1e-6))
        dtype = self.vllm_config.model_config.dtype
        device = next(target_model.parameters()).device
        try:
            self.access.attach(target_model)
        except ValueError as e:
            raise TokenSwiftConfigError(str(e)) from None
        if self.cfg.use_heads and self.cfg.num_heads > 0:
            from vllm_tokenswift.heads import load_heads

            heads = load_heads(self.cfg.heads, hidden_size=hidden, num_heads=self.cfg.num_heads,
                               eps=eps, dtype=dtype, device=device)
            self.drafter.heads = heads
            self.policy.num_heads = heads.num_heads
            logger.info("TokenSwift: loaded %d draft heads from %s", heads.num_heads, self.cfg.heads)
        groups = len(self.access.layer_names) if self.cfg.view_granularity == "layer" else 1
        planner = ViewPlanner(self.cfg.kv_budget, self.cfg.sink_tokens, self.block_size, self.cfg.draft_kv, groups)
        self.drafter.views = DraftViews(planner, self.access.importance,
                                        tp_all_gather if self.tp_size > 1 else None, self.stats)

    @property
    def target(self):
        """The target model (not ``self.model``: vLLM treats ``drafter.model`` as a draft model)."""
        return self.access.target

    # ----------------------------------------------------------------- state, stats
    def release_requests(self, req_ids) -> int:
        """Free the proposer state of these requests (finished, aborted or preempted).

        Called by the plugin's hook on the runner's state update, so state is freed
        even when vLLM flushes a finish in a step that runs no proposer. Unknown ids are
        ignored. Returns how many states were freed."""
        n = 0
        for rid in req_ids or ():
            if self.states.pop(rid, None) is not None:
                n += 1
        return n

    def tokenswift_stats(self) -> dict:
        """Counters and derived figures (see :class:`~vllm_tokenswift.metrics.TokenSwiftStats`),
        plus the cost model's current estimates (``cost_model``, seconds)."""
        d = self.stats.summary(self.num_spec_tokens)
        d["key_layout"] = self.access.key_layout
        d["num_live_requests"] = len(self.states)
        d["prometheus_samples"] = self.stats.prometheus_samples()
        d["cost_model"] = self.policy.costs.costs() if self.policy.costs.ready else None
        d["policy"] = self.cfg.policy
        d["memory"] = self.memory()
        d["profile"] = PROFILE.snapshot()
        d["verify_attention"] = verify_attention_counts(self._runner) if self._runner is not None else {}
        return d

    def memory(self) -> dict:
        """What the proposer holds for its live requests: ``history_tokens`` (tokens their
        n-gram tables index), ``ngram_entries`` (entries of those tables' dicts and lists,
        :meth:`NGramTable.num_entries`), ``penalty_counts_bytes`` (the penalty-window count
        vectors), and ``rss_bytes``, this process's resident set (the worker's; with an
        in-process engine, the whole engine's)."""
        tables = [st.ngrams for st in self.states.values() if st.ngrams is not None]
        pen = sum(st.pen_counts.numel() * st.pen_counts.element_size() for st in self.states.values()
                  if st.pen_counts is not None)
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            rss = None
        return {"history_tokens": sum(len(t) for t in tables),
                "ngram_entries": sum(t.num_entries() for t in tables),
                "penalty_counts_bytes": pen, "rss_bytes": rss}

    def reset_tokenswift_stats(self) -> None:
        """Zero the counters (in place: the drafter and the views hold the same object)."""
        self.stats.reset()
        PROFILE.reset()
        if self._runner is not None:
            verify_attention_counts(self._runner, reset=True)

    # ----------------------------------------------------------------- vLLM API
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        """vLLM's plain ``custom_class`` entry point; unused while the plugin's runner
        patch is active (checked at start-up). Returns no drafts."""
        return [[] for _ in sampled_token_ids]

    @torch.inference_mode()
    def propose_with_runner(self, runner, scheduler_output, sampled, sampling_metadata=None, **_):
        """Draft one chain per request: the five steps of the module doc.

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
        self._runner = runner
        out: list[list[int]] = [[] for _ in range(len(sampled))]
        step_fwd_s = step_fused_s = 0.0
        try:
            self._account(runner, scheduler_output, sampled, t0)          # 1
            rows = self._update(runner, scheduler_output, sampled)         # 2
            if rows:
                plan = self._plan(rows)                                    # 3
                drafts = self._draft(runner, plan)                         # 4
                self._hand_over(runner, plan, drafts, out)                 # 5
                self._last_draft_costs = StepCosts.of_drafting(drafts.forward, drafts.fused,
                                                               drafts.forward_selected)
                step_fwd_s = drafts.forward[0] if drafts.forward else 0.0
                step_fused_s = drafts.fused[0] if drafts.fused else 0.0
        finally:
            self.access.end_step()
        t1 = time.perf_counter()
        if PROFILE.enabled:
            PROFILE.add("propose", t1 - t0)
            PROFILE.count("steps")
        self.stats.time_draft_s += t1 - t0
        self._last_overhead = (t1 - t0) - step_fwd_s - step_fused_s
        self._last_end = t1
        self.stats.maybe_log(self.cfg.log_interval_s, self.num_spec_tokens)
        return out

    # ----------------------------------------------------------------- 1. account
    def _account(self, runner, scheduler_output, sampled, t0: float) -> None:
        """Free the state of finished, aborted, preempted and resumed requests; book what
        the step verified for every request that proposed last step (metrics and
        policy), and the step's cost: the time since our last return plus our own fixed
        overhead is the draft-free step cost plus ``b`` per draft token (only a pure
        decode step tells it)."""
        ib = runner.input_batch
        live = ib.req_id_to_index
        self.release_requests(finished_request_ids(scheduler_output))
        if len(self.states) > len(live):
            self.release_requests([r for r in self.states if r not in live])
        spec = scheduler_output.scheduled_spec_decode_tokens
        verified = []
        n_draft = 0
        for i, s in enumerate(sampled):
            if not s or i >= len(ib.req_ids):
                continue
            st = self.states.get(ib.req_ids[i])
            if st is None:
                continue
            k = len(spec.get(ib.req_ids[i], ()))
            n_draft += k
            verified.append(Verified(st, k, len(s) - 1, s))
            last = st.last
            self.stats.record_verification(last.sources, k, len(s) - 1, last.kind if last.sources else None)
        costs = self._last_draft_costs
        self._last_draft_costs = StepCosts()
        n_decode = len(verified)
        new_tokens = int(scheduler_output.total_num_scheduled_tokens) - n_decode - n_draft
        if self._last_end is not None and n_decode and new_tokens <= 0:
            costs.step = ((t0 - self._last_end) + self._last_overhead, n_decode, n_draft)
        self.policy.account(verified, costs)

    # ----------------------------------------------------------------- 2. update
    def _update(self, runner, scheduler_output, sampled) -> list[Row]:
        """Per request with new tokens: its state (new requests get one), its n-gram table
        extended to the newest token ``x`` at position ``p`` and its n-gram chain; returns
        the requests with room for drafts and ``x``'s slot allocated."""
        ib = runner.input_batch
        nblk = ib.block_table[0].num_blocks_per_row
        spec = scheduler_output.scheduled_spec_decode_tokens
        qsl = runner.query_start_loc.np
        rows: list[Row] = []
        for i, s in enumerate(sampled):
            if not s or i >= len(ib.req_ids):
                continue
            rid = ib.req_ids[i]
            p = int(ib.num_tokens_no_spec[i]) - 1
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = self._new_state(runner, rid)
            st.last = Proposal()
            st.steps += 1
            if st.ngrams is not None:
                st.ngrams.extend(ib.token_ids_cpu[i, len(st.ngrams): p + 1].tolist())
            room = min(self.num_spec_tokens, self.max_model_len - (p + 1) - 1)
            if room <= 0:
                continue
            if p // self.block_size >= nblk[i]:
                self.stats.skipped_no_slot += 1
                continue
            m = st.ngrams.context_len if st.ngrams is not None else 1
            ctx = ib.token_ids_cpu[i, max(0, p + 1 - m): p + 1].tolist()
            k, a = len(spec.get(rid, ())), len(s) - 1
            r = Row(i, rid, st, p, room, ctx, verify_index=int(qsl[i + 1]) - 1 - (k - a))
            if st.ngrams is not None:
                r.ngram = row_ngram_chain(st, ctx, room, self.cfg.policy_tuning)
            rows.append(r)
        return rows

    def _new_state(self, runner, req_id: str) -> RequestState:
        sp = getattr(runner.requests.get(req_id), "sampling_params", None)
        return new_request_state(req_id, sp, ngram_n=self.cfg.ngram_n, use_ngrams=self.cfg.ngram_topk > 0,
                                 explore_every=self.cfg.policy_tuning.explore_every,
                                 engine_seed=self.engine_seed, probe=self.cfg.policy == "probe")

    # ----------------------------------------------------------------- 3. plan
    def _plan(self, rows: list[Row]) -> StepPlan:
        """The policy's options and cut threshold for this step's drafting rows."""
        has_fused = (self.heads is not None and self.cfg.fused_heads and self.cfg.policy != "paper"
                     and self.access.has_verification_hidden)
        plan = self.policy.plan(rows, self._step, has_fused)
        if plan.decision is not None and plan.decision.plain_probe:
            self.stats.plain_probes += 1
        return plan

    # ----------------------------------------------------------------- 4. draft
    def _draft(self, runner, plan: StepPlan):
        """The chains of every drafting row (:meth:`Drafter.draft`)."""
        return self.drafter.draft(runner, plan, self._step)

    # ----------------------------------------------------------------- 5. hand over
    def _hand_over(self, runner, plan: StepPlan, drafts, out: list[list[int]]) -> None:
        """Write each row's chain into ``out`` (at most its room), record its proposal for
        the next step's accounting, and give vLLM the draft distributions of sampled
        tokens (:meth:`Drafter.set_draft_probs`)."""
        spans = {pol.FORWARD: self.cfg.num_draft_distributions,
                 pol.FUSED: self.heads.num_heads if self.heads is not None else 0}
        any_sampled = False
        for j, r in enumerate(plan.rows):
            ch = drafts.chains.get(j)
            kind = plan.kinds[j]
            if self.cfg.policy == "probe":
                ch = probe_chain(ch, r)
            # the draft forward / fused heads ran for this row even if the cut left nothing
            span = (spans.get(kind, 0) and min(r.room, spans[kind])) if ch is not None else 0
            if ch is None or not ch.tokens:
                toks, srcs, confs = [], [], []
                if not span:
                    kind = pol.NONE
            else:
                toks, srcs, confs = ch.tokens[: r.room], ch.sources[: r.room], ch.confs[: r.room]
            out[r.batch_row] = toks
            r.state.last = plan.proposal(r, kind, srcs, confs, span)
            self.stats.record_chain(list(srcs), kind)
            if kind in (pol.FUSED, pol.NGRAM):
                self.stats.drafts_skipped_forward += 1
            any_sampled |= j in drafts.q_rows and bool(toks)
        if any_sampled:
            self.drafter.set_draft_probs(runner, plan.rows, out, drafts.q_rows)
