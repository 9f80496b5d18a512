"""vLLM glue of the attention kernel: which rows of a batch on vLLM's CPU attention backend
the kernel computes, with what metadata (the ``cpu-verify-attention`` patch,
:mod:`vllm_tokenswift.patches.attention`, installs the two replacement methods).

On TokenSwift engines on vLLM's CPU backend, every decode request (one query token, or
a verifying request with 2 to ``num_speculative_tokens + 1``) gets its attention from
:func:`vllm_tokenswift.kernels.verify_attention.verify_attention`; prefill chunks longer than
that stay on vLLM's kernel. Decode rows without drafts are routed too because the
plugin's kernel reads the context once per KV head where vLLM 0.32's reads it once per
query head: at one query token it takes 0.33-0.52x vLLM's time from 512 to 96K tokens
of context (``vllm-tokenswift probe --micro-only``, demo model), so a draft-free step of a
TokenSwift engine is no dearer than its verifying ones. Engines without TokenSwift are
untouched unless they opt in with ``additional_config={"tokenswift_verify_attention":
true}`` (:data:`vllm_tokenswift.core.config.VERIFY_ATTENTION_OPT_IN_KEY`): an engine running
vLLM's own ``ngram`` or ``suffix`` speculative decoding (:data:`OPT_IN_METHODS`) then gets
the same routing, and a plain engine (no speculative decoding) its one-token decode rows,
which is how benchmarks separate what the kernel buys from what drafting buys (bench
method ``ar-vk``);
methods with a draft model are not covered. The patch wraps two methods of
``vllm.v1.attention.backends.cpu_attn``:

* ``CPUAttentionMetadataBuilder.build`` (once per step and KV-cache group, and for the
  draft forward through ``build_for_drafting``): after vLLM's metadata is built,
  :func:`plan_batch` picks the decode requests and, when prefill chunks share the
  batch, builds vLLM's metadata for those alone (their query tokens, sequence lengths,
  block-table rows and the kernel's scheduler metadata). The plan rides on the
  metadata object as :data:`ATTR`.
* ``CPUAttentionBackendImpl.forward`` (every attention layer): with a plan, the
  planned requests' rows of the output come from the plugin's kernel and the others'
  from vLLM's kernel over the gathered rest; without one it is vLLM's forward.

Fail-closed: the builder plans only where the kernel applies (fp32 model and cache,
the "vec" ISA, no sliding window, no dynamic causality, a kernel that compiled and
loaded: where all else allows it but the kernel cannot load, a WARNING says why, once per
process); a layer whose impl has ALiBi, a soft cap, sinks, an fp8 cache or fused output
quantisation, and any call the kernel refuses, runs vLLM's forward for the whole batch.
Counters of what ran where are kept per engine (:func:`builder_counts`; ``tokenswift_stats``
key ``verify_attention``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import numpy as np
import torch

from vllm_tokenswift.kernels import verify_attention as va
from vllm_tokenswift.kernels.build import FAILED, kernel_status
from vllm_tokenswift.core.config import VERIFY_ATTENTION_OPT_IN_KEY, is_tokenswift_spec

logger = logging.getLogger("vllm_tokenswift")

CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
#: attribute of ``CPUAttentionMetadata`` carrying the step's :class:`BatchPlan`
ATTR = "_tokenswift_verify"
#: attribute of a builder caching :func:`builder_settings`
_SETTINGS = "_tokenswift_verify_settings"

#: attribute of a metadata builder holding its engine's counts (a ``Counter``):
#: ``steps`` (metadata builds with a plan, the draft forward's included), ``requests`` and
#: ``tokens`` planned, ``decode_requests`` (planned requests with one query token),
#: ``mixed_steps`` (plans beside requests left to vLLM), ``layer_calls`` (forwards that ran
#: the kernel), ``fallbacks`` (forwards that fell back). Per builder, so that engines
#: sharing a process (in-process engines) keep their own counts.
_COUNTS = "_tokenswift_verify_counts"

#: vLLM's model-free speculative methods (whose verifying requests are all the CPU
#: attention sees) that may take the kernel too, by the ``additional_config`` key
#: :data:`vllm_tokenswift.core.config.VERIFY_ATTENTION_OPT_IN_KEY`, e.g. ``vllm serve ...
#: --speculative-config '{"method": "suffix"}' --additional-config
#: '{"tokenswift_verify_attention": true}'``
OPT_IN_METHODS = ("ngram", "suffix")
#: what a plain engine (no speculative decoding) that opts in routes: its
#: one-token decode rows (``BuilderSettings.max_query_len``)
PLAIN_MAX_QUERY_LEN = 1


def builder_counts(builder) -> Counter:
    """The verification-attention counts of one metadata builder (created on first use)."""
    c = getattr(builder, _COUNTS, None)
    if c is None:
        c = Counter()
        setattr(builder, _COUNTS, c)
    return c


@dataclasses.dataclass
class BatchPlan:
    """One step's split of a batch: the kernel's :class:`~vllm_tokenswift.kernels.verify_attention.VerifyPlan`
    and, when other requests share the batch, their token indices ``rest_tokens``
    (int64 ``[T_rest]``) and vLLM's metadata for them alone (``rest_metadata``)."""

    plan: va.VerifyPlan
    counts: Counter
    rest_tokens: torch.Tensor | None = None
    rest_metadata: object | None = None


