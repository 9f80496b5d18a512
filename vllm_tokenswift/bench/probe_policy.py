"""The cost probe's drafting policy: every step of a request has one known shape.

Engines of ``vllm-tokenswift probe`` run with ``"tokenswift": {"policy":`` :data:`POLICY` ``}``
(a class path, resolved like any drafting policy of one's own). Each request names its shape
in ``SamplingParams.extra_args["tokenswift_probe"] = {"kind": "forward" | "chain" | "ngram",
"drafts": k}``: every one of its steps takes that option and hands over a chain of exactly
``k`` tokens (at most the room left), padded with the request's newest token where the option
yields fewer, so that verification always costs the same. ``{"kind": "chain", "drafts": m}``
runs a self-speculative chain of ``m`` draft forwards (the TriForce* step; a step whose
lookahead slots allow none verifies ``m`` padding tokens instead). ``{"kind": "ngram",
"drafts": 0}`` is a plain decode step. Nothing of this is in the plugin's own policies.
"""

from __future__ import annotations

from vllm_tokenswift.core.chain import SOURCE_NGRAM, Chain
from vllm_tokenswift.core.policy.base import DraftingPolicy, past_cut_of
from vllm_tokenswift.core.step import CHAIN, FORWARD, NGRAM, CutChain, StepPlan

#: ``"tokenswift": {"policy": POLICY}`` of the probe's engines
POLICY = "vllm_tokenswift.bench.probe_policy:ProbePolicy"
#: ``SamplingParams.extra_args`` key of a request's directive
PROBE_KEY = "tokenswift_probe"


def probe_directive(extra_args) -> tuple[str, int]:
    """A request's ``extra_args["tokenswift_probe"]``: its option (``"forward"``, ``"chain"``
    or ``"ngram"``) and exact chain length (default ``("ngram", 0)``: plain decoding steps).

    Raises:
        ValueError: an unknown option, a negative length, or a chain of no forward.
    """
    d = (extra_args or {}).get(PROBE_KEY) or {}
    kind, drafts = d.get("kind", NGRAM), int(d.get("drafts", 0))
    if kind not in (FORWARD, CHAIN, NGRAM) or drafts < 0 or (kind == CHAIN and drafts < 1):
        raise ValueError(f"{PROBE_KEY} needs kind 'forward', 'chain' or 'ngram' and drafts >= 0 "
                         f"(>= 1 for a chain), got {d!r}")
    return kind, drafts


def probe_chain(ch: Chain | None, room: int, drafts: int, newest: int) -> Chain:
    """Exactly ``min(drafts, room)`` tokens: the option's own chain, cut or padded with the
    newest token (as an n-gram token, a point mass)."""
    n = min(drafts, room)
    ch = ch if ch is not None else Chain([], [], 0.0)
    ch = ch.truncate(min(n, len(ch.tokens)))
    ch.confs = list(ch.confs) + [0.0] * (len(ch.tokens) - len(ch.confs))
    pad = n - len(ch.tokens)
    if pad > 0:
        ch.tokens += [int(newest)] * pad
        ch.sources += [SOURCE_NGRAM] * pad
        ch.confs += [0.0] * pad
    return ch


class ProbePolicy(DraftingPolicy):
    """Each request's option and exact chain length from its directive (module doc)."""

    name = "probe"
    uses_fused_heads = False

    def on_new_request(self, st, sampling_params) -> None:
        st.policy_data["probe"] = probe_directive(getattr(sampling_params, "extra_args", None))

    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        n = len(rows)
        kinds, lengths = [], []
        for r in rows:
            kind, drafts = r.state.policy_data["probe"]
            if kind == CHAIN and r.chain_room < 1:
                kind = NGRAM          # no lookahead slot: the same verification, padded
            kinds.append(kind)
            lengths.append(drafts if kind == CHAIN else 0)
        return StepPlan(list(rows), kinds, [False] * n, -1.0, [{} for _ in range(n)], lengths=lengths)

    def cut(self, plan: StepPlan, j: int, chain: Chain, cum=None) -> CutChain:
        r = plan.rows[j]
        keep = min(len(chain.tokens), r.room)
        past = past_cut_of(chain, keep)
        return CutChain(probe_chain(chain.truncate(keep), r.room, r.state.policy_data["probe"][1],
                                    r.context[-1]), past)
