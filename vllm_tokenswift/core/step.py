"""One engine step as the proposer sees it: the values its five steps pass to each other.

The runner patch builds one :class:`StepInput` per engine step (what the proposer reads
from vLLM: the batch's requests, the tokens sampled and verified per request, their
positions and sampling parameters, the block table); the proposer
(:class:`vllm_tokenswift.engine.proposer.TokenSwiftProposer`) turns it into a
:class:`StepProposal` (the draft chains and their draft distributions) in five steps, each a
function of its arguments::

    StepInput --update--> (Verified rows, drafting Rows) --account--> policy estimates
              --plan--> StepPlan --draft--> Drafts --hand over--> StepProposal

Every type here is a plain value: no back-references to the policy or the engine, no
vLLM imports. The drafting options a request may take in a step are :data:`KINDS`.

Engine-free (numpy, torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_tokenswift.core.chain import Chain

#: the drafting options, per request and step: the draft forward over the budgeted view
#: (``l_0`` and the heads, paper Sec 3.2-3.3), a self-speculative chain (the draft forward
#: run m times, token by token, each over the view plus the chain so far: the paper's
#: TriForce* baseline), the heads on the verification forward's hidden state (no extra
#: forward), the request's n-gram chain alone, or no draft
FORWARD = "forward"
CHAIN = "chain"
FUSED = "fused"
NGRAM = "ngram"
NONE = "none"
KINDS = (FORWARD, CHAIN, FUSED, NGRAM, NONE)
#: options that propose drafts (``NONE`` proposes nothing)
DRAFT_KINDS = (FORWARD, CHAIN, FUSED, NGRAM)


# ============================================================== input
@dataclass(frozen=True)
class RequestStep:
    """One batch row that produced tokens this step (a decode row, or the last chunk of a
    prefill).

    Attributes:
        batch_row: the request's row in vLLM's persistent batch (``input_batch``).
        req_id: vLLM's request id.
        sampled: the tokens sampled this step: the accepted draft tokens, then the bonus
            token (at least one token).
        num_verified: draft tokens the step verified for the request (vLLM's
            ``scheduled_spec_decode_tokens``; the scheduler may have trimmed the chain).
        pos: position of the newest token ``x`` (``num_tokens_no_spec - 1``).
        verify_index: flat token index, in this step's verification forward, of the
            hidden state at position ``pos - 1`` (the fused heads read it); -1 when it is
            not in this step's forward.
        has_slot: ``x``'s KV slot is allocated (the draft forward writes it).
        num_slots: KV slots allocated to the request (its blocks × block size): a chain's
            forward ``j`` writes position ``pos + j``, so at most ``num_slots - pos``
            forwards fit (vLLM allocates ``num_lookahead_tokens`` beyond the verified tokens).
        sampling_params: the request's vLLM ``SamplingParams`` (read when the proposer
            first meets the request; None: greedy defaults).
    """

    batch_row: int
    req_id: str
    sampled: list
    num_verified: int
    pos: int
    verify_index: int = -1
    has_slot: bool = True
    sampling_params: Any = None
    num_slots: int = 1 << 30

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (``len(sampled) - 1``)."""
        return len(self.sampled) - 1


@dataclass
class StepInput:
    """Everything the proposer reads from vLLM for one engine step.

    Attributes:
        requests: the rows that produced tokens, in batch order (:class:`RequestStep`).
        req_ids: request id per batch row (``len(req_ids)`` rows get a proposal).
        num_scheduled_tokens: tokens the step scheduled in all (prefill chunks included).
        token_ids: ``[max_rows, max_model_len]`` int32 (or int64) token ids per batch row
            (a view of vLLM's ``input_batch.token_ids_cpu``; read up to each row's ``pos``).
        block_table: ``[max_rows, max_blocks]`` int32 physical KV block ids per batch row
            (a view of vLLM's block table).
        device: where the model runs (draft distributions are built there).
        runner: the model runner, passed to the target's draft forward and nothing else
            (None in unit tests with a fake target).
    """

    requests: list
    req_ids: list
    num_scheduled_tokens: int
    token_ids: np.ndarray
    block_table: np.ndarray
    device: torch.device = torch.device("cpu")
    runner: Any = None

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)