@dataclasses.dataclass(frozen=True)
class BuilderSettings:
    """Why a builder plans, or does not (``reason``), and the longest query it plans.
    ``kernel_missing``: everything else allowed the kernel, but it could not be built or
    loaded (logged as a WARNING once per process; other reasons are logged at INFO)."""

    enabled: bool
    max_query_len: int = 0
    reason: str = ""
    kernel_missing: bool = False


#: whether this process has logged the kernel-missing WARNING (:func:`builder_settings`)
_warned_missing = False


def builder_settings(builder) -> BuilderSettings:
    """Decide once per metadata builder whether its batches may use the kernel."""
    cached = getattr(builder, _SETTINGS, None)
    if cached is not None:
        return cached
    global _warned_missing
    s = _decide(builder)
    setattr(builder, _SETTINGS, s)
    if s.kernel_missing and not _warned_missing:
        _warned_missing = True
        logger.warning("TokenSwift verification attention kernel unavailable: %s. vLLM's CPU attention "
                       "runs instead (correct, but verifying drafts costs more at long context); "
                       "`python -m vllm_tokenswift.kernels` builds the kernel and shows its status",
                       s.reason)
    elif not s.enabled and s.reason:
        logger.info("TokenSwift verification attention off for %s: %s", type(builder).__name__, s.reason)
    return s


def _decide(builder) -> BuilderSettings:
    vc = builder.vllm_config
    sc = vc.speculative_config
    extra = vc.additional_config or {}
    if not is_tokenswift_spec(sc):
        if not extra.get(VERIFY_ATTENTION_OPT_IN_KEY):
            return BuilderSettings(False)
        if sc is not None and getattr(sc, "method", None) not in OPT_IN_METHODS:
            return BuilderSettings(False, reason=f"{VERIFY_ATTENTION_OPT_IN_KEY} covers "
                                                 f"{'/'.join(OPT_IN_METHODS)}, not speculative "
                                                 f"method {getattr(sc, 'method', None)!r}")
    else:
        raw = extra.get("tokenswift") or {}
        mode = getattr(raw, "verify_attention", None) or (raw.get("verify_attention", "auto")
                                                            if isinstance(raw, dict) else "auto")
        if mode != "auto":
            return BuilderSettings(False, reason=f'verify_attention="{mode}"')
    checks = [
        (builder.isa == "vec", f"ISA {builder.isa!r} (the kernel reads the 'vec' layout)"),
        (builder.dtype == torch.float32, f"model dtype {builder.dtype} (the kernel is fp32)"),
        (builder.kv_cache_dtype == "auto", f"kv_cache_dtype {builder.kv_cache_dtype!r}"),
        (builder.window_size == -1, "sliding window"),
        (not builder.is_cross_attention and not builder.is_encoder_only_attention, "not decoder attention"),
        (builder.head_dim % 32 == 0, f"head_dim {builder.head_dim} (a multiple of 32 is needed)"),
        (builder.block_size % 16 == 0, f"block_size {builder.block_size}"),
    ]
    for ok, why in checks:
        if not ok:
            return BuilderSettings(False, reason=why)
    if va.load_kernel() is None:
        st = kernel_status()
        return BuilderSettings(False, reason=va.kernel_error() or "kernel unavailable",
                               kernel_missing=st.state == FAILED)
    if sc is None:
        return BuilderSettings(True, max_query_len=PLAIN_MAX_QUERY_LEN)
    return BuilderSettings(True, max_query_len=int(sc.num_speculative_tokens) + 1)


