"""TokenSwiftProposer: the vLLM-facing proposer (``method="custom_class"``).

Per engine step, after vLLM has sampled the newest token ``x`` (position ``p``) of every
running request, the runner patch (``patches/runner.py``) builds one
:class:`~vllm_tokenswift.core.step.StepInput` and calls :meth:`TokenSwiftProposer.propose_step`,
which runs five steps, one method each; each reads its arguments and returns its result:

1. :meth:`~TokenSwiftProposer._update` ``(step) -> (verified, rows)``: one pass over the
   requests that produced tokens: new requests get their state; every request's n-gram table
   is extended with its new tokens (Sec 3.2); a request that was handed a proposal last step
   yields a :class:`~vllm_tokenswift.core.step.Verified` (drafts verified and accepted, the
   tokens sampled); a request with room for drafts and ``x``'s slot yields a drafting
   :class:`~vllm_tokenswift.core.step.Row` (its n-gram chain built when the policy weighs it).
2. :meth:`~TokenSwiftProposer._account` ``(step, verified, started) -> None``: the
   verification in the metrics, and in the drafting policy with what the previous step's
   drafting and this step cost (:meth:`DraftingPolicy.account
   <vllm_tokenswift.core.policy.DraftingPolicy.account>`).
3. :meth:`~TokenSwiftProposer._plan` ``(rows) -> StepPlan``: the policy decides per request
   the draft forward over its budgeted view, a self-speculative chain (the draft forward
   token by token), the fused heads on the verification forward's hidden state, an n-gram
   chain alone, or no draft, and how long chains may be
   (:meth:`DraftingPolicy.plan <vllm_tokenswift.core.policy.DraftingPolicy.plan>`).
4. :meth:`~TokenSwiftProposer._draft` ``(step, plan) -> Drafts``: the chains
   (:class:`~vllm_tokenswift.engine.drafter.Drafter`): fused heads; **one** forward of the
   target over the forward rows' budgeted KV views (Sec 3.3) giving ``l_0`` and the heads
   ``l_1..l_3``; each request's penalty, temperature and min_p (Sec 3.4); greedy requests
   take the best chain of the token tree and the n-grams, sampled requests draw from q;
   self-speculative chains run the draft forward once per chain token, each over the view
   plus the chain so far; every chain cut by the policy.
5. :meth:`~TokenSwiftProposer._hand_over` ``(step, plan, drafts) -> StepProposal``: the
   chains for vLLM, with the draft distributions q of sampled tokens, so vLLM's rejection
   sampler verifies them against the full model (the output equals plain decoding); each
   request's proposal is kept for the next step's accounting.

KV safety: the draft forward writes ``x``'s K/V (computed from partial attention in layers
>= 1) into ``x``'s real slot, a self-speculative chain's forward ``j`` the K/V of its token
into the request's own lookahead slot ``p + j`` (allocated by vLLM: the ``lookahead-slot``
patch gives TokenSwift engines ``num_speculative_tokens`` lookahead tokens); the next
verification step schedules ``x`` at ``p`` and the drafts after it again and overwrites
those slots in every layer before attention reads them, slots past the verified drafts
lie past every sequence length until they are written by their own token, and prefix
caching only hashes full blocks of computed tokens, so verification never reads draft K/V.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch

from vllm_tokenswift.core.chain import request_ngram_chain
from vllm_tokenswift.core.config import TokenSwiftConfig, TokenSwiftConfigError
from vllm_tokenswift.core.draft_sampling import DraftProbBuffer
from vllm_tokenswift.core.kv_view import DraftViews, ViewPlanner
from vllm_tokenswift.core.policy import make_policy
from vllm_tokenswift.core.request_state import RequestState, new_request_state
from vllm_tokenswift.core.stats import TokenSwiftStats
from vllm_tokenswift.core.step import (CHAIN, FORWARD, FUSED, NGRAM, NONE, Drafts, Proposal, Row, StepCosts, StepInput,
                                       StepPlan, StepProposal, Verified)
from vllm_tokenswift.engine.drafter import Drafter
from vllm_tokenswift.engine.tensor_parallel import tp_all_gather, tp_broadcast_from_rank0

logger = logging.getLogger("vllm_tokenswift")


class TokenSwiftProposer:
    """TokenSwift drafting for vLLM's V1 engine (paper Sec 3.2-3.4, plus the cost-aware
    drafting policy of :mod:`vllm_tokenswift.core.policy`).

    Built by vLLM as ``Class(vllm_config)`` (``custom_class`` proposer) in the worker on the
    last pipeline stage; settings come from ``vllm_config.additional_config["tokenswift"]``
    (put there by the plugin). :meth:`from_settings` builds one without vLLM (unit tests,
    with a fake target).

    Raises (at engine start-up):
        TokenSwiftConfigError: what :func:`vllm_tokenswift.core.config.validate` refuses (the
            front end ran the same validation when the engine was created), or a model
            without a final norm / attention layers.
        vllm_tokenswift.compat.patching.TokenSwiftPatchError: the plugin's patches missing.
        vllm_tokenswift.core.heads.HeadsLoadError: heads that do not fit the target.
    """

    def __init__(self, vllm_config):
        from vllm_tokenswift.compat import check_vllm_version
        from vllm_tokenswift.core.config import validate
        from vllm_tokenswift.engine.target import TargetAccess

        check_vllm_version()
        self.vllm_config = vllm_config
        cfg = validate(vllm_config)      # the same validation the front end ran
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        block_size = int(vllm_config.cache_config.block_size)
        vocab = int(vllm_config.model_config.get_vocab_size())
        self._setup(cfg, num_spec_tokens=int(vllm_config.speculative_config.num_speculative_tokens),
                    block_size=block_size, max_model_len=int(vllm_config.model_config.max_model_len),
                    vocab_size=vocab, engine_seed=int(getattr(vllm_config.model_config, "seed", 0) or 0),
                    tp_size=tp, target=TargetAccess(vllm_config, block_size, vocab, tp, cfg.draft_forward,
                                                    cfg.draft_weights))

    @classmethod
    def from_settings(cls, cfg: TokenSwiftConfig, *, num_spec_tokens: int, block_size: int, max_model_len: int,
                      vocab_size: int, target, heads=None, engine_seed: int = 0) -> "TokenSwiftProposer":
        """A proposer without vLLM: the given settings and target (anything with
        :class:`~vllm_tokenswift.engine.target.TargetAccess`'s drafting interface), heads
        already loaded (or None), one tensor-parallel rank.

        Raises:
            TokenSwiftConfigError: ``cfg.policy`` names no drafting policy.
        """
        self = cls.__new__(cls)
        self.vllm_config = None
        self._setup(cfg, num_spec_tokens=num_spec_tokens, block_size=block_size, max_model_len=max_model_len,
                    vocab_size=vocab_size, engine_seed=engine_seed, tp_size=1, target=target)
        self._attach(heads, num_layers=len(getattr(target, "layer_names", ()) or ()) or 1)
        return self

    def _setup(self, cfg: TokenSwiftConfig, *, num_spec_tokens: int, block_size: int, max_model_len: int,
               vocab_size: int, engine_seed: int, tp_size: int, target) -> None:
        self.cfg = cfg
        self.num_spec_tokens = num_spec_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.engine_seed = engine_seed
        self.tp_size = tp_size      # every TP rank runs this proposer on its own heads' Q/KV
        self.target_access = target
        self.states: dict[str, RequestState] = {}
        self.stats = TokenSwiftStats()
        self.policy = make_policy(cfg, num_spec_tokens, tp_broadcast_from_rank0 if tp_size > 1 else None)
        self.drafter = Drafter(cfg, target, self.policy, self.stats)
        self.draft_probs = DraftProbBuffer(num_spec_tokens, vocab_size)
        self._step = 0
        self._last_end: float | None = None        # when the previous step returned
        self._last_overhead = 0.0                  # its own time outside drafting
        self._last_drafts: Drafts | None = None    # its drafting costs, observed at the next step
        self._runner = None                        # the runner of the latest step (attention counters)

    def _attach(self, heads, num_layers: int) -> None:
        """Give the drafter its heads and budgeted views (``num_layers``: groups of per-layer views)."""
        self.drafter.heads = heads
        self.policy.num_heads = heads.num_heads if heads is not None else 0
        groups = num_layers if self.cfg.view_granularity == "layer" else 1
        planner = ViewPlanner(self.cfg.kv_budget, self.cfg.sink_tokens, self.block_size, self.cfg.draft_kv, groups)
        self.drafter.views = DraftViews(planner, self.target_access.importance,
                                        tp_all_gather if self.tp_size > 1 else None, self.stats)

    @property
    def heads(self):
        """The dependent draft heads (``core.heads.DraftHeads``), None without heads."""
        return self.drafter.heads

    @property
    def last_decision(self):
        """The policy's latest cost-aware decision (``core.policy.decision.Decision``), or None."""
        return self.policy.last_decision

    # ----------------------------------------------------------------- set-up
    def load_model(self, target_model) -> None:
        """Keep a reference to the target, load the heads and install the hooks.

        Called by vLLM right after the target model is loaded (before the KV cache exists).

        Raises:
            vllm_tokenswift.compat.patching.TokenSwiftPatchError: a patch it relies on is
                not active (names it).
            TokenSwiftConfigError: the model lacks a final norm / attention layers.
        """
        from vllm_tokenswift.compat import patching

        patching.require_declared("the TokenSwift proposer")  # names any missing patch
        hf = self.vllm_config.model_config.hf_text_config
        try:
            self.target_access.attach(target_model)
        except ValueError as e:
            raise TokenSwiftConfigError(str(e)) from None
        heads = None
        if self.cfg.use_heads and self.cfg.num_heads > 0:
            from vllm_tokenswift.core.heads import load_heads

            heads = load_heads(self.cfg.heads, hidden_size=int(hf.hidden_size), num_heads=self.cfg.num_heads,
                               eps=float(getattr(hf, "rms_norm_eps", 1e-6)), dtype=self.vllm_config.model_config.dtype,
                               device=next(target_model.parameters()).device)
            logger.info("TokenSwift: loaded %d draft heads from %s", heads.num_heads, self.cfg.heads)
        self._attach(heads, len(self.target_access.layer_names))

    @property
    def target(self):
        """The target model (not ``self.model``: vLLM treats ``drafter.model`` as a draft model)."""
        return self.target_access.target

    # ----------------------------------------------------------------- state, stats
    def release_requests(self, req_ids) -> int:
        """Free the proposer state of these requests (finished, aborted, preempted or resumed).

        Called by the runner patch (``runner-state-release``) on every scheduler step,
        including steps that never reach the proposer. Unknown ids are ignored. Returns how
        many states were freed."""
        n = 0
        for rid in req_ids or ():
            if self.states.pop(rid, None) is not None:
                n += 1
        return n

    def tokenswift_stats(self) -> dict:
        """Counters and derived figures (see :class:`~vllm_tokenswift.core.stats.TokenSwiftStats`),
        the cost model's current estimates (``cost_model``, seconds), memory and the
        verification kernel's counts."""
        from vllm_tokenswift.kernels.cpu_attention import verify_attention_counts

        d = self.stats.summary(self.num_spec_tokens)
        d["key_layout"] = getattr(self.target_access, "key_layout", None)
        d["draft_forward"] = _draft_forward_status(self.target_access)
        d["native_draft_rows"] = getattr(self.target_access, "native_rows", 0)
        d["num_live_requests"] = len(self.states)
        d["prometheus_samples"] = self.stats.prometheus_samples()
        d["cost_model"] = self.policy.cost_estimates()
        d["policy"] = self.cfg.policy
        d["memory"] = self.memory()
        d["verify_attention"] = verify_attention_counts(self._runner) if self._runner is not None else {}
        return d

    def memory(self) -> dict:
        """What the proposer holds for its live requests: ``history_tokens`` (tokens their
        n-gram tables index), ``ngram_entries`` (entries of those tables' dicts and lists,
        :meth:`NGramTable.num_entries`), ``penalty_counts_bytes`` (the penalty-window count
        vectors), and ``rss_bytes``, this process's resident set (the worker's; with an
        in-process engine, the whole engine's)."""
        tables = [st.ngrams for st in self.states.values() if st.ngrams is not None]
        pen = sum(st.pen_counts.nbytes for st in self.states.values()
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
        from vllm_tokenswift.kernels.cpu_attention import verify_attention_counts

        self.stats.reset()
        if self._runner is not None:
            verify_attention_counts(self._runner, reset=True)

    # ----------------------------------------------------------------- vLLM API
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        """vLLM's plain ``custom_class`` entry point; unused while the plugin's runner patch
        is active (checked at start-up). Returns no drafts."""
        return [[] for _ in sampled_token_ids]

    @torch.inference_mode()
    def propose_step(self, step: StepInput) -> StepProposal:
        """Draft one chain per request: the five steps of the module doc.

        Args:
            step: this engine step as the runner patch read it.
        Returns:
            :class:`~vllm_tokenswift.core.step.StepProposal`: per batch row its draft chain
            (``[]``: no draft), and the draft distributions of sampled drafts.
        """
        started = self.stats.step_started()
        self._step += 1
        self._runner = step.runner
        drafts = None
        try:
            verified, rows = self._update(step)                          # 1
            self._account(step, verified, started)                       # 2
            if rows:
                plan = self._plan(rows)                                  # 3
                drafts = self._draft(step, plan)                         # 4
                proposal = self._hand_over(step, plan, drafts)           # 5
            else:
                proposal = StepProposal([[] for _ in range(step.num_rows)])
        finally:
            self.target_access.end_step()
        ended = time.perf_counter()
        drafting = drafts.seconds if drafts is not None else 0.0
        self.stats.time_draft_s += ended - started
        self._last_overhead = (ended - started) - drafting
        self._last_end = ended
        self._last_drafts = drafts
        self.stats.maybe_log(self.cfg.log_interval_s, self.num_spec_tokens)
        return proposal

    # ----------------------------------------------------------------- 1. update
    def _update(self, step: StepInput) -> tuple[list[Verified], list[Row]]:
        """One pass over the requests that produced tokens: their state (new requests get
        one), their n-gram tables extended to the newest token ``x``; the verification of
        every request that was handed a proposal last step, and the drafting rows (room for
        drafts, ``x``'s slot allocated), their n-gram chains built when the policy weighs them."""
        verified: list[Verified] = []
        rows: list[Row] = []
        with_chains = self.policy.needs_ngram_chains
        for req in step.requests:
            st = self.states.get(req.req_id)
            if st is not None:
                verified.append(Verified(st, st.last, req.num_verified, req.num_accepted, req.sampled))
            else:
                st = self.states[req.req_id] = self._new_state(req)
            st.last = Proposal()
            st.steps += 1
            p = req.pos
            token_row = step.token_ids[req.batch_row]
            if st.ngrams is not None:
                st.ngrams.extend(token_row[len(st.ngrams): p + 1].tolist())
            room = min(self.num_spec_tokens, self.max_model_len - (p + 1) - 1)
            if room <= 0:
                continue
            if not req.has_slot:
                self.stats.skipped_no_slot += 1
                continue
            m = st.ngrams.context_len if st.ngrams is not None else 1
            ctx = token_row[max(0, p + 1 - m): p + 1].tolist()
            r = Row(req.batch_row, req.req_id, st, p, room, ctx, verify_index=req.verify_index,
                    chain_room=max(0, min(room, self.cfg.max_chain_length, req.num_slots - p)))
            if with_chains and st.ngrams is not None:
                r.ngram = request_ngram_chain(st.ngrams, ctx, room, st.sampled, self.cfg.policy_tuning)
            rows.append(r)
        return verified, rows

    def _new_state(self, req) -> RequestState:
        st = new_request_state(req.req_id, req.sampling_params, ngram_n=self.cfg.ngram_n,
                               use_ngrams=self.cfg.ngram_topk > 0,
                               explore_every=self.cfg.policy_tuning.explore_every, engine_seed=self.engine_seed)
        self.policy.on_new_request(st, req.sampling_params)
        return st

    # ----------------------------------------------------------------- 2. account
    def _account(self, step: StepInput, verified: list[Verified], started: float) -> None:
        """Book what the step verified (metrics and policy) and what it cost: the time since
        our last return plus our own fixed overhead is the draft-free step cost plus what
        its draft tokens cost, a request's first apart from the rest (only a pure decode
        step tells it: no prefill tokens)."""
        n_draft = n_drafting = 0
        for v in verified:
            n_draft += v.num_verified
            n_drafting += v.num_verified > 0
            last = v.proposal
            self.stats.record_verification(list(last.sources), v.num_verified, v.num_accepted,
                                           last.kind if last.sources else None)
        costs = StepCosts.of_drafting(self._last_drafts)
        self._last_drafts = None
        n_decode = len(verified)
        new_tokens = step.num_scheduled_tokens - n_decode - n_draft
        if self._last_end is not None and n_decode and new_tokens <= 0:
            costs = replace(costs, step=((started - self._last_end) + self._last_overhead, n_decode, n_draft,
                                         n_drafting))
        self.policy.account(verified, costs)

    # ----------------------------------------------------------------- 3. plan
    def _plan(self, rows: list[Row]) -> StepPlan:
        """The policy's options and cut threshold for this step's drafting rows."""
        has_fused = (self.heads is not None and self.cfg.fused_heads and self.policy.uses_fused_heads
                     and self.target_access.has_verification_hidden)
        plan = self.policy.plan(rows, self._step, has_fused)
        if plan.plain_probe:
            self.stats.plain_probes += 1
        return plan

    # ----------------------------------------------------------------- 4. draft
    def _draft(self, step: StepInput, plan: StepPlan) -> Drafts:
        """The chains of every drafting row (:meth:`Drafter.draft`)."""
        return self.drafter.draft(step, plan)

    # ----------------------------------------------------------------- 5. hand over
    def _hand_over(self, step: StepInput, plan: StepPlan, drafts: Drafts) -> StepProposal:
        """Each row's chain (at most its room) for vLLM, its proposal kept for the next step's
        accounting, and the draft distributions of sampled tokens
        (:class:`~vllm_tokenswift.core.draft_sampling.DraftProbBuffer`)."""
        spans = {FORWARD: self.cfg.num_draft_distributions,
                 FUSED: self.heads.num_heads if self.heads is not None else 0}
        out: list[list[int]] = [[] for _ in range(step.num_rows)]
        q_by_row = {}
        any_forced = plan.any_forced
        for j, r in enumerate(plan.rows):
            cut = drafts.chains.get(j)
            kind = plan.kinds[j]
            ch = cut.chain if cut is not None else None
            # the draft forward / chain / fused heads ran for this row even if the cut left nothing
            full = plan.chain_forwards(j) if kind == CHAIN else spans.get(kind, 0)
            span = (full and min(r.room, full)) if ch is not None else 0
            if ch is None or not ch.tokens:
                toks, srcs, confs = [], [], []
                if not span:
                    kind = NONE
            else:
                toks, srcs, confs = ch.tokens[: r.room], ch.sources[: r.room], ch.confs[: r.room]
            out[r.batch_row] = list(toks)
            nxt = cut.past_cut if cut is not None else None
            if nxt is None and kind == NONE and r.ngram is not None and r.ngram.tokens:
                nxt = (r.ngram.tokens[0], r.ngram.sources[0], r.ngram.confs[0])
            r.state.last = Proposal(kind, tuple(srcs), tuple(confs), span, nxt, step=r.state.steps,
                                    forced=plan.forced[j], alongside_forced=any_forced and not plan.forced[j])
            self.stats.record_chain(list(srcs), kind)
            if kind in (FUSED, NGRAM):
                self.stats.drafts_skipped_forward += 1
            if toks and j in drafts.q_rows:
                q_by_row[r.batch_row] = drafts.q_rows[j]
        probs = self.draft_probs.fill(out, q_by_row, step.device) if q_by_row else None
        return StepProposal(out, probs)


def _draft_forward_status(target) -> str:
    """``native-bfloat16`` / ``native-float32`` (the native draft forward is on), ``pending``
    (decided on the first draft forward) or ``vllm: <why>`` (for ``tokenswift_stats``)."""
    state = getattr(target, "native_state", None)
    if state == "on":
        return f"native-{target.draft_weights}"
    if state == "pending":
        return "pending"
    return f"vllm: {getattr(target, 'native_reason', None) or 'no native draft forward'}"
