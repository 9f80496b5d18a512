"""The drafting-policy interface: what every strategy answers, per engine step.

A :class:`DraftingPolicy` is visited three times per step:

1. :meth:`DraftingPolicy.account` (by the proposer): book what the step that just ran
   verified (per request: the proposal handed over last step, how many drafts were
   verified and accepted, the tokens sampled) and what the previous step's drafting and this
   verification cost;
2. :meth:`DraftingPolicy.plan` (by the proposer): per drafting request, the option (draft
   forward, fused heads, n-gram chain or none) and how long chains may be, as a plain
   :class:`~vllm_tokenswift.core.step.StepPlan`;
3. :meth:`DraftingPolicy.cut` (by the drafter, once per chain): trim a chain the drafting
   built to the plan.

Each strategy also declares what the proposer must prepare for it
(:attr:`~DraftingPolicy.needs_ngram_chains`, :attr:`~DraftingPolicy.uses_fused_heads`) and
how the draft forward's chains are built (:attr:`~DraftingPolicy.paper_chains`), so nothing
outside the strategy switches on its name. The strategies the plugin ships are in
:mod:`vllm_tokenswift.core.policy` (``adaptive``, ``paper``, ``cycle``); a strategy of one's
own is a subclass named by its class path in ``"tokenswift": {"policy": "pkg.mod:Class"}``.

Engine-free (numpy).
"""

from __future__ import annotations

from typing import ClassVar

from vllm_tokenswift.core.chain import Chain
from vllm_tokenswift.core.config import TokenSwiftConfig
from vllm_tokenswift.core.step import CutChain, StepCosts, StepPlan


class DraftingPolicy:
    """A drafting strategy (module doc). Subclasses implement :meth:`plan` and may override
    the rest.

    Args:
        cfg: the engine's :class:`~vllm_tokenswift.core.config.TokenSwiftConfig`.
        num_spec_tokens: ``num_speculative_tokens`` (the longest chain).
        tp_broadcast: tensor parallelism: ``f(np.ndarray) -> np.ndarray`` giving every rank
            rank 0's vector (``engine.tensor_parallel.tp_broadcast_from_rank0``); None with one
            rank. Strategies whose decisions depend on timings must decide from rank 0's.

    Attributes:
        num_heads: draft heads loaded (the fused option's span), set by the proposer.
        last_decision: the latest cost-aware decision (None for strategies without one).
    """

    #: the name ``"tokenswift": {"policy": ...}`` selects it by (built-in strategies)
    name: ClassVar[str] = ""
    #: the proposer builds every drafting row's n-gram chain (``Row.ngram``) before
    #: :meth:`plan`, which weighs it
    needs_ngram_chains: ClassVar[bool] = True
    #: the plan may give rows the fused heads (heads on the verification forward's hidden state)
    uses_fused_heads: ClassVar[bool] = True
    #: the draft forward's chains are the paper's (best path of the token tree, then
    #: n-gram candidates, chains kept whole; :func:`~vllm_tokenswift.core.chain.select_chain`)
    #: rather than calibrated chains (:func:`~vllm_tokenswift.core.chain.build_chain`)
    paper_chains: ClassVar[bool] = False

    def __init__(self, cfg: TokenSwiftConfig, num_spec_tokens: int, tp_broadcast=None):
        self.cfg = cfg
        self.num_spec_tokens = num_spec_tokens
        self.tp_broadcast = tp_broadcast
        self.num_heads = 0
        self.last_decision = None

    @property
    def tuning(self):
        """The adaptive policy's advanced settings (``config.PolicyTuning``)."""
        return self.cfg.policy_tuning

    @classmethod
    def check_config(cls, cfg: TokenSwiftConfig) -> None:
        """Refuse settings this strategy cannot run with (called in the front end when the
        engine is created, :func:`~vllm_tokenswift.core.policy.check_policy`). Default: none.

        Raises:
            ValueError: the message names the setting and a valid value.
        """

    def on_new_request(self, st, sampling_params) -> None:
        """Called once per request, when the proposer makes its state: a strategy may read
        per-request settings here (kept in ``st.policy_data``).

        Raises:
            ValueError: settings the strategy refuses.
        """

    def account(self, verified: list, costs: StepCosts | None = None) -> None:
        """Book the step that just ran: ``verified`` (:class:`~vllm_tokenswift.core.step.Verified`
        per request that was handed a proposal) and ``costs``. Default: nothing."""

    def plan(self, rows: list, step: int, has_fused: bool) -> StepPlan:
        """Decide every drafting row's option and the chains' cut threshold.

        Args:
            rows: this step's drafting rows (:class:`~vllm_tokenswift.core.step.Row`), their
                n-gram chains built when :attr:`needs_ngram_chains`.
            step: the engine step counter (identical on every tensor-parallel rank).
            has_fused: the fused heads are available this step.
        """
        raise NotImplementedError

    def cut(self, plan: StepPlan, j: int, chain: Chain, cum=None) -> CutChain:
        """Row ``j``'s chain as handed over: here at most the row's room, whole otherwise.
        ``cum``: the chain's estimated cumulative acceptance when the plan already computed
        it (strategies that cut by it)."""
        r = plan.rows[j]
        keep = min(len(chain.tokens), r.room)
        past = past_cut_of(chain, keep)      # before the cut: truncate works in place
        return CutChain(chain.truncate(keep), past)

    def cost_estimates(self) -> dict | None:
        """The step-cost model's current estimates in seconds, or None (no cost model)."""
        return None


def past_cut_of(chain: Chain, keep: int) -> tuple | None:
    """``(token, source, confidence)`` of ``chain``'s first token past a cut after ``keep``
    tokens, or None when the chain (or one of its per-token lists) ends there."""
    if keep < min(len(chain.tokens), len(chain.sources), len(chain.confs)):
        return chain.tokens[keep], chain.sources[keep], chain.confs[keep]
    return None
