"""TokenSwift settings: one validated pydantic model for everything under the
``"tokenswift"`` key of vLLM's speculative config.

Users write::

    speculative_config={"method": "tokenswift", "model": HEADS_DIR,
                        "num_speculative_tokens": 4,
                        "tokenswift": {"kv_budget": 4096, ...}}

The plugin (``vllm_tokenswift.plugin``) validates the nested dict with
:class:`TokenSwiftConfig` in the front-end process, before vLLM builds its own
``SpeculativeConfig``, so a bad value fails at engine start with a message that
names the field. Once vLLM has finished its ``VllmConfig`` (KV block size,
``max_model_len``), :meth:`TokenSwiftConfig.check_engine` checks the settings against
it and the model, still in the front end (``plugin.check_engine_config``), before
any engine-core or worker process starts. The worker checks the block size again
when the proposer is built.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_tokenswift import PROPOSER_CLASS_PATH

#: Key under ``vllm_config.additional_config`` that carries the validated settings
#: from the front end to the worker processes.
ADDITIONAL_CONFIG_KEY = "tokenswift"

#: ``additional_config`` key (a bool) by which an engine without TokenSwift (plain decoding,
#: or vLLM's ``ngram`` / ``suffix`` speculative decoding) takes the plugin's CPU attention
#: kernel for its decode rows (:mod:`vllm_tokenswift.kernels.cpu_attention`, bench methods ``*-vk``).
VERIFY_ATTENTION_OPT_IN_KEY = "tokenswift_verify_attention"

#: The drafting policies the plugin ships (:data:`vllm_tokenswift.core.policy.POLICIES`); a
#: ``"package.module:Class"`` path names another :class:`~vllm_tokenswift.core.policy.DraftingPolicy`.
BUILTIN_POLICIES = ("adaptive", "paper", "cycle", "triforce", "medusa")
_CLASS_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")

#: Number of dependent draft heads of a TokenSwift checkpoint (paper Sec 3.2).
DEFAULT_NUM_HEADS = 3

#: Upper bounds of the settings that size per-step work (chain selection scores
#: every tree path and every retrieved n-gram of every request, every step).
MAX_NGRAM_TOPK = 64
MAX_TREE_WIDTH = 8
MAX_TREE_PATHS = 256


class TokenSwiftConfigError(ValueError):
    """Raised when a TokenSwift setting is invalid; the message names the field."""


#: Relative margin by which a drafting plan's predicted throughput must beat plain
#: decoding's before the adaptive policy takes it on its own (exploration and probes aside).
#: The estimates it compares are noisy, and a plan chosen because its estimate is high
#: is on average worse than estimated (the winner's curse): measured on SmolLM2 at 6K
#: tokens under the paper's sampling, drafting steps chosen near break-even cost more
#: than they returned (draft forward and verification 17 s for 13 s of saved steps).
MIN_GAIN = 0.05
#: Prior cost of one verified draft token as a fraction of a plain step of the whole batch
#: (``core.policy.estimates.CostModel.prior_b``; see :attr:`PolicyTuning.draft_token_cost_prior`).
DRAFT_TOKEN_COST_PRIOR = 0.08


class PolicyTuning(BaseModel):
    """Advanced settings of the adaptive drafting policy (``vllm_tokenswift.core.policy.decision``), under
    ``"tokenswift": {"policy_tuning": {...}}``. The defaults were measured on SmolLM2-135M
    on a 2-core CPU; they exist so that a deployment (or a benchmark A/B) can change them
    without a new release.

    Attributes:
        min_gain: relative margin by which a drafting plan's predicted tokens per second
            must beat plain decoding's before the policy drafts on its own (the winner's
            curse of noisy estimates; :data:`MIN_GAIN`). 0: pure maximisation.
        draft_token_cost_prior: prior cost of one verified draft token, as a fraction of
            a plain step of the *whole batch* (``core.policy.estimates.CostModel.prior_b``). It does not
            shrink with the batch size: verifying draft tokens beside R decode rows widens
            every matrix product of the step, and on CPUs the step time rises in jumps
            once the step's tokens pass the kernels' tile size. The online fit replaces
            the prior wherever drafting steps are measured.
        explore_every: a request is forced to try the draft forward / the fused heads at
            least once every this many of its steps, so that their acceptance stays
            measured (0: never force a try; the policy then takes an option only when
            its current estimates favour it).
        explore_max: the gap between forced tries doubles after every try the policy did
            not then take up on its own, up to this many steps.
        explore_beside_ngram: also force a try while the request's n-gram chain is
            expected to yield at least as many tokens as the tried option could at best
            (its own positions all accepted). Off by default: such a try can only lose
            the step's n-gram yield (greedy 6K on SmolLM2: 18-24 fused-heads tries per
            run accepting 0.9 tokens each, where an n-gram step accepted 7.46).
        observe_past_cut: book in the calibration whether each chain's first token past
            the cut would have been accepted, as the step's output tells it for free
            (``core.policy.estimates.Calibration.observe``). Off: only verified tokens are booked, as
            before, and a position whose estimate fell below the cut is never examined
            again (replayed on a looping greedy output at batch-8 costs: chains cut after
            one token for 500+ tokens).
        ngram_escape: for which requests the adaptive policy's chains score a 3-token
            context's most frequent continuation ``c / (t + 1)`` (one count kept for a
            continuation not seen yet; ``NGramTable.best_next``) rather than ``c / t``, so
            that a context seen once is not scored as certain: ``"sampled"`` (default)
            for sampled requests only, ``true`` for all, ``false`` for none (``c / t``,
            as before). Measured on SmolLM2 (README benchmark notes): under the paper's
            sampling at 2K it halved the draft tokens verified, for more accepted
            (1.009x / 0.992x AR against 0.975x / 0.967x); for greedy requests it was
            level at 2K and cost 4% more steps at batch 8 (a greedy output's own
            3-token contexts seen once are often the start of a loop).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_gain: float = Field(MIN_GAIN, ge=0.0, le=1.0)
    draft_token_cost_prior: float = Field(DRAFT_TOKEN_COST_PRIOR, ge=0.0, le=1.0)
    explore_every: int = Field(48, ge=0, le=1_000_000)
    explore_max: int = Field(768, ge=1, le=1_000_000)
    explore_beside_ngram: bool = False
    observe_past_cut: bool = True
    ngram_escape: bool | Literal["sampled"] = "sampled"

    @model_validator(mode="after")
    def _gap_order(self) -> "PolicyTuning":
        if self.explore_every > self.explore_max:
            raise ValueError(f"policy_tuning.explore_every={self.explore_every} is larger than "
                             f"explore_max={self.explore_max}; the gap only grows from explore_every "
                             "up to explore_max")
        return self


