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
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_tokenswift.kernels.build import kernel_error, load_kernel

logger = logging.getLogger("vllm_tokenswift")

#: a split of the context across threads gets at least this many KV blocks
MIN_BLOCKS_PER_SPLIT = 16

#: the kernel's return codes (``TS_E_*`` in ``verify_attention.c``) and what each means
ERROR_MESSAGES = {
    -1: "the head counts do not fit: num_heads and num_kv_heads must be positive, num_heads a "
        "multiple of num_kv_heads",
    -2: "head_dim must be a positive multiple of 32",
    -3: "block_size must be a positive multiple of 16",
    -4: "num_splits must be >= 1, and a plan with num_splits > 1 needs a scratch buffer",
    -5: "the number of requests is negative",
    -6: "a request has q_len < 1, seq_len < q_len, q_start < 0 or bt_row < 0",
    -7: "out of memory: a thread's work buffers could not be allocated",
}


class VerifyAttentionError(RuntimeError):
    """The kernel refused the arguments it was given: the Python checks of
    :func:`verify_attention` or the kernel's own (its return code). Nothing was written to
    ``out`` then."""


def error_message(code: int) -> str:
    """The message of the kernel's return code ``code`` (:data:`ERROR_MESSAGES`)."""
    return ERROR_MESSAGES.get(code, "unknown error")


def _int32_vector(t, name: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 \
            or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"VerifyPlan.{name} must be a contiguous 1-D int32 CPU tensor")
    return t.numpy()


@dataclass(frozen=True, eq=False)
class VerifyPlan:
    """The requests of one batch that :func:`verify_attention` computes.

    All arrays are int32 ``[R]`` (CPU, contiguous): ``q_start`` the request's first
    query token in the batch, ``q_len`` its query tokens, ``seq_len`` its context
    *including* those tokens, ``bt_row`` its row of the block table. ``num_splits``:
    context splits per (request, KV head) (1 on one thread). ``scratch``: fp32 buffer
    for the partial results of the splits (at least ``R * Hkv * num_splits * max(q_len) *
    G * (D + 2)`` floats when ``num_splits > 1``, ``G`` query heads per KV head).

    Frozen, and its arrays are not to be changed after it is made: the values the per-call
    checks of :func:`verify_attention` use are taken here (``num_reqs``, ``max_q_len``,
    ``max_seq_len``, ``max_q_end`` = max ``q_start + q_len``, ``max_bt_row``), and the block
    ids a block table gives it are checked once per table (:func:`check_block_table`).

    Raises:
        ValueError: an array is not a contiguous int32 CPU vector, the lengths differ, a
            request has ``q_len < 1``, ``seq_len < q_len``, ``q_start < 0`` or ``bt_row < 0``,
            ``num_splits < 1`` or ``scratch`` is not a contiguous float32 CPU tensor.
    """

    q_start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    bt_row: torch.Tensor
    num_splits: int
    scratch: torch.Tensor
    num_reqs: int = field(init=False, default=0)
    max_q_len: int = field(init=False, default=0)
    max_seq_len: int = field(init=False, default=0)
    max_q_end: int = field(init=False, default=0)
    max_bt_row: int = field(init=False, default=-1)
    #: the kernel's pointer arguments from the plan (q_start, q_len, seq_len, bt_row, scratch)
    _ptrs: tuple = field(init=False, default=(), repr=False)
    #: ``{"table": key}``: the block table the block ids were last checked against
    _checked: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self):
        qs, ql, sl, row = (_int32_vector(getattr(self, n), n) for n in ("q_start", "q_len", "seq_len", "bt_row"))
        n = ql.shape[0]
        if not (qs.shape[0] == sl.shape[0] == row.shape[0] == n):
            raise ValueError("q_start, q_len, seq_len and bt_row must have one entry per request")
        if int(self.num_splits) < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        sc = self.scratch
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or not sc.is_contiguous() \
                or not sc.is_cpu:
            raise ValueError("VerifyPlan.scratch must be a contiguous float32 CPU tensor")
        set_ = object.__setattr__
        set_(self, "num_splits", int(self.num_splits))
        set_(self, "num_reqs", int(n))
        if n:
            if ql.min() < 1 or (sl < ql).any():
                raise ValueError("every request needs >= 1 query token and seq_len >= q_len")
            if qs.min() < 0 or row.min() < 0:
                raise ValueError("q_start and bt_row must be >= 0")
            set_(self, "max_q_len", int(ql.max()))
            set_(self, "max_seq_len", int(sl.max()))
            set_(self, "max_q_end", int((qs.astype(np.int64) + ql).max()))
            set_(self, "max_bt_row", int(row.max()))
        set_(self, "_ptrs", (self.q_start.data_ptr(), self.q_len.data_ptr(), self.seq_len.data_ptr(),
                             self.bt_row.data_ptr(), sc.data_ptr()))

    def scratch_needed(self, num_kv_heads: int, gqa: int, head_dim: int) -> int:
        """Floats of ``scratch`` the kernel uses for these heads (0 with one split)."""
        if self.num_splits <= 1:
            return 0
        return self.num_reqs * num_kv_heads * self.num_splits * self.max_q_len * gqa * (head_dim + 2)


