"""Verification attention on CPU: q = 1 + k query tokens per request over the whole
paged KV cache, one pass per (request, KV head).

Why it exists
=============
A step that verifies ``k`` draft tokens runs the target over ``1 + k`` query tokens per
request. On vLLM 0.32's CPU attention ("vec" ISA, fp32) such a request costs far more
than a one-token decode at long context: the kernel shares a KV head's pass among its
query heads only when the GQA group size divides 8, so with 3 query heads per KV head
(SmolLM2, the bundled demo model) it reads the whole context once per *query* head, in
tiles of at most 8 query rows. At 110K tokens one layer's attention took 12.6 ms for
q = 1 and 35.9 ms for q = 5 (issue 44), so verification, not drafting, made long-context
speculation expensive.

:func:`verify_attention` computes the same causal attention with a small C kernel
(``kernels/verify_attention.c``): every (request, KV head) reads its K/V blocks once,
multiplies them with all ``q * G`` query rows of the group while they are in cache, and
keeps an online softmax (flash-decoding), optionally splitting the context across
threads and merging the splits by their max and sum. :func:`reference_attention` is the
plain PyTorch definition the kernel is tested against.

Building and loading the kernel is :mod:`vllm_tokenswift.kernels.build`; where it cannot
load, vLLM's own attention stays in use (:mod:`vllm_tokenswift.kernels.cpu_attention`).

Cache layout (vLLM ``cpu_attn.py``, ``cpu_attn_vec.hpp``): a layer's cache is
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``; each (block, head) chunk of
``2 * block_size * head_dim`` values holds K transposed ``[head_dim, block_size]``, then
V ``[block_size, head_dim]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm_tokenswift.kernels.build import kernel_error, load_kernel

logger = logging.getLogger("vllm_tokenswift")

#: a split of the context across threads gets at least this many KV blocks
MIN_BLOCKS_PER_SPLIT = 16


class VerifyAttentionError(RuntimeError):
    """The kernel refused the shapes it was given (nothing was written)."""


@dataclass
class VerifyPlan:
    """The requests of one batch that :func:`verify_attention` computes.

    All arrays are int32 ``[R]`` (CPU, contiguous): ``q_start`` the request's first
    query token in the batch, ``q_len`` its query tokens, ``seq_len`` its context
    *including* those tokens, ``bt_row`` its row of the block table. ``num_splits``:
    context splits per (request, KV head) (1 on one thread). ``scratch``: fp32 buffer
    for the partial results of the splits (empty with one split).
    """

    q_start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    bt_row: torch.Tensor
    num_splits: int
    scratch: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return int(self.q_len.shape[0])


def make_plan(q_start, q_len, seq_len, bt_row, *, num_kv_heads: int, gqa: int, head_dim: int,
              block_size: int, num_threads: int | None = None) -> VerifyPlan:
    """Build a :class:`VerifyPlan` from per-request integer sequences.

    ``num_splits`` is chosen so that the ``R * num_kv_heads * num_splits`` work items
    keep ``num_threads`` threads busy (default ``torch.get_num_threads()``) while each
    split keeps at least :data:`MIN_BLOCKS_PER_SPLIT` KV blocks.

    Raises:
        ValueError: lengths differ, a request has no query token or a context shorter
            than its query tokens.
    """
    arrs = [np.ascontiguousarray(np.asarray(a, dtype=np.int32)).reshape(-1)
            for a in (q_start, q_len, seq_len, bt_row)]
    n = arrs[0].shape[0]
    if any(a.shape[0] != n for a in arrs):
        raise ValueError("q_start, q_len, seq_len and bt_row must have one entry per request")
    if n and (arrs[1].min() < 1 or (arrs[2] < arrs[1]).any()):
        raise ValueError("every request needs >= 1 query token and seq_len >= q_len")
    threads = max(1, int(num_threads if num_threads is not None else torch.get_num_threads()))
    splits = 1
    if n and threads > n * num_kv_heads:
        nblk_min = int((int(arrs[2].min()) + block_size - 1) // block_size)
        splits = max(1, min(-(-threads // (n * num_kv_heads)), nblk_min // MIN_BLOCKS_PER_SPLIT))
    max_m = int(arrs[1].max()) * gqa if n else 0
    size = n * num_kv_heads * splits * max_m * (head_dim + 2) if splits > 1 else 0
    t = [torch.from_numpy(a) for a in arrs]
    return VerifyPlan(t[0], t[1], t[2], t[3], splits, torch.empty(size + 16, dtype=torch.float32))


def verify_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     plan: VerifyPlan, out: torch.Tensor, scale: float) -> None:
    """Causal attention of the plan's requests over the paged cache, written into ``out``.

    Args:
        query: ``[T, Hq, D]`` float32, heads and dims contiguous (the token stride may be
            larger, as for vLLM's views into the fused QKV projection).
        kv_cache: the layer's cache ``[num_blocks, Hkv, block_size, 2 * D]`` float32,
            contiguous, "vec" layout (see the module doc).
        block_table: ``[rows, max_blocks]`` int32, row-contiguous.
        plan: which requests, tokens and block-table rows (:func:`make_plan`).
        out: ``[T, Hq, D]`` float32 like ``query``; rows of the plan's tokens are
            overwritten, other rows are left alone.
        scale: the softmax scale (``1 / sqrt(D)`` for standard attention).

    Raises:
        RuntimeError: the kernel is not available (:func:`load_kernel`).
        VerifyAttentionError: unsupported shapes or dtypes (nothing written).
    """
    lib = load_kernel()
    if lib is None:
        raise RuntimeError(kernel_error() or "the verification kernel is not loaded")
    num_blocks, hkv, bs, two_d = kv_cache.shape
    t, hq, d = query.shape
    if (query.dtype != torch.float32 or out.dtype != torch.float32 or kv_cache.dtype != torch.float32
            or block_table.dtype != torch.int32):
        raise VerifyAttentionError("float32 query/out/cache and an int32 block table are required")
    if two_d != 2 * d or out.shape != query.shape or hq % hkv:
        raise VerifyAttentionError(f"shapes do not fit: query {tuple(query.shape)}, cache "
                                   f"{tuple(kv_cache.shape)}, out {tuple(out.shape)}")
    if (query.stride(2) != 1 or query.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d
            or not kv_cache.is_contiguous() or block_table.stride(1) != 1):
        raise VerifyAttentionError("query/out need contiguous heads, the cache and block table rows "
                                   "contiguous memory")
    rc = lib.tokenswift_verify_attention_f32(
        query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0), kv_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), plan.q_start.data_ptr(), plan.q_len.data_ptr(),
        plan.seq_len.data_ptr(), plan.bt_row.data_ptr(), plan.num_reqs, hq, hkv, d, bs, float(scale),
        plan.num_splits, plan.scratch.data_ptr())
    if rc != 0:
        raise VerifyAttentionError(f"the verification kernel refused the call (code {rc}: head_dim "
                                   f"must be a multiple of 32, block_size of 16)")


def reference_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        plan: VerifyPlan, scale: float) -> torch.Tensor:
    """The definition :func:`verify_attention` implements, in float64 PyTorch: per plan
    request, gather its K/V from the paged cache, causal softmax attention of its
    query tokens (token ``t`` sees positions ``< seq_len - q_len + t + 1``), GQA heads
    ``j -> j // (Hq / Hkv)``. Returns ``[T, Hq, D]`` float32 with zeros outside the plan's
    tokens (for tests and the micro-benchmark)."""
    num_blocks, hkv, bs, two_d = kv_cache.shape
    t_all, hq, d = query.shape
    g = hq // hkv
    chunks = kv_cache.view(num_blocks, hkv, 2, bs * d)
    kt = chunks[:, :, 0].view(num_blocks, hkv, d, bs)
    v = chunks[:, :, 1].view(num_blocks, hkv, bs, d)
    out = torch.zeros(t_all, hq, d, dtype=torch.float32)
    for r in range(plan.num_reqs):
        qs, ql, sl, row = (int(plan.q_start[r]), int(plan.q_len[r]), int(plan.seq_len[r]),
                           int(plan.bt_row[r]))
        nb = (sl + bs - 1) // bs
        ids = block_table[row, :nb].long()
        keys = kt[ids].permute(1, 0, 3, 2).reshape(hkv, nb * bs, d)[:, :sl].double()
        vals = v[ids].permute(1, 0, 2, 3).reshape(hkv, nb * bs, d)[:, :sl].double()
        q = query[qs:qs + ql].double().permute(1, 0, 2)                  # [Hq, ql, D]
        kh = keys.repeat_interleave(g, dim=0)                             # [Hq, sl, D]
        vh = vals.repeat_interleave(g, dim=0)
        s = torch.einsum("hqd,hkd->hqk", q, kh) * scale
        pos = torch.arange(sl).view(1, -1)
        limit = (sl - ql + 1 + torch.arange(ql)).view(-1, 1)
        s = s.masked_fill(~(pos < limit), float("-inf"))
        o = torch.einsum("hqk,hkd->hqd", torch.softmax(s, dim=-1), vh)
        out[qs:qs + ql] = o.permute(1, 0, 2).float()
    return out