# ============================================================== rows
@dataclass(frozen=True)
class Proposal:
    """What the proposer handed to vLLM for one request last step (booked when the next
    step verifies it).

    Attributes:
        kind: the option taken (:data:`KINDS`).
        sources, confs: per draft token, its source (``chain.SOURCE_*``) and confidence.
        span: the draft forward / fused heads ran: the positions the option could draft
            (0 otherwise).
        next: ``(token, calibration source key, confidence)`` of the chain's first token
            past the cut, when the next step's output tells whether it would have been
            accepted; None otherwise.
        step: the request's step count when it was made (-1: nothing was planned).
        forced: the policy had to give the request a draft (exploration).
        alongside_forced: another request of the batch was forced this step.
    """

    kind: str = NONE
    sources: tuple = ()
    confs: tuple = ()
    span: int = 0
    next: tuple | None = None
    step: int = -1
    forced: bool = False
    alongside_forced: bool = False


@dataclass(frozen=True)
class Verified:
    """One request's share of the step that just ran: its state, the proposal verified,
    the drafts verified and accepted, and the tokens sampled (the accepted drafts, then
    the bonus token)."""

    state: Any                # core.request_state.RequestState
    proposal: Proposal
    num_verified: int
    num_accepted: int
    tokens: list | None = None


@dataclass
class Row:
    """One request that may draft this step (it has room for drafts and ``x``'s slot).

    Attributes:
        batch_row, req_id, state: where it is and what the proposer keeps for it.
        pos: position of the newest token ``x``.
        room: most draft tokens that fit before ``max_model_len`` (and
            ``num_speculative_tokens``).
        context: its last ``NGramTable.context_len`` tokens up to ``x`` (for n-grams).
        ngram: its n-gram chain (None when the policy does not weigh one, or no table).
        verify_index: see :attr:`RequestStep.verify_index`.
        chain_room: most self-speculative chain forwards (:data:`CHAIN`) whose K/V slots
            are allocated (``num_slots - pos``, at most ``room``).
    """

    batch_row: int
    req_id: str
    state: Any                # core.request_state.RequestState
    pos: int
    room: int
    context: list
    ngram: Chain | None = None
    verify_index: int = -1
    chain_room: int = 0


# ============================================================== plan
@dataclass
class StepPlan:
    """The policy's plan for one step (:meth:`DraftingPolicy.plan
    <vllm_tokenswift.core.policy.DraftingPolicy.plan>`).

    Attributes:
        rows: the drafting rows it was made for.
        kinds: per row, its option (:data:`KINDS`).
        forced: per row, whether the row must get at least one draft token.
        threshold: chains are cut where their calibrated cumulative acceptance falls to
            this (``b·θ``); negative: kept whole.
        threshold_first: the first token's threshold (``min(b1, b)·θ``), or None: ``threshold``.
        cums: per row, option -> the estimated cumulative acceptance the decision used
            (the n-gram option's is its chain's own, reused when that chain is cut).
        decision: the cost-aware decision (``core.policy.decision.Decision``), or None.
        plain_probe: the adaptive policy ran a plain step to measure its cost apart.
        lengths: per row, the planned chain length (for :data:`CHAIN` rows: the number of
            draft forwards, 1 to ``chain_room``); empty: not planned.
    """

    rows: list
    kinds: list
    forced: list
    threshold: float = -1.0
    cums: list = field(default_factory=list)
    decision: Any = None
    plain_probe: bool = False
    lengths: list = field(default_factory=list)
    threshold_first: float | None = None

    def chain_forwards(self, j: int) -> int:
        """Draft forwards of row ``j``'s self-speculative chain (0 unless it takes :data:`CHAIN`):
        its planned length, at least 1, at most its ``chain_room``."""
        if self.kinds[j] != CHAIN:
            return 0
        m = int(self.lengths[j]) if self.lengths else self.rows[j].chain_room
        return max(1, min(m, self.rows[j].chain_room))

    @property
    def any_forced(self) -> bool:
        return any(self.forced)

    def rows_of(self, kind: str) -> list[int]:
        """Indices (into :attr:`rows`) of the rows that take option ``kind``."""
        return [j for j, k in enumerate(self.kinds) if k == kind]


