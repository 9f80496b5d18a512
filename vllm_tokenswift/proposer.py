"""TokenSwiftProposer: the vLLM-facing proposer (``method="custom_class"``).

Per engine step, after vLLM has sampled the newest token ``x`` (position ``p``) of
every running request, :meth:`TokenSwiftProposer.propose_with_runner` runs this
pipeline:

1. **Account** for the chain verified this step: acceptance per source, per draft
   position and per option (``metrics``, ``policy``), the step's measured cost; when
   every draft was accepted (or none proposed), the token sampled after them also tells
   whether the chain's first token past the cut would have been accepted, and the
   calibration books that too.
2. **Update** each request's n-gram table with its new tokens (Sec 3.2).
3. **Decide** (``policy``): per request, the draft forward over its budgeted view,
   fused heads on the verification forward's hidden state, an n-gram chain alone,
   or no draft, and how long the chain may be, maximising expected tokens per
   second from measured costs and acceptance (``policy="adaptive"``), or the draft
   forward every step (``policy="paper"``).
4. **Draft**:
   * fused rows: the dependent heads on the pre-norm hidden state the
     verification forward computed at the position before ``x`` (no forward);
   * forward rows: plan their budgeted KV views (``kv_view``; Sec 3.3, re-selected
     from block importance when the recent part overflows the budget) and run
     **one** forward of the target model for all of them (one token each), which
     gives ``h_0`` → ``l_0`` and the heads ``l_1..l_3`` (``draft_forward``);
   * both: apply each request's penalty, temperature and min_p (Sec 3.4;
     ``penalty``), then build the chain (``chain``): greedy requests take the best
     chain from the tree and the n-gram candidates, sampled requests draw each
     position from its draft distribution q; chains are cut where their
     calibrated acceptance estimate stops paying for its verification;
   * n-gram rows: the n-gram chain computed for the decision.
5. **Hand over** the chains to vLLM, with the draft distributions q of sampled
   tokens (``GPUModelRunner._draft_probs``), so vLLM's rejection sampler verifies
   them against the full model: the output equals plain decoding.

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

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_tokenswift import policy as pol
from vllm_tokenswift.chain import (SOURCE_FUSED, SOURCE_HEADS, SOURCE_NGRAM, Chain, build_chain,
                                   extend_chain, ngram_chain, select_chain)
from vllm_tokenswift.cpu_attention import verify_attention_counts
from vllm_tokenswift.config import PolicyTuning, TokenSwiftConfigError
from vllm_tokenswift.config import validate as validate_engine_config
from vllm_tokenswift.draft_forward import TargetAccess, tp_all_gather, tp_broadcast_from_rank0
from vllm_tokenswift.kv_view import RequestView, ViewPlanner, sum_over_ranks
from vllm_tokenswift.metrics import TokenSwiftStats
from vllm_tokenswift.ngram import NGramTable
from vllm_tokenswift.patches.common import finished_request_ids
from vllm_tokenswift.penalty import window_from_params
from vllm_tokenswift.profiling import PROFILE

logger = logging.getLogger("vllm_tokenswift")

#: adaptive policy: a request tries the draft forward / fused heads at least once every
#: ``policy_tuning.explore_every`` of its steps (deterministic exploration), a gap that
#: doubles after every forced try the policy did not then take up voluntarily, up to
#: ``policy_tuning.explore_max`` steps (an option that never pays costs ever less) ...
#: ... and a due try waits for the next engine step that is a multiple of this, so that
#: the due requests of a batch try together and share one draft forward: its fixed cost
#: (reading all the weights) is most of what a try costs, whatever the rows (batch-8
#: trace, paper sampling, docs/bench/smollm2/step-trace/b8-paper.txt: a draft forward for
#: 1-3 rows cost 79-95 ms against a 108 ms plain step).
#: Requests that arrive at different times would otherwise each pay it on their own step.
EXPLORE_ALIGN = 16
#: tensor parallelism: rank 0's cost model is broadcast every this many steps
COST_SYNC_EVERY = 16
#: the cost model's fits are solved again after this many step observations (any draft
#: forward or fused-heads observation re-solves at once; see policy.CostModel)
COST_REFRESH_EVERY = 8
#: n-gram chains are built down to this cumulative frequency (the policy cuts them)
NGRAM_FLOOR = 0.05


def _calibration_keys(sources, sampled: bool) -> list[int]:
    """The calibration's source keys of a chain's tokens: the token's source, offset by 10
    for sampled requests. A greedy request's draft is accepted when it is the target's
    argmax; a sampled request's point-mass draft (an n-gram token) with the target's
    probability of it, and a drawn one with min(1, p/q): the same confidence means
    different acceptance, so the two groups are calibrated apart (one engine serving a
    looping greedy request would otherwise tell sampled requests that n-gram chains pay)."""
    off = 10 if sampled else 0
    return [s + off for s in sources]


@dataclass
class _Proposal:
    """What the proposer handed to vLLM for one request last step (for accounting)."""

    kind: str = pol.NONE
    sources: list = field(default_factory=list)
    confs: list = field(default_factory=list)
    span: int = 0        # draft forward / fused heads: the positions the option could draft
    #: (token, calibration source key, confidence) of the chain's first token past the
    #: cut, when the output tells whether it would have been accepted
    #: (:meth:`policy.Calibration.observe`); None otherwise
    next: tuple | None = None


@dataclass
class _RequestState:
    """Everything the proposer keeps per running request (freed on finish, abort,
    preemption and resumption)."""

    ngrams: NGramTable | None
    view: RequestView = field(default_factory=RequestView)
    temperature: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    window: int = 0
    seed: int = 0
    generator: torch.Generator | None = None
    last: _Proposal = field(default_factory=_Proposal)
    acceptance: dict = field(default_factory=dict)     # policy.AcceptanceModel.new_request()
    steps: int = 0
    tried: dict = field(default_factory=dict)          # kind -> step it was last taken
    explore_gap: int = PolicyTuning().explore_every     # steps between forced tries
    all_accepted: bool = False   # last step verified a full-length chain and accepted all of it
    q_row: int = -1          # row of this request in the last draft forward's captured queries
    q_step: int = -1         # step id of that capture
    pen_counts: torch.Tensor | None = None              # [V] int32: tokens in the penalty history
    pen_lo: int = 0
    pen_hi: int = 0
    probe: tuple[str, int] = (pol.NGRAM, 0)  # policy "probe": the request's option and chain length

    @property
    def sampled(self) -> bool:
        return self.temperature > 1e-5

    def took(self, kind: str, forced: bool, alongside_forced: bool = False, *,
             tuning: PolicyTuning) -> None:
        """Book that the request took option ``kind`` this step: the adaptive policy's
        exploration gap doubles after a forced try of the draft forward or the fused
        heads (up to ``tuning.explore_max``) and resets to ``tuning.explore_every`` when the
        policy chose one of them on its own.

        ``alongside_forced``: another request of the batch was forced to try this step.
        The policy then chose this request's option knowing that the try's fixed costs
        (``g``, the draft forward's ``f0``, the fused heads' ``h0``) are paid anyway, at
        a marginal value; that counts as a try, not as a voluntary choice. (Counted as a
        voluntary choice, it reset the gap, which made more forced tries, which made more
        such choices: at batch 8 under the paper's sampling, 149 draft-forward and 145
        fused-heads request-steps in one round against 23 and 16 in the round before.)"""
        self.tried[kind] = self.steps
        if kind in (pol.FORWARD, pol.FUSED):
            self.explore_gap = (min(2 * self.explore_gap, tuning.explore_max) if forced or alongside_forced
                                else tuning.explore_every)


@dataclass
class _Row:
    """One drafting request this step."""

    batch_row: int
    req_id: str
    state: _RequestState
    pos: int                  # position of the newest token x
    room: int                 # most draft tokens that fit before max_model_len
    context: list             # last NGramTable.context_len tokens up to x (for n-grams)
    ngram: Chain | None = None
    verify_index: int = -1    # flat token index of h_{p-1} in this step's verification forward
    forced: bool = False      # the policy must give this row at least one draft (exploration)
    past_cut: tuple | None = None   # (token, source, conf) of the chain's first token past the cut


PROBE_KEY = "tokenswift_probe"


def probe_directive(extra_args) -> tuple[str, int]:
    """A request's ``extra_args["tokenswift_probe"]`` under ``policy="probe"``: its option
    (``"forward"`` or ``"ngram"``) and exact chain length (default: ``("ngram", 0)``, plain
    decoding steps).

    Raises:
        ValueError: an unknown option or a negative length.
    """
    d = (extra_args or {}).get(PROBE_KEY) or {}
    kind, drafts = d.get("kind", pol.NGRAM), int(d.get("drafts", 0))
    if kind not in (pol.FORWARD, pol.NGRAM) or drafts < 0:
        raise ValueError(f"{PROBE_KEY} needs kind 'forward' or 'ngram' and drafts >= 0, got {d!r}")
    return kind, drafts


def _probe_chain(ch: Chain | None, r: "_Row") -> Chain:
    """The probe's chain of exactly ``drafts`` tokens (at most the row's room): the
    option's own chain, cut or padded with the newest token (as an n-gram token, a point
    mass)."""
    n = min(r.state.probe[1], r.room)
    ch = ch if ch is not None else Chain([], [], 0.0)
    ch = ch.truncate(min(n, len(ch.tokens)))
    ch.confs = list(ch.confs) + [0.0] * (len(ch.tokens) - len(ch.confs))
    pad = n - len(ch.tokens)
    if pad > 0:
        ch.tokens += [int(r.context[-1])] * pad
        ch.sources += [SOURCE_NGRAM] * pad
        ch.confs += [0.0] * pad
    return ch


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
        self.states: dict[str, _RequestState] = {}
        self.stats = TokenSwiftStats()
        self.access = TargetAccess(vllm_config, self.block_size, self.vocab_size, self.tp_size)
        self.heads = None
        self._planner: ViewPlanner | None = None
        self.costs = pol.CostModel(refresh_every=COST_REFRESH_EVERY,
                                   prior_b=self.tuning.draft_token_cost_prior)
        self.acceptance = pol.AcceptanceModel(self.num_spec_tokens)
        self.calibration = pol.Calibration(positions=self.num_spec_tokens)
        self._step = 0
        self._last_fwd_step = -1      # step of the latest draft forward (whose queries are held)
        self._last_end: float | None = None
        self._last_overhead = 0.0
        self._dp_buf: torch.Tensor | None = None
        self._row_tokens: np.ndarray | None = None
        self._step_fwd_s = 0.0
        self._step_fused_s = 0.0
        self.last_decision: pol.Decision | None = None
        self._runner = None   # the model runner of the latest step (for its attention counters)

    @property
    def tuning(self):
        """The adaptive policy's advanced settings (``config.PolicyTuning``)."""
        return self.cfg.policy_tuning

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

            self.heads = load_heads(self.cfg.heads, hidden_size=hidden, num_heads=self.cfg.num_heads,
                                    eps=eps, dtype=dtype, device=device)
            logger.info("TokenSwift: loaded %d draft heads from %s", self.heads.num_heads, self.cfg.heads)
        groups = len(self.access.layer_names) if self.cfg.view_granularity == "layer" else 1
        self._planner = ViewPlanner(self.cfg.kv_budget, self.cfg.sink_tokens, self.block_size,
                                    self.cfg.draft_kv, groups)

    @property
    def target(self):
        """The target model (not ``self.model``: vLLM treats ``drafter.model`` as a draft model)."""
        return self.access.target

    # ----------------------------------------------------------------- state
    def _forget(self, scheduler_output, live: dict) -> None:
        """Free the state of finished, aborted, preempted and resumed requests."""
        self.release_requests(finished_request_ids(scheduler_output))
        if len(self.states) > len(live):
            self.release_requests([r for r in self.states if r not in live])

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

    def _new_state(self, runner, req_id: str) -> _RequestState:
        req = runner.requests.get(req_id)
        sp = getattr(req, "sampling_params", None)
        ng = NGramTable(self.cfg.ngram_n) if self.cfg.ngram_topk > 0 else None
        st = _RequestState(ngrams=ng, explore_gap=self.tuning.explore_every)
        if sp is not None:
            st.temperature = float(sp.temperature)
            st.min_p = float(sp.min_p or 0.0)
            st.repetition_penalty = float(sp.repetition_penalty)
            st.window = window_from_params(sp)
            if sp.seed is not None:
                st.seed = int(sp.seed)
            else:
                # rank-independent and batch-independent: the engine seed and the request id
                h = hashlib.sha256(f"{self.engine_seed}:{req_id}".encode()).digest()
                st.seed = int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
        if self.cfg.policy == "probe":
            st.probe = probe_directive(getattr(sp, "extra_args", None))
        # greedy and sampled requests learn from separate engine-wide acceptance figures
        st.acceptance = self.acceptance.new_request("sampled" if st.sampled else "greedy")
        return st

    def tokenswift_stats(self) -> dict:
        """Counters and derived figures (see :class:`~vllm_tokenswift.metrics.TokenSwiftStats`),
        plus the cost model's current estimates (``cost_model``, seconds)."""
        d = self.stats.summary(self.num_spec_tokens)
        d["key_layout"] = self.access.key_layout
        d["num_live_requests"] = len(self.states)
        d["prometheus_samples"] = self.stats.prometheus_samples()
        d["cost_model"] = self.costs.costs() if self.costs.ready else None
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
        self.stats = TokenSwiftStats()
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
        self._runner = runner
        ib = runner.input_batch
        self._row_tokens = ib.token_ids_cpu
        self._forget(scheduler_output, ib.req_id_to_index)
        out: list[list[int]] = [[] for _ in range(len(sampled))]
        try:
            rows = self._account_and_collect(runner, scheduler_output, sampled, t0)
            if rows:
                self._draft(runner, rows, out)
        finally:
            self.access.end_step()
        t1 = time.perf_counter()
        if PROFILE.enabled:
            PROFILE.add("propose", t1 - t0)
            PROFILE.count("steps")
        self.stats.time_draft_s += t1 - t0
        self._last_overhead = (t1 - t0) - self._step_fwd_s - self._step_fused_s
        self._last_end = t1
        self.stats.maybe_log(self.cfg.log_interval_s, self.num_spec_tokens)
        return out

    # ----------------------------------------------------------------- 1-2. accounting, n-grams
    def _account_and_collect(self, runner, scheduler_output, sampled, t0) -> list[_Row]:
        ib = runner.input_batch
        bt = ib.block_table[0]
        nblk = bt.num_blocks_per_row
        req_ids = ib.req_ids
        spec = scheduler_output.scheduled_spec_decode_tokens
        qsl = runner.query_start_loc.np
        bs = self.block_size
        self._step_fwd_s = 0.0
        self._step_fused_s = 0.0
        rows: list[_Row] = []
        n_decode = n_draft = 0
        for i, s in enumerate(sampled):
            if not s or i >= len(req_ids):
                continue
            rid = req_ids[i]
            p = int(ib.num_tokens_no_spec[i]) - 1
            st = self.states.get(rid)
            k = len(spec.get(rid, ()))
            a = len(s) - 1
            if st is None:
                st = self.states[rid] = self._new_state(runner, rid)
            else:
                n_decode += 1
                n_draft += k
                self._account(st, k, a, s)
            st.last = _Proposal()
            st.steps += 1
            if st.ngrams is not None:
                st.ngrams.extend(ib.token_ids_cpu[i, len(st.ngrams): p + 1].tolist())
            room = min(self.num_spec_tokens, self.max_model_len - (p + 1) - 1)
            if room <= 0:
                continue
            if p // bs >= nblk[i]:
                self.stats.skipped_no_slot += 1
                continue
            m = st.ngrams.context_len if st.ngrams is not None else 1
            ctx = ib.token_ids_cpu[i, max(0, p + 1 - m): p + 1].tolist()
            rows.append(_Row(i, rid, st, p, room, ctx, verify_index=int(qsl[i + 1]) - 1 - (k - a)))
        # the step that just ran verified what we proposed last step: its cost (outside
        # the proposer) plus our own fixed overhead is the draft-free step cost + b per draft
        new_tokens = int(scheduler_output.total_num_scheduled_tokens) - n_decode - n_draft
        if self._last_end is not None and n_decode and new_tokens <= 0:
            self.costs.observe_step((t0 - self._last_end) + self._last_overhead, n_decode, n_draft)
        return rows

    def _account(self, st: _RequestState, num_verified: int, num_accepted: int,
                 tokens: list[int] | None = None) -> None:
        """Book last step's proposal of ``st`` as verified (acceptance per source/option).

        ``tokens``: what the step sampled for the request (the accepted drafts, then the
        bonus token). When every draft proposed was verified and accepted (none proposed
        included), the bonus token tells whether the chain's first token past the cut
        would have been accepted too: that is booked in the calibration as an
        observation of its own (:meth:`policy.Calibration.observe`)."""
        last = st.last
        nxt = last.next
        if (nxt is not None and tokens is not None and self.tuning.observe_past_cut
                and num_verified == len(last.sources)
                and num_accepted == num_verified):
            self.calibration.observe(nxt[1], num_verified, nxt[2], int(tokens[num_accepted]) == nxt[0])
        st.all_accepted = num_verified >= self.num_spec_tokens and num_accepted >= num_verified
        self.stats.record_verification(last.sources, num_verified, num_accepted,
                                       last.kind if last.sources else None)
        if last.span:
            # the draft forward or fused heads ran: book what they realised, a chain the
            # cut emptied or shortened included
            self.acceptance.record(st.acceptance, last.kind, num_verified, num_accepted, last.span)
        if num_verified <= 0 or not last.sources:
            return
        if not last.span:
            self.acceptance.record(st.acceptance, last.kind, num_verified, num_accepted)
        self.calibration.update(_calibration_keys(last.sources, st.sampled), last.confs,
                                num_verified, num_accepted)

    # ----------------------------------------------------------------- 3-5. decide, draft, hand over
    def _draft(self, runner, rows: list[_Row], out: list[list[int]]) -> None:
        cfg = self.cfg
        has_fused = (self.heads is not None and cfg.fused_heads and cfg.policy != "paper"
                     and self.access.has_verification_hidden)
        options = []
        for r in rows:
            st = r.state
            if st.ngrams is not None:
                r.ngram = self._ngram_chain(st, r.context, r.room)
            options.append(self._row_options(r, has_fused))
            r.forced = options[-1].forced not in (None, pol.NONE)
        if cfg.policy == "paper":
            kinds = [pol.FORWARD] * len(rows)
            threshold = -1.0
        elif cfg.policy == "probe":
            kinds = [r.state.probe[0] for r in rows]
            threshold = -1.0
        else:
            if self.tp_size > 1 and self._step % COST_SYNC_EVERY == 1:
                self.costs.load_state(tp_broadcast_from_rank0(self.costs.state()))
            costs = self.costs.costs()
            dec = pol.decide(options, costs, self.tuning.min_gain)
            if cfg.policy == "adaptive" and pol.needs_plain_probe(
                    dec, options, costs, self.costs.plain_observations()):
                dec = pol.plain_decision(options, costs)
                self.stats.plain_probes += 1
            self.last_decision = dec
            kinds, threshold = dec.kinds, dec.threshold
        by_kind: dict[str, list[int]] = {k: [] for k in pol.KINDS}
        for j, kind in enumerate(kinds):
            by_kind[kind].append(j)

        chains: dict[int, Chain] = {}
        q_rows: dict[int, tuple[torch.Tensor, list]] = {}
        if by_kind[pol.FUSED]:
            self._draft_fused(runner, rows, by_kind[pol.FUSED], chains, q_rows, threshold)
        if by_kind[pol.FORWARD]:
            self._draft_forward(runner, rows, by_kind[pol.FORWARD], chains, q_rows, threshold)
        for j in by_kind[pol.NGRAM]:
            r = rows[j]
            ch = r.ngram if r.ngram is not None else Chain([], [], 0.0)
            chains[j] = self._cut(ch, r, threshold, options[j].cums.get(pol.NGRAM))

        spans = {pol.FORWARD: cfg.num_draft_distributions,
                 pol.FUSED: self.heads.num_heads if self.heads is not None else 0}
        any_sampled = False
        any_forced = any(r.forced for r in rows)
        for j, r in enumerate(rows):
            ch = chains.get(j)
            kind = kinds[j]
            if cfg.policy == "probe":
                ch = _probe_chain(ch, r)
            # the draft forward / fused heads ran for this row even if the cut left nothing
            span = (spans.get(kind, 0) and min(r.room, spans[kind])) if ch is not None else 0
            if ch is None or not ch.tokens:
                toks, srcs, confs = [], [], []
                if not span:
                    kind = pol.NONE
            else:
                toks, srcs, confs = ch.tokens[: r.room], ch.sources[: r.room], ch.confs[: r.room]
            out[r.batch_row] = toks
            st = r.state
            st.last = _Proposal(kind, list(srcs), list(confs), span, self._observable_past_cut(r, kind))
            st.took(kind, r.forced, alongside_forced=any_forced and not r.forced, tuning=self.tuning)
            self.stats.record_chain(list(srcs), kind)
            if kind in (pol.FUSED, pol.NGRAM):
                self.stats.drafts_skipped_forward += 1
            any_sampled |= j in q_rows and bool(toks)
        if any_sampled:
            self._set_draft_probs(runner, rows, out, q_rows, runner.device, self.vocab_size)

    def _observable_past_cut(self, r: _Row, kind: str) -> tuple | None:
        """The ``_Proposal.next`` of row ``r``: its chain's first token past the cut (for
        a row without a chain, the first token of its n-gram chain) as ``(token,
        calibration source key, confidence)``, when the step's output tells whether it
        would have been accepted: any token of a greedy request; for a sampled request
        only an n-gram token, which is handed over as a point mass (a token drawn from q
        is accepted with min(1, p/q), not with the probability that the target samples
        it)."""
        nxt = r.past_cut
        if nxt is None and kind == pol.NONE and r.ngram is not None and r.ngram.tokens:
            nxt = (r.ngram.tokens[0], r.ngram.sources[0], r.ngram.confs[0])
        if nxt is None:
            return None
        sampled = r.state.sampled
        if sampled and nxt[1] != SOURCE_NGRAM:
            return None
        return nxt[0], _calibration_keys((nxt[1],), sampled)[0], nxt[2]

    def _ngram_chain(self, st: _RequestState, context: list[int], room: int) -> Chain:
        """The request's n-gram chain after ``context`` (its tokens up to the newest, at
        least the table's :attr:`~vllm_tokenswift.ngram.NGramTable.context_len`), at most
        ``room`` tokens, built down to :data:`NGRAM_FLOOR` (the policy cuts it), with the
        escape count where ``policy_tuning.ngram_escape`` asks for it (:func:`ngram_chain`)."""
        return ngram_chain(context, st.ngrams, room, NGRAM_FLOOR, self._escape(st))

    def _escape(self, st: _RequestState) -> bool:
        """Whether the request's n-gram chains score a 3-token context's most frequent
        continuation ``c / (t + 1)`` (``policy_tuning.ngram_escape``: True, False, or
        ``"sampled"``: for sampled requests only)."""
        esc = self.tuning.ngram_escape
        return esc is True or (esc == "sampled" and st.sampled)

    def _row_options(self, r: _Row, has_fused: bool) -> pol.RowOptions:
        """Per available option, the estimated cumulative acceptance of its chain."""
        st = r.state
        cums = {pol.NONE: np.zeros(0)}
        if r.ngram is not None and r.ngram.tokens:
            cums[pol.NGRAM] = self._calibrated_cum(r.ngram, st.sampled)
        n_fwd = min(r.room, self.cfg.num_draft_distributions)
        cums[pol.FORWARD] = self.acceptance.cumulative(st.acceptance, pol.FORWARD, n_fwd)
        if has_fused and r.verify_index >= 0:
            cums[pol.FUSED] = self.acceptance.cumulative(st.acceptance, pol.FUSED,
                                                         min(r.room, self.heads.num_heads))
        forced = None
        if self.cfg.policy == "cycle":
            forced = pol.KINDS[st.steps % len(pol.KINDS)]
            if forced not in cums:
                forced = pol.NGRAM if pol.NGRAM in cums else pol.NONE
        elif (self.cfg.policy == "adaptive" and self.tuning.explore_every and st.steps > 2
              and not st.all_accepted and self._step % EXPLORE_ALIGN == 0):
            # A request whose last chain was full length and wholly accepted (a text that
            # repeats itself) defers its forced try: no option can yield more than a
            # full-length accepted chain, so the try could only lose a step. So does one
            # whose n-gram chain is expected to yield at least what the tried option's own
            # positions could at best (unless explore_beside_ngram). Tries wait for an
            # aligned engine step (EXPLORE_ALIGN; the same step on every TP rank).
            ngram_yield = float(np.sum(cums[pol.NGRAM])) if pol.NGRAM in cums else 0.0
            for kind in (pol.FORWARD, pol.FUSED):
                if kind not in cums or st.steps - st.tried.get(kind, 0) < st.explore_gap:
                    continue
                if not self.tuning.explore_beside_ngram and ngram_yield >= len(cums[kind]):
                    continue
                forced = kind
                break
        return pol.RowOptions(cums, forced)

    def _calibrated_cum(self, ch: Chain, sampled: bool) -> np.ndarray:
        return self.calibration.chain_cum(_calibration_keys(ch.sources, sampled), ch.confs)

    def _cut(self, ch: Chain, r: _Row, threshold: float, cum: np.ndarray | None = None) -> Chain:
        """Cut ``ch`` where its calibrated cumulative acceptance falls to ``threshold``
        (``threshold < 0``: keep it whole, the paper policy). ``cum``: that acceptance if
        already computed for this very chain this step (the n-gram row's decision did).

        Losslessness: whether position j is kept may depend on the tokens before it but
        never on the token at j itself when that token was *sampled* from q (keeping a
        sampled draft only for some values would change the distribution the rejection
        sampler corrects for). The confidences of sampled tokens are therefore a
        property of q (its largest probability), not of the drawn token; point-mass
        tokens (greedy, n-grams) are deterministic functions of their prefix, so their
        own confidence may decide."""
        keep = min(len(ch.tokens), r.room)
        if threshold >= 0 and ch.tokens:
            if cum is None:
                cum = self._calibrated_cum(ch, r.state.sampled)
            keep = min(keep, max(pol.cut_length(cum, threshold), 1 if r.forced else 0))
        r.past_cut = ((ch.tokens[keep], ch.sources[keep], ch.confs[keep])
                      if keep < min(len(ch.tokens), len(ch.sources), len(ch.confs)) else None)
        return ch.truncate(keep)

    # ----------------------------------------------------------------- fused heads
    def _draft_fused(self, runner, rows, idx, chains, q_rows, threshold) -> None:
        t = time.perf_counter()
        h = self.access.verification_hidden([rows[j].verify_index for j in idx])
        if h is None:
            return
        outs = self.heads(h.to(next(self.heads.parameters()).dtype))
        n = len(idx)
        logits = self.access.logits(torch.cat(outs, dim=0)).view(len(outs), n, -1).transpose(0, 1)
        self._chains_from_logits(rows, idx, logits, chains, q_rows, threshold, SOURCE_FUSED,
                                 tree=self.cfg.tree[1:], with_l0=False)
        dt = time.perf_counter() - t
        self._step_fused_s += dt
        self.stats.time_fused_s += dt
        self.costs.observe_fused(dt, n)

    # ----------------------------------------------------------------- draft forward
    def _draft_forward(self, runner, rows, idx, chains, q_rows, threshold) -> None:
        t = time.perf_counter()
        ib = runner.input_batch
        bt_np = ib.block_table[0].block_table.np
        bs = self.block_size
        sel = [rows[j] for j in idx]
        plans = self._plan_views(runner, [r.batch_row for r in sel], [r.state for r in sel],
                                 [r.pos for r in sel])
        n_groups = max(len(pl.blocks) for pl in plans)
        tables = []
        for g in range(n_groups):
            width = max(len(pl.blocks[g if len(pl.blocks) > 1 else 0]) for pl in plans)
            tab = np.zeros((len(sel), width), dtype=np.int32)
            for k, (r, pl) in enumerate(zip(sel, plans)):
                b = pl.blocks[g if len(pl.blocks) > 1 else 0]
                tab[k, : len(b)] = bt_np[r.batch_row, b]
            tables.append(tab)
        ids = [int(ib.token_ids_cpu[r.batch_row, r.pos]) for r in sel]
        slots = [int(bt_np[r.batch_row, r.pos // bs]) * bs + r.pos % bs for r in sel]
        t1 = time.perf_counter()
        h = self.access.draft_forward(runner, ids, [r.pos for r in sel], slots, tables,
                                      [pl.seq_len for pl in plans])
        pre = self.access.draft_prenorm
        outs = (self.heads(pre[: len(sel)].to(h.dtype))
                if self.heads is not None and pre is not None else [])
        logits = self.access.logits(torch.cat([h] + outs, dim=0) if outs else h)
        logits = logits.view(1 + len(outs), len(sel), -1).transpose(0, 1)
        self.stats.time_draft_forward_s += time.perf_counter() - t1
        self.stats.draft_steps += 1
        for k, r in enumerate(sel):
            r.state.q_row, r.state.q_step = k, self._step
        self._last_fwd_step = self._step
        self._select_after_forward(runner, [r.batch_row for r in sel], [r.state for r in sel],
                                   [r.pos for r in sel], plans)
        if self.cfg.policy == "paper":
            self._paper_chains(rows, idx, logits, chains, q_rows)
        else:
            self._chains_from_logits(rows, idx, logits, chains, q_rows, threshold, SOURCE_HEADS,
                                     tree=self.cfg.tree, with_l0=True)
        dt = time.perf_counter() - t
        self._step_fwd_s += dt
        self.costs.observe_forward(dt, len(sel))

    def _plan_views(self, runner, rows, states, positions) -> list:
        """Plan every drafting request's view, (re-)selecting those that need it and
        still hold their own queries from the latest draft forward (a request whose
        queries are gone drafts over its whole context this time and is selected right
        after, by :meth:`_select_after_forward`)."""
        planner = self._planner
        plans = [planner.plan(st.view, p) for st, p in zip(states, positions)]
        ready = [r for r, (st, plan) in enumerate(zip(states, plans))
                 if plan.needs_selection and st.q_step == self._last_fwd_step and st.q_row >= 0
                 and self.access.has_queries]
        self._select(runner, rows, states, positions, ready, [states[r].q_row for r in ready])
        for r in ready:
            plans[r] = planner.plan(states[r].view, positions[r])
        for plan in plans:
            if plan.full:
                self.stats.views_full += 1
            else:
                self.stats.views_budgeted += 1
        return plans

    def _select_after_forward(self, runner, rows, states, positions, plans) -> None:
        """(Re-)select the views of the requests that drafted over their whole context
        because they needed a selection, from the queries this draft forward just
        captured (row k of the forward is request k): the next draft forward of each
        reads its budgeted view, whatever other requests drafted in between."""
        late = [k for k, plan in enumerate(plans) if plan.needs_selection]
        if late and self.access.has_queries:
            self._select(runner, rows, states, positions, late, late)

    def _select(self, runner, rows, states, positions, which, q_rows) -> None:
        """Select the views of requests ``which`` (indices into ``rows``/``states``/
        ``positions``) from block importances (paper Sec 3.3, Eq. 2 per block) scored with
        row ``q_rows[j]`` of the latest draft forward's queries.

        Under tensor parallelism the importances are summed over the TP ranks in one
        collective before the top-k (:func:`sum_over_ranks`), so all ranks select the
        same blocks, the ones single-rank TokenSwift would select. Which requests select
        depends only on positions and step counters, identical on all ranks, so every
        rank reaches the collective (none when nothing selects, none with one rank).
        """
        if not which:
            return
        planner = self._planner
        bt_np = runner.input_batch.block_table[0].block_table.np
        s = planner.sink_blocks
        imps = []
        for r, q_row in zip(which, q_rows):
            last = positions[r] // self.block_size
            blocks = bt_np[rows[r], s:last] if last > s else np.zeros(0, np.int64)
            imps.append(self.access.importance(blocks, q_row, planner.num_groups))
        if self.tp_size > 1:
            imps = sum_over_ranks(imps, tp_all_gather)
        for r, imp in zip(which, imps):
            planner.select(states[r].view, positions[r], imp)
            self.stats.view_selections += 1

    # ----------------------------------------------------------------- chains
    def _chains_from_logits(self, rows, idx, logits, chains, q_rows, threshold, source, tree,
                            with_l0: bool) -> None:
        """Chains from draft logits ``[n, D, V]`` of the rows ``idx`` (adaptive policy)."""
        cfg = self.cfg
        sel, probs = self._draft_probs(rows, idx, logits)
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
                                 skip_first_gram=skips, escape=self._escape(st))
                chains[idx[k]] = self._cut(ch, r, threshold)
        sampled = [k for k, r in enumerate(sel) if r.state.sampled]
        if sampled:
            peak = probs.amax(dim=-1).cpu().numpy()       # [n, D]: confidence of q, not of a draw
        for k in sampled:
            r = sel[k]
            st = r.state
            depth = min(D, r.room)
            draws = self._draw(st, probs[k, :depth])
            ch = Chain(list(draws), [source] * depth, 0.0, peak[k, :depth].tolist())
            if st.ngrams is not None and depth < r.room:
                ext = self._ngram_chain(st, list(r.context) + ch.tokens, r.room - depth)
                ch.tokens += ext.tokens
                ch.sources += ext.sources
                ch.confs += ext.confs
            chains[idx[k]] = self._cut(ch, r, threshold)
            q_rows[idx[k]] = (probs[k], list(range(depth)))

    def _draft_probs(self, rows, idx, logits) -> tuple[list[_Row], torch.Tensor]:
        """The rows ``idx`` and their draft distributions: softmax of ``logits``
        ``[n, D, V]`` after each request's penalty, temperature and min_p (with
        ``draft_penalty``), float, same shape."""
        sel = [rows[j] for j in idx]
        if self.cfg.draft_penalty:
            logits = self._apply_request_filters(sel, logits)
        return sel, torch.softmax(logits, dim=-1)

    def _paper_chains(self, rows, idx, logits, chains, q_rows) -> None:
        """The paper policy's chains: the best path of the ``[1, 3, 3, 3]`` tree and the
        n-grams (:func:`select_chain`) for greedy requests; draws from q plus confident
        n-gram continuations for sampled ones."""
        cfg = self.cfg
        sel, probs = self._draft_probs(rows, idx, logits)
        n, D, _ = probs.shape
        tmax = max(cfg.tree[:D])
        top_p, top_i = probs.topk(tmax, dim=-1)
        top_p, top_i = top_p.cpu().numpy(), top_i.cpu().numpy()
        for k, r in enumerate(sel):
            st = r.state
            if st.sampled:
                depth = min(D, r.room)
                draws = self._draw(st, probs[k, :depth])
                ch = Chain(list(draws), [SOURCE_HEADS] * depth, float(depth), [1.0] * depth)
                if st.ngrams is not None and cfg.ngram_topk > 0:
                    extend_chain(ch, r.context, st.ngrams, r.room, cfg.ngram_min_conf)
                    ch.confs = [1.0] * len(ch.tokens)
                chains[idx[k]] = ch.truncate(min(len(ch.tokens), r.room))
                q_rows[idx[k]] = (probs[k], list(range(depth)))
                continue
            lut = [dict(zip(top_i[k, d].tolist(), top_p[k, d].tolist())) for d in range(D)]

            def prob(d, tok, lut=lut):
                return lut[d].get(tok) if d < len(lut) else None

            tree_tokens = [top_i[k, d, : cfg.tree[d]].tolist() for d in range(D)]
            ch = select_chain(r.context, tree_tokens, prob, st.ngrams, cfg.ngram_topk, r.room,
                              cfg.ngram_min_conf)
            ch.confs = [1.0] * len(ch.tokens)
            chains[idx[k]] = ch

    def _draw(self, st: _RequestState, probs: torch.Tensor) -> list[int]:
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

    def _set_draft_probs(self, runner, rows, out, q_rows, device, vocab: int) -> None:
        """Give vLLM's rejection sampler the draft distributions q of sampled drafts.

        Standard speculative sampling (accept with min(1, p/q), else resample from
        (p - q)+) is lossless when each draft token was drawn from the q given here;
        tokens chosen deterministically (n-gram candidates, greedy rows) get a
        one-hot q, which is exactly vLLM's point-mass treatment. vLLM reads only
        ``[row, :num_draft]`` of each row (``_get_spec_decode_draft_probs``), so the
        buffer is kept between steps and only the positions proposed now are written.
        Shape: ``[num_batch_rows, num_speculative_tokens, V]`` float32, rows in
        ``input_batch.req_ids`` order (vLLM ``GPUModelRunner._draft_probs``).
        """
        n_rows = len(out)
        dev, v = torch.device(device), vocab
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

    def _apply_request_filters(self, sel: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """The request's repetition penalty (windowed or global), temperature and min_p on
        every draft distribution, as the target's sampler will apply them (Sec 3.4).
        The penalty history is kept incrementally per request (token counts on the
        device); the draft prefix of the chain is not added (approximation)."""
        from vllm._custom_ops import apply_repetition_penalties

        n, ndist, v = logits.shape
        pen = [k for k, r in enumerate(sel) if r.state.repetition_penalty != 1.0]
        if pen:
            mask = torch.stack([self._penalty_mask(sel[k], v, logits.device) for k in pen])
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

    def _penalty_mask(self, r: _Row, v: int, device) -> torch.Tensor:
        """``[V]`` bool: tokens in the request's penalty history (the last ``window``
        tokens of prompt + output up to ``x``, or all of them), from incrementally
        maintained counts: only the tokens that entered or left the window since the
        last call are read."""
        st = r.state
        hi = r.pos + 1
        lo = max(0, hi - st.window) if st.window else 0
        if st.pen_counts is None or st.pen_counts.device != torch.device(device) or lo < st.pen_lo \
                or hi < st.pen_hi or lo >= st.pen_hi:
            st.pen_counts = torch.zeros(v, dtype=torch.int32, device=device)
            st.pen_lo = st.pen_hi = lo
        ids = self._row_tokens
        row = ids[r.batch_row]
        if hi > st.pen_hi:
            add = torch.as_tensor(row[st.pen_hi: hi].astype(np.int64), device=device)
            add = add[add < v]
            st.pen_counts.index_add_(0, add, torch.ones_like(add, dtype=torch.int32))
        if lo > st.pen_lo:
            sub = torch.as_tensor(row[st.pen_lo: lo].astype(np.int64), device=device)
            sub = sub[sub < v]
            st.pen_counts.index_add_(0, sub, torch.full_like(sub, -1, dtype=torch.int32))
        st.pen_lo, st.pen_hi = lo, hi
        return st.pen_counts > 0
