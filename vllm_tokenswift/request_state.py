"""What the proposer keeps per running request, and the per-step row of a drafting request.

:class:`RequestState` lives from a request's first proposer step until it finishes, is
aborted or preempted (``TokenSwiftProposer.release_requests``); :class:`Row` lives for
one engine step; :class:`Proposal` is what was handed to vLLM for a request last step,
kept until the next step books its verification (``DraftingPolicy.account``).

Engine-free (torch, numpy).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from vllm_tokenswift import policy as pol
from vllm_tokenswift.chain import Chain
from vllm_tokenswift.config import PolicyTuning
from vllm_tokenswift.kv_view import RequestView
from vllm_tokenswift.ngram import NGramTable
from vllm_tokenswift.penalty import window_from_params


@dataclass
class Proposal:
    """What the proposer handed to vLLM for one request last step (for accounting).

    Attributes:
        kind: the option taken (``policy.KINDS``).
        sources, confs: per draft token, its source (``chain.SOURCE_*``) and confidence.
        span: draft forward / fused heads: the positions the option could draft (0 else).
        next: ``(token, calibration source key, confidence)`` of the chain's first token
            past the cut, when the output tells whether it would have been accepted
            (:meth:`policy.Calibration.observe`); None otherwise.
    """

    kind: str = pol.NONE
    sources: list = field(default_factory=list)
    confs: list = field(default_factory=list)
    span: int = 0
    next: tuple | None = None


@dataclass
class RequestState:
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
    last: Proposal = field(default_factory=Proposal)
    acceptance: dict = field(default_factory=dict)     # policy.AcceptanceModel.new_request(); {}: not yet
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


def new_request_state(req_id: str, sampling_params, *, ngram_n: int, use_ngrams: bool,
                      explore_every: int, engine_seed: int, probe: bool = False) -> RequestState:
    """A request's state from its ``SamplingParams`` (None: greedy defaults); ``probe``:
    read its ``extra_args["tokenswift_probe"]`` (:func:`policy.probe_directive`).

    The draft RNG's seed is the request's ``seed`` or, without one, derived from the
    engine seed and the request id with SHA-256: independent of the batch and of Python's
    hash salt, identical on every tensor-parallel rank. Its acceptance estimates are
    given by the policy when it first meets the request (``DraftingPolicy.estimates_of``).

    Raises:
        ValueError: a malformed probe directive.
    """
    sp = sampling_params
    st = RequestState(ngrams=NGramTable(ngram_n) if use_ngrams else None, explore_gap=explore_every)
    if sp is not None:
        st.temperature = float(sp.temperature)
        st.min_p = float(sp.min_p or 0.0)
        st.repetition_penalty = float(sp.repetition_penalty)
        st.window = window_from_params(sp)
        if sp.seed is not None:
            st.seed = int(sp.seed)
        else:
            h = hashlib.sha256(f"{engine_seed}:{req_id}".encode()).digest()
            st.seed = int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
    if probe:
        st.probe = pol.probe_directive(getattr(sp, "extra_args", None))
    return st


@dataclass
class Row:
    """One drafting request this step."""

    batch_row: int
    req_id: str
    state: RequestState
    pos: int                  # position of the newest token x
    room: int                 # most draft tokens that fit before max_model_len
    context: list             # last NGramTable.context_len tokens up to x (for n-grams)
    ngram: Chain | None = None
    verify_index: int = -1    # flat token index of h_{p-1} in this step's verification forward
    forced: bool = False      # the policy must give this row at least one draft (exploration)
    past_cut: tuple | None = None   # (token, source, conf) of the chain's first token past the cut