# ============================================================== drafts
@dataclass(frozen=True)
class CutChain:
    """A row's chain after the policy's cut (:meth:`DraftingPolicy.cut`), and its first
    token past the cut as ``(token, source, confidence)`` (None when the chain ended there)."""

    chain: Chain
    past_cut: tuple | None = None


@dataclass
class Drafts:
    """What the drafting step produced for one step.

    Attributes:
        chains: row index (into the plan's rows) -> :class:`CutChain` (missing: the
            option produced none).
        q_rows: row index -> ``(q [D, V] float, depths)``: the draft distributions its
            sampled tokens were drawn from.
        forward: ``(seconds, rows)`` of the draft forward, or None.
        fused: ``(seconds, rows)`` of the fused heads, or None.
        chain: ``[(seconds, rows), ...]``: each draft forward of the self-speculative
            chains (the LM head and the draws included), in order; empty when none ran.
        forward_selected: the draft forward (re-)selected a request's KV view, so its time
            is not a budgeted forward's (see :meth:`StepCosts.of_drafting`).
    """

    chains: dict = field(default_factory=dict)
    q_rows: dict = field(default_factory=dict)
    forward: tuple | None = None
    fused: tuple | None = None
    chain: list = field(default_factory=list)
    forward_selected: bool = False

    @property
    def seconds(self) -> float:
        """Time spent in draft forwards and fused heads this step."""
        return sum(d[0] for d in (self.forward, self.fused) if d) + sum(c[0] for c in self.chain)


@dataclass(frozen=True)
class StepCosts:
    """What the previous engine step cost, for the policy's cost model (seconds).

    Attributes:
        step: ``(seconds, decode rows, draft tokens, rows verifying any draft)`` of the
            verification step outside the proposer's drafting work, or None when the step
            also prefilled (not a decode step) or is the first.
        forward: ``(seconds, rows)`` of the previous step's draft forward, or None.
        fused: ``(seconds, rows)`` of its fused heads, or None.
        chain: ``(seconds, rows)`` of each draft forward of its self-speculative chains
            (each is a draft forward over budgeted views: the cost model fits them with
            the draft forward's ``f0 + f1·n``).
    """

    step: tuple | None = None
    forward: tuple | None = None
    fused: tuple | None = None
    chain: tuple = ()

    @classmethod
    def of_drafting(cls, drafts: Drafts | None) -> "StepCosts":
        """The drafting costs of a step, to observe at the next one. A draft forward that
        (re-)selected a KV view (a forward over a request's whole context to capture its
        query, or the importance pass over all its keys, paper Sec 3.3) is not observed:
        it happens once per request and once per re-selection, while the cost model's
        ``f0 + f1·n`` is what a forward over budgeted views costs step after step (at a
        32K-token context the first forward of a request cost ~100 ms against ~9 ms for the
        next ones, and observing it kept the policy off the draft forward)."""
        if drafts is None:
            return cls()
        sel = drafts.forward_selected
        return cls(forward=None if sel else drafts.forward, fused=drafts.fused,
                   chain=() if sel else tuple(drafts.chain))


# ============================================================== output
@dataclass
class StepProposal:
    """What the proposer hands back to vLLM for one step.

    Attributes:
        draft_token_ids: per batch row, its draft chain (``[]``: no draft).
        draft_probs: ``[num_rows, num_speculative_tokens, V]`` float32, the draft
            distribution of every proposed position (one-hot for point-mass drafts), rows
            in batch order; None when no row drew a sampled draft (vLLM then treats every
            draft as a point mass). vLLM's rejection sampler reads ``[row, :num_drafts]``
            (``GPUModelRunner._draft_probs``).
    """

    draft_token_ids: list
    draft_probs: torch.Tensor | None = None
