"""What the proposer keeps per running request.

:class:`RequestState` lives from a request's first proposer step until it finishes, is
aborted, preempted or resumed (``TokenSwiftProposer.release_requests``, called by the
runner patch every step). The per-step values that refer to it (rows, proposals) are in
:mod:`vllm_tokenswift.core.step`.

Engine-free (torch, numpy).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_tokenswift.core.config import PolicyTuning
from vllm_tokenswift.core.kv_view import RequestView
from vllm_tokenswift.core.ngram import NGramTable
from vllm_tokenswift.core.penalty import window_from_params
from vllm_tokenswift.core.step import Proposal

_uids = itertools.count()


@dataclass
class RequestState:
    """Everything the proposer keeps per running request (freed on finish, abort,
    preemption and resumption).

    Attributes:
        ngrams: the request's n-gram table over prompt + output (Sec 3.2), None when off.
        view: its budgeted KV view (:class:`~vllm_tokenswift.core.kv_view.RequestView`).
        temperature, min_p, repetition_penalty, window, seed: from its ``SamplingParams``.
        generator: its draft RNG (:func:`vllm_tokenswift.core.draft_sampling.draw`).
        last: what was handed to vLLM for it last step (booked at the next one).
        acceptance: the policy's per-request acceptance counts ({} until it meets it).
        steps: proposer steps it produced tokens in.
        tried, explore_gap, all_accepted: the adaptive policy's exploration bookkeeping.
        pen_counts, pen_lo, pen_hi: ``[V]`` int32 counts of the tokens in its penalty
            window, over positions ``[pen_lo, pen_hi)`` (kept incrementally).
        policy_data: what a drafting policy keeps per request (e.g. the probe's directive).
        uid: unique per state (a resumed request gets a new state and a new uid).
    """

    ngrams: NGramTable | None
    view: RequestView = field(default_factory=RequestView)
    temperature: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    window: int = 0
    seed: int = 0
    generator: torch.Generator | None = None
    last: Proposal = field(default_factory=Proposal)
    acceptance: dict = field(default_factory=dict)
    steps: int = 0
    tried: dict = field(default_factory=dict)          # kind -> step it was last taken
    explore_gap: int = PolicyTuning().explore_every     # steps between forced tries
    all_accepted: bool = False   # last step verified a full-length chain and accepted all of it
    pen_counts: np.ndarray | None = None
    pen_lo: int = 0
    pen_hi: int = 0
    policy_data: dict = field(default_factory=dict)
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def sampled(self) -> bool:
        """Whether the request samples (temperature above 1e-5) rather than decoding greedily."""
        return self.temperature > 1e-5


def new_request_state(req_id: str, sampling_params, *, ngram_n: int, use_ngrams: bool,
                      explore_every: int, engine_seed: int) -> RequestState:
    """A request's state from its ``SamplingParams`` (None: greedy defaults).

    The draft RNG's seed is the request's ``seed`` or, without one, derived from the
    engine seed and the request id with SHA-256: independent of the batch and of Python's
    hash salt, identical on every tensor-parallel rank. Its acceptance estimates are
    given by the policy when it first meets the request.
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
    return st