class TokenSwiftConfig(BaseModel):
    """Validated TokenSwift proposer settings.

    Attributes:
        kv_budget: Draft KV budget |B| in tokens (paper Sec 3.3). The draft forward
            attends to at most this many cached tokens per layer (rounded down to
            whole KV blocks, plus the newest token's own block). Contexts shorter
            than the budget are used whole.
        sink_tokens: |S|, the first tokens always kept in the draft view
            (attention sinks); rounded up to whole blocks.
        ngram_n: n of the n-gram table used for token reutilization (Sec 3.2).
        ngram_topk: k, the number of most frequent n-grams retrieved per step;
            0 disables token reutilization (ablation "k=0").
        tree: Candidates per distribution ``[l_0, l_1, l_2, l_3]``; the paper's
            ``[1, 3, 3, 3]``. Its length must be ``num_heads + 1``. vLLM verifies
            one chain, so the tree is the candidate set the chain is chosen from.
        draft_kv: ``"dynamic"`` (Sec 3.3: re-selected as the recent part fills the
            budget), ``"static"`` (selected once after prefill, ablation) or
            ``"full"`` (no budget: the whole block table, ablation).
        view_granularity: ``"layer"``: each layer selects its own blocks by its own
            importance (one block table per layer); ``"shared"``: one selection from
            the importance summed over layers (one block table for all layers).
            Token-level, per-KV-head selection (the paper's) is not offered: vLLM's
            block tables are shared by all heads of a layer.
        use_heads: Use the trained draft heads for ``l_1..l_3``; ``False`` drafts
            only ``l_0`` from the LM head plus n-grams (ablation "heads off").
        draft_penalty: Apply the request's repetition penalty (windowed or not),
            temperature and min_p to the draft distributions so drafts aim at what
            the target accepts (Sec 3.4). Off only for the ablation.
        ngram_min_conf: Chains longer than ``num_heads + 1`` tokens are extended
            with n-gram continuations only while each extra token's estimated
            acceptance probability is at least this value.
        policy: the drafting policy (:mod:`vllm_tokenswift.core.policy`), by name or class
            path. ``"adaptive"`` (default): every step and for every request it picks the
            option with the highest expected generated tokens per second, from step costs
            and acceptance measured while the engine runs: the draft forward over the
            budgeted view, fused heads (no extra forward; heads applied to the verification
            forward's hidden state), an n-gram chain alone, or no draft; and the chain
            length. ``"paper"``: the draft forward every step with the paper's chain
            (ablations). ``"triforce"``: a self-speculative chain of ``chain_length`` draft
            forwards every step, no heads, no n-grams (the paper's TriForce* baseline, Table 3).
            ``"medusa"``: the heads on the verification forward's hidden state every step (the
            paper's Medusa* baseline). ``"cycle"`` (diagnostics and tests): every request
            rotates through the five options step by step. ``"package.module:Class"``: a subclass of
            :class:`vllm_tokenswift.core.policy.DraftingPolicy` (the cost probe's policy is
            one, ``vllm_tokenswift.bench.probe_policy:ProbePolicy``); it is imported and
            checked in the front end when the engine is created.
        chain_length: the most draft forwards of one self-speculative chain (the ``chain``
            option: the target drafts token by token over its budgeted view, each forward
            over the view plus the chain drafted so far); ``policy="triforce"`` drafts exactly
            this many per step. Default (None): ``num_speculative_tokens``. At most
            ``num_speculative_tokens``; 0 turns the option off for the adaptive policy.
        fused_heads: Allow the fused-heads option under ``policy="adaptive"``
            (beyond the paper; off for the ablation).
        policy_tuning: :class:`PolicyTuning`, the adaptive policy's advanced settings
            (exploration, cost prior, margin over plain decoding).
        heads: Path of the heads checkpoint (taken from the speculative config's
            ``"model"``); ``None`` only when ``use_heads`` is false.
        num_speculative_tokens: Longest chain proposed per step (from the
            speculative config).
        num_heads: Number of draft heads expected in the checkpoint.
        log_interval_s: Seconds between the plugin's own metric log lines
            (0 disables the periodic log line).
        verify_attention: ``"auto"`` (default): on vLLM's CPU backend, requests that
            verify draft tokens (2 to ``num_speculative_tokens + 1`` query tokens) get
            their attention from the plugin's kernel, which reads each KV head's context
            once for all query heads and tokens of the group
            (:mod:`vllm_tokenswift.kernels.verify_attention`; fp32 "vec" caches on x86-64 with
            AVX2, elsewhere vLLM's kernel); ``"vllm"``: vLLM's kernel for every request.
        draft_forward: ``"auto"`` (default): on vLLM's CPU backend, the draft forward and the
            self-speculative chains' forwards run natively, one C call over a packed copy of
            the weights (:mod:`vllm_tokenswift.kernels.draft_forward`), once the engine's
            first draft forward has shown it agrees with vLLM's model (fp32 Llama/Qwen2-style
            targets with the plugin's kernel, one rank; elsewhere vLLM's model, logged once);
            ``"vllm"``: always vLLM's model.
        draft_weights: the native forward's copy of the weights: ``"bfloat16"`` (default;
            half the target's fp32 size in host memory, half the bytes read per draft
            forward) or ``"float32"`` (the target's own values, as much memory again). Drafts
            only: the rejection sampler verifies every draft token against the full model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_budget: int = Field(4096, ge=1)
    sink_tokens: int = Field(16, ge=0)
    ngram_n: int = Field(4, ge=2, le=8)
    ngram_topk: int = Field(20, ge=0, le=MAX_NGRAM_TOPK)
    tree: list[int] = Field(default_factory=lambda: [1, 3, 3, 3])
    draft_kv: Literal["dynamic", "static", "full"] = "dynamic"
    view_granularity: Literal["layer", "shared"] = "shared"
    use_heads: bool = True
    draft_penalty: bool = True
    ngram_min_conf: float = Field(0.3, ge=0.0, le=1.0)
    policy: str = "adaptive"
    chain_length: int | None = Field(None, ge=0, le=64)
    fused_heads: bool = True
    policy_tuning: PolicyTuning = Field(default_factory=PolicyTuning)
    heads: str | None = None
    num_speculative_tokens: int = Field(4, ge=1, le=64)
    num_heads: int = Field(DEFAULT_NUM_HEADS, ge=0, le=16)
    log_interval_s: float = Field(10.0, ge=0.0)
    verify_attention: Literal["auto", "vllm"] = "auto"
    draft_forward: Literal["auto", "vllm"] = "auto"
    draft_weights: Literal["bfloat16", "float32"] = "bfloat16"

    @field_validator("tree")
    @classmethod
    def _tree_positive(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("tree must list at least one candidate count (for l_0)")
        if any(int(c) < 1 or int(c) > MAX_TREE_WIDTH for c in v):
            raise ValueError(f"tree entries must be between 1 and {MAX_TREE_WIDTH}, got {v}")
        paths = 1
        for c in v:
            paths *= int(c)
        if paths > MAX_TREE_PATHS:
            raise ValueError(f"tree {v} has {paths} paths; at most {MAX_TREE_PATHS} are scored per "
                             f"request and step (e.g. [1, 3, 3, 3] has 27)")
        return [int(c) for c in v]

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, v: str) -> str:
        if v in BUILTIN_POLICIES or _CLASS_PATH.fullmatch(v):
            return v
        raise ValueError(f"policy must be one of {', '.join(repr(p) for p in BUILTIN_POLICIES)} or a "
                         f"'package.module:Class' path of a DraftingPolicy subclass, got {v!r}")

    @model_validator(mode="after")
    def _consistent(self) -> "TokenSwiftConfig":
        if len(self.tree) != self.num_heads + 1:
            raise ValueError(
                f"tree has {len(self.tree)} entries but {self.num_heads} draft heads give "
                f"{self.num_heads + 1} distributions (l_0..l_{self.num_heads}); use e.g. "
                f"{[1] + [3] * self.num_heads}"
            )
        if self.chain_length is not None and self.chain_length > self.num_speculative_tokens:
            raise ValueError(
                f"chain_length={self.chain_length} exceeds num_speculative_tokens="
                f"{self.num_speculative_tokens}: a chain drafts one token per forward and vLLM "
                f"verifies at most num_speculative_tokens (use chain_length <= "
                f"{self.num_speculative_tokens})")
        if self.use_heads and self.num_heads > 0 and not self.heads:
            raise ValueError(
                'use_heads is true but no heads checkpoint was given: set the speculative '
                'config\'s "model" to a heads folder (or "tokenswift": {"use_heads": false})'
            )
        return self

    @property
    def max_chain_length(self) -> int:
        """Most draft forwards of one self-speculative chain (:attr:`chain_length`, default
        ``num_speculative_tokens``; 0: no chains)."""
        return self.num_speculative_tokens if self.chain_length is None else self.chain_length

    @property
    def num_draft_distributions(self) -> int:
        """Distributions one draft forward yields: ``l_0`` plus one per used head."""
        return 1 + (self.num_heads if self.use_heads else 0)

    def min_kv_budget(self, block_size: int) -> int:
        """Smallest valid ``kv_budget`` for ``block_size``: the sink blocks plus one
        selected block plus the newest token's block."""
        sink_blocks = -(-self.sink_tokens // block_size)
        return (sink_blocks + 2) * block_size

    def check_block_size(self, block_size: int) -> None:
        """Check the budget and the sink against the KV block size.

        Run in the front end when the engine is created (:meth:`check_engine`) and again
        in the worker when the proposer is built.

        Raises:
            TokenSwiftConfigError: if ``kv_budget`` cannot hold the sink blocks plus
                at least two more blocks (one selected, one recent); the message names
                the smallest valid ``kv_budget``.
        """
        if self.draft_kv == "full":
            return
        need = self.min_kv_budget(block_size)
        if self.kv_budget < need:
            sink_blocks = need // block_size - 2
            raise TokenSwiftConfigError(
                f"tokenswift.kv_budget={self.kv_budget} is too small for block_size={block_size} "
                f"and sink_tokens={self.sink_tokens}: the draft view needs the sink "
                f"({sink_blocks} block{'s' if sink_blocks != 1 else ''}) + one selected block + the "
                f"newest token's block. The smallest valid kv_budget is {need} (KV blocks are "
                f"{block_size} tokens here; vLLM's default block size is 16 on CUDA and 128 on CPU)")

    def check_max_model_len(self, max_model_len: int, block_size: int | None = None) -> None:
        """Check the budget against the engine's ``max_model_len``.

        Raises:
            TokenSwiftConfigError: ``kv_budget`` larger than ``max_model_len`` (the view
                could never be smaller than the full KV cache; the message names the
                largest valid value), or a block size whose smallest valid budget does
                not fit in ``max_model_len``.
        """
        if self.draft_kv == "full":
            return
        if block_size is not None and self.min_kv_budget(block_size) > max_model_len:
            raise TokenSwiftConfigError(
                f"no tokenswift.kv_budget fits max_model_len={max_model_len} with block_size="
                f"{block_size} and sink_tokens={self.sink_tokens}: the smallest valid budget is "
                f"{self.min_kv_budget(block_size)}. Lower sink_tokens, use a smaller block size, raise "
                "max_model_len, or set draft_kv=\"full\"")
        if self.kv_budget > max_model_len:
            raise TokenSwiftConfigError(
                f"tokenswift.kv_budget={self.kv_budget} is larger than max_model_len={max_model_len}: "
                "the draft view would always be the whole KV cache. The largest valid kv_budget is "
                f"{max_model_len} (e.g. {max(256, max_model_len // 4)}); or set draft_kv=\"full\" to "
                "draft over the full cache")

    def check_heads_info(self, info, hidden_size: int) -> None:
        """Check a heads checkpoint's declared shape (``heads.HeadsInfo``) against the
        target and the settings, with the same rule as ``heads.load_heads`` in the worker:
        equal hidden size, and at least ``num_heads`` heads (a checkpoint with more heads
        is used through its first ``num_heads``).

        Raises:
            TokenSwiftConfigError: naming the mismatch and the valid setting.
        """
        if info.hidden_size != hidden_size:
            raise TokenSwiftConfigError(
                f"TokenSwift heads in {self.heads!r} have hidden size {info.hidden_size}, the target "
                f"model has {hidden_size}: the heads were trained for another model (train heads "
                "for this one with `vllm-tokenswift train-heads`)")
        if info.num_heads < self.num_heads:
            raise TokenSwiftConfigError(
                f"TokenSwift heads in {self.heads!r} hold {info.num_heads} heads but "
                f"tokenswift.num_heads={self.num_heads}: the largest valid num_heads is "
                f"{info.num_heads} (with a tree of num_heads + 1 entries, e.g. "
                f"{[1] + [3] * info.num_heads})")

    def check_model(self, *, hidden_size: int, max_model_len: int) -> None:
        """Check the settings against the target model (run in the front end, at engine
        start, before any worker exists; the workers check again when they load).

        Args:
            hidden_size: the target's hidden size (``hf_text_config.hidden_size``).
            max_model_len: the engine's resolved ``max_model_len`` (tokens).

        Raises:
            TokenSwiftConfigError: ``kv_budget`` larger than ``max_model_len``, or a heads
                checkpoint that is missing, malformed, trained for another hidden size,
                or holds fewer heads than ``num_heads``.
        """
        self.check_max_model_len(max_model_len)
        if not (self.use_heads and self.num_heads > 0):
            return
        from vllm_tokenswift.core.heads import inspect_heads

        try:
            info = inspect_heads(self.heads)
        except (ValueError, OSError, KeyError) as e:  # HeadsLoadError and bad JSON are ValueErrors
            raise TokenSwiftConfigError(f"TokenSwift heads checkpoint (speculative \"model\"): {e}") from None
        self.check_heads_info(info, hidden_size)

    def check_attention(self, hf_text_config) -> None:
        """Refuse models with sliding-window or hybrid attention (the budgeted view
        assumes every layer keeps the whole context in full-attention KV blocks).

        Raises:
            TokenSwiftConfigError: the model has non-full-attention layers.
        """
        layer_types = getattr(hf_text_config, "layer_types", None) or []
        if getattr(hf_text_config, "use_sliding_window", False) or any(
                t != "full_attention" for t in layer_types):
            raise TokenSwiftConfigError(
                "TokenSwift supports full-attention decoder models only (this model uses "
                "sliding-window or hybrid attention layers)")

    def check_engine(self, *, block_size: int, max_model_len: int, hidden_size: int) -> None:
        """Every check against the engine's resolved settings: a budget that can fit
        ``max_model_len`` at all, the budget against the block size and the sink, the
        budget against ``max_model_len``, then the heads.

        Raises:
            TokenSwiftConfigError: from :meth:`check_block_size`,
                :meth:`check_max_model_len` or :meth:`check_model`.
        """
        self.check_max_model_len(max_model_len, block_size)
        self.check_block_size(block_size)
        self.check_model(hidden_size=hidden_size, max_model_len=max_model_len)

    @classmethod
    def from_speculative_dict(cls, spec: dict[str, Any]) -> "TokenSwiftConfig":
        """Build from a user's speculative-config dict (``method == "tokenswift"``).

        Args:
            spec: the dict given to ``LLM(speculative_config=...)`` or
                ``--speculative-config``; its ``"tokenswift"`` key holds the settings,
                ``"model"`` the heads path, ``"num_speculative_tokens"`` the chain length.

        Raises:
            TokenSwiftConfigError: on an unknown key or an invalid value.
        """
        raw = spec.get("tokenswift") or {}
        if not isinstance(raw, dict):
            raise TokenSwiftConfigError(f'"tokenswift" must be a JSON object, got {type(raw).__name__}')
        data = dict(raw)
        if spec.get("model") is not None:
            data.setdefault("heads", str(spec["model"]))
        if spec.get("num_speculative_tokens") is not None:
            data.setdefault("num_speculative_tokens", spec["num_speculative_tokens"])
        return cls.parse(data)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "TokenSwiftConfig":
        """Validate a plain dict; pydantic errors become :class:`TokenSwiftConfigError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"]) or "tokenswift"
                lines.append(f"  tokenswift.{loc}: {err['msg']}")
            raise TokenSwiftConfigError("invalid TokenSwift config:\n" + "\n".join(lines)) from None


#: The only verification TokenSwift is lossless and tested with (vLLM's
#: ``rejection_sample_method``).
LOSSLESS_REJECTION_METHODS = ("standard",)


def is_tokenswift_spec(speculative_config) -> bool:
    """True for a vLLM ``SpeculativeConfig`` produced from ``method="tokenswift"`` (the plugin
    turns it into ``custom_class`` with the proposer's class path; duck-typed, so this module
    imports no vLLM)."""
    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_CLASS_PATH)


def check_rejection_method(method: str | None) -> None:
    """The verification method must be lossless (vLLM's ``rejection_sample_method``).

    Raises:
        TokenSwiftConfigError: any method but ``"standard"``.
    """
    method = method or "standard"
    if method not in LOSSLESS_REJECTION_METHODS:
        raise TokenSwiftConfigError(
            f"rejection_sample_method={method!r} cannot be used with TokenSwift: TokenSwift's output "
            "must equal plain decoding, and only 'standard' verification is lossless and supported "
            "on the runner TokenSwift uses ('fly' is lossy, 'synthetic' ignores the target, 'block' "
            "exists only on Model Runner V2). Remove rejection_sample_method")


def check_pipeline_parallel(pipeline_parallel_size: int | None) -> None:
    """TokenSwift needs the whole target on one pipeline stage.

    Raises:
        TokenSwiftConfigError: ``pipeline_parallel_size`` > 1.
    """
    if int(pipeline_parallel_size or 1) > 1:
        raise TokenSwiftConfigError(
            "TokenSwift does not support pipeline_parallel_size > 1: the drafter runs the "
            "target's own forward, which only the last pipeline stage could run")


def validate(vllm_config, *, logits_all_gathered: bool | None = None) -> TokenSwiftConfig:
    """Every check of a finished TokenSwift ``VllmConfig``; the one validation that both
    the front end (when the engine is created, before any worker exists) and the
    proposer (when vLLM builds it in the worker) run.

    Checks the settings in ``additional_config["tokenswift"]``, the verification method,
    pipeline parallelism, full attention in every layer, the budget against the KV
    block size, the sink and ``max_model_len``, the heads against the model, and under
    tensor parallelism that every rank gets the logits (vLLM's ``Platform.use_all_gather``).

    Args:
        vllm_config: vLLM's ``VllmConfig`` of a TokenSwift engine.
        logits_all_gathered: whether every TP rank receives the full logits; None asks
            vLLM's current platform.

    Returns:
        the validated :class:`TokenSwiftConfig`.

    Raises:
        TokenSwiftConfigError: one message naming the setting and, where there is one,
            the smallest (or largest) valid value.
    """
    raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        raise TokenSwiftConfigError(
            f'TokenSwift needs its settings in additional_config["{ADDITIONAL_CONFIG_KEY}"]: use '
            'speculative_config={"method": "tokenswift", ...} with the vllm-tokenswift plugin '
            "instead of naming the proposer class")
    cfg = raw if isinstance(raw, TokenSwiftConfig) else TokenSwiftConfig.parse(dict(raw))
    check_rejection_method(getattr(vllm_config.speculative_config, "rejection_sample_method", None))
    par = vllm_config.parallel_config
    check_pipeline_parallel(getattr(par, "pipeline_parallel_size", 1))
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    cfg.check_attention(hf)
    cfg.check_engine(block_size=int(vllm_config.cache_config.block_size),
                     max_model_len=int(mc.max_model_len), hidden_size=int(hf.hidden_size))
    if int(getattr(par, "tensor_parallel_size", 1) or 1) > 1:
        if logits_all_gathered is None:
            from vllm.platforms import current_platform

            logits_all_gathered = bool(current_platform.use_all_gather())
        if not logits_all_gathered:
            raise TokenSwiftConfigError(
                "TokenSwift with tensor_parallel_size > 1 needs the logits gathered on every rank "
                "(Platform.use_all_gather() is False on this platform); use tensor_parallel_size=1")
    return cfg