def make_plan(q_start, q_len, seq_len, bt_row, *, num_kv_heads: int, gqa: int, head_dim: int,
              block_size: int, num_threads: int | None = None) -> VerifyPlan:
    """Build a :class:`VerifyPlan` from per-request integer sequences.

    ``num_splits`` is chosen so that the ``R * num_kv_heads * num_splits`` work items
    keep ``num_threads`` threads busy (default ``torch.get_num_threads()``) while each
    split keeps at least :data:`MIN_BLOCKS_PER_SPLIT` KV blocks; ``scratch`` is sized for
    ``num_kv_heads``, ``gqa`` query heads per KV head and ``head_dim``.

    Raises:
        ValueError: lengths differ, a request has no query token, a context shorter
            than its query tokens, or a negative ``q_start`` or ``bt_row``.
    """
    arrs = [np.ascontiguousarray(np.asarray(a, dtype=np.int32)).reshape(-1)
            for a in (q_start, q_len, seq_len, bt_row)]
    n = arrs[0].shape[0]
    if any(a.shape[0] != n for a in arrs):
        raise ValueError("q_start, q_len, seq_len and bt_row must have one entry per request")
    threads = max(1, int(num_threads if num_threads is not None else torch.get_num_threads()))
    splits = 1
    if n and threads > n * num_kv_heads:
        nblk_min = int((max(int(arrs[2].min()), 0) + block_size - 1) // block_size)
        splits = max(1, min(-(-threads // (n * num_kv_heads)), nblk_min // MIN_BLOCKS_PER_SPLIT))
    max_m = max(int(arrs[1].max()), 0) * gqa if n else 0
    size = n * num_kv_heads * splits * max_m * (head_dim + 2) if splits > 1 else 0
    t = [torch.from_numpy(a) for a in arrs]
    return VerifyPlan(t[0], t[1], t[2], t[3], splits, torch.empty(size + 16, dtype=torch.float32))


def _table_key(block_table: torch.Tensor, num_blocks: int, block_size: int) -> tuple:
    # an inference-mode tensor has no version counter (asking raises, and building that
    # error costs more than the rest of the check)
    version = -1 if block_table.is_inference() else block_table._version
    return (block_table.data_ptr(), block_table.shape, block_table.stride(0), version, num_blocks, block_size)


def check_block_table(plan: VerifyPlan, block_table: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Check that every block id the kernel will read for ``plan`` lies in ``[0,
    num_blocks)``: ``block_table[bt_row[r], :ceil(seq_len[r] / block_size)]`` of every
    request (ids past a request's context are not read and not checked). The table's rows
    and width are :func:`verify_attention`'s O(1) checks, done before this one.

    :func:`verify_attention` calls it once per plan and table: the outcome is kept on the
    plan, keyed by the table's data pointer, shape, row stride and version counter (bumped
    by in-place torch ops; an inference-mode tensor has none) and by ``num_blocks`` and
    ``block_size``, so the other layers of a step pay a tuple compare. A table changed
    behind torch's back (through a NumPy view) under the same plan is not seen: vLLM builds
    a new plan every step.

    Raises:
        VerifyAttentionError: a block id out of range (names the request and the position).
    """
    key = _table_key(block_table, num_blocks, block_size)
    if plan.num_reqs:
        table = block_table.numpy()
        nblk = (plan.seq_len.numpy() + (block_size - 1)) // block_size
        width = int(nblk.max())
        ids = table[plan.bt_row.numpy(), :width]                         # [R, width] (a copy)
        bad = ids.view(np.uint32) >= num_blocks                          # negative ids too
        if width != int(nblk.min()):
            bad &= np.arange(width) < nblk[:, None]                      # only the ids read
        if bad.any():
            r, j = (int(x) for x in np.argwhere(bad)[0])
            raise VerifyAttentionError(
                f"block id {int(ids[r, j])} out of range [0, {num_blocks}): request {r} "
                f"(block-table row {int(plan.bt_row[r])}), its block {j}")
    plan._checked["table"] = key


_F32, _I32 = torch.float32, torch.int32


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

    Every index the kernel follows is checked first: CPU tensors, dtypes, layouts and
    shapes; ``Hq % Hkv``, ``D % 32``, ``block_size % 16``; the scratch size; every request's
    query tokens within ``T``, its block-table row within the table, the table at least
    ``ceil(seq_len / block_size)`` wide (all O(1), from the plan's maxima); and the block
    ids it reads within ``[0, num_blocks)`` (:func:`check_block_table`, once per plan and
    table). The plan itself was checked when it was made (:class:`VerifyPlan`).

    Raises:
        RuntimeError: the kernel is not available (:func:`load_kernel`).
        VerifyAttentionError: an argument the checks refuse, or the kernel's own error code
            (:data:`ERROR_MESSAGES`, including running out of memory); nothing written.
    """
    lib = load_kernel()
    if lib is None:
        raise RuntimeError(kernel_error() or "the verification kernel is not loaded")
    if query.dtype != _F32 or out.dtype != _F32 or kv_cache.dtype != _F32 or block_table.dtype != _I32:
        raise VerifyAttentionError("float32 query/out/cache and an int32 block table are required")
    if not (query.is_cpu and out.is_cpu and kv_cache.is_cpu and block_table.is_cpu):
        raise VerifyAttentionError("query, out, cache and block table must be CPU tensors")
    qsh, csh, bsh = query.shape, kv_cache.shape, block_table.shape
    if len(qsh) != 3 or len(csh) != 4 or len(bsh) != 2:
        raise VerifyAttentionError(f"shapes do not fit: query {tuple(qsh)} must be [T, Hq, D], cache "
                                   f"{tuple(csh)} [num_blocks, Hkv, block_size, 2 * D], block table "
                                   f"{tuple(bsh)} [rows, max_blocks]")
    num_blocks, hkv, bs, two_d = csh
    t, hq, d = qsh
    if out.shape != qsh:
        raise VerifyAttentionError(f"out {tuple(out.shape)} must have query's shape {tuple(qsh)}")
    if two_d != 2 * d or hkv < 1 or hq % hkv:
        raise VerifyAttentionError(f"shapes do not fit: query {tuple(qsh)}, cache {tuple(csh)} (num_heads "
                                   f"a multiple of num_kv_heads, the cache's last dim 2 * head_dim)")
    if d < 32 or d % 32:
        raise VerifyAttentionError(f"head_dim {d}: {ERROR_MESSAGES[-2]}")
    if bs < 16 or bs % 16:
        raise VerifyAttentionError(f"block_size {bs}: {ERROR_MESSAGES[-3]}")
    qst, ost, bst = query.stride(), out.stride(), block_table.stride()
    if (qst[2] != 1 or qst[1] != d or ost[2] != 1 or ost[1] != d or bst[1] != 1
            or not kv_cache.is_contiguous()):
        raise VerifyAttentionError("query/out need contiguous heads, the cache and block table rows "
                                   "contiguous memory")
    n = plan.num_reqs
    if n:
        if plan.max_q_end > t:
            raise VerifyAttentionError(f"a request's query tokens end at {plan.max_q_end}, past the "
                                       f"batch's {t} tokens")
        if plan.max_bt_row >= bsh[0]:
            raise VerifyAttentionError(f"block-table row {plan.max_bt_row} requested, the table has "
                                       f"{bsh[0]} rows")
        if (plan.max_seq_len + bs - 1) // bs > bsh[1]:
            raise VerifyAttentionError(f"a context of {plan.max_seq_len} tokens needs "
                                       f"{(plan.max_seq_len + bs - 1) // bs} blocks of {bs}, the block "
                                       f"table is {bsh[1]} wide")
        if plan.num_splits > 1:
            need = plan.scratch_needed(hkv, hq // hkv, d)
            if plan.scratch.numel() < need:
                raise VerifyAttentionError(f"scratch holds {plan.scratch.numel()} floats, the kernel needs "
                                           f"{need} for {plan.num_splits} splits")
        if plan._checked.get("table") != _table_key(block_table, num_blocks, bs):
            check_block_table(plan, block_table, num_blocks, bs)
    qp, lp, sp, rp, scp = plan._ptrs
    rc = lib.tokenswift_verify_attention_f32(
        query.data_ptr(), qst[0], out.data_ptr(), ost[0], kv_cache.data_ptr(), block_table.data_ptr(),
        bst[0], qp, lp, sp, rp, n, hq, hkv, d, bs, float(scale), plan.num_splits, scp)
    if rc != 0:
        raise VerifyAttentionError(f"the verification kernel refused the call (code {rc}): "
                                   f"{error_message(rc)}")


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