def plan_batch(builder, settings: BuilderSettings, metadata, common) -> BatchPlan | None:
    """The step's :class:`BatchPlan`, or ``None`` when no request is a decode request.

    Decode requests: 1 to ``settings.max_query_len`` query tokens (one token: a step
    without drafts, or the draft forward; more: a step verifying drafts). The rest
    (prefill chunks) get vLLM's metadata of their own, built as
    ``CPUAttentionMetadataBuilder.build`` does (``ops.cpu_attn_get_scheduler_metadata``).
    Counts: ``requests``/``tokens`` planned, of them ``decode_requests`` with one token.
    """
    if metadata.dynamic_causal is not None or not metadata.causal:
        return None
    num_reqs = int(common.num_reqs)
    qsl = common.query_start_loc_cpu[: num_reqs + 1].numpy()
    q_lens = np.diff(qsl)
    decode = (q_lens >= 1) & (q_lens <= settings.max_query_len)
    if not decode.any():
        return None
    seq_lens = metadata.seq_lens[:num_reqs].cpu().numpy()
    idx = np.flatnonzero(decode)
    plan = va.make_plan(qsl[idx], q_lens[idx], seq_lens[idx], idx, num_kv_heads=builder.num_kv_heads,
                        gqa=builder.num_heads // builder.num_kv_heads, head_dim=builder.head_dim,
                        block_size=builder.block_size)
    counts = builder_counts(builder)
    bp = BatchPlan(plan, counts)
    counts["steps"] += 1
    counts["requests"] += len(idx)
    counts["tokens"] += int(q_lens[idx].sum())
    counts["decode_requests"] += int((q_lens[idx] == 1).sum())
    rest = np.flatnonzero(~decode)
    if rest.size:
        from vllm import _custom_ops as ops
        from vllm import envs

        tokens = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in rest])
        r_qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens[rest])]).astype(np.int32))
        r_seq = torch.from_numpy(seq_lens[rest].astype(np.int32))
        r_bt = metadata.block_table[torch.from_numpy(rest)]
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=int(rest.size), num_heads=builder.num_heads, num_kv_heads=builder.num_kv_heads,
            head_dim=builder.head_dim, seq_lens=r_seq, dtype=builder.dtype, query_start_loc=r_qsl,
            causal=metadata.causal, sliding_window_size=builder.window_size, isa=builder.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
            kv_cache_dtype=builder.kv_cache_dtype)
        bp.rest_tokens = torch.from_numpy(tokens.astype(np.int64))
        bp.rest_metadata = dataclasses.replace(
            metadata, num_actual_tokens=int(tokens.size), max_query_len=int(q_lens[rest].max()),
            query_start_loc=r_qsl, max_seq_len=int(r_seq.max()), seq_lens=r_seq, block_table=r_bt,
            scheduler_metadata=sched)
        counts["mixed_steps"] += 1
    return bp


def verify_attention_counts(runner, reset: bool = False) -> dict:
    """The counts of every metadata builder of a model runner (one engine), summed, as a
    plain dict (then cleared if ``reset``); see :func:`builder_counts`."""
    total: Counter = Counter()
    for groups in getattr(runner, "attn_groups", None) or ():
        for g in groups:
            for b in getattr(g, "metadata_builders", None) or ():
                c = getattr(b, _COUNTS, None)
                if c:
                    total.update(c)
                    if reset:
                        c.clear()
    return dict(total)


def impl_supported(impl, output_scale, output_block_scale) -> bool:
    from vllm.v1.attention.backend import AttentionType

    return (impl.attn_type == AttentionType.DECODER and impl.alibi_slopes is None
            and not impl.logits_soft_cap and impl.sinks is None and impl.sliding_window == -1
            and not impl.is_fp8_kv_cache and output_scale is None and output_block_scale is None)
