"""The attention op alone (``vllm-tokenswift probe``'s micro-benchmark): vLLM's CPU
attention against the plugin's verification kernel over the same paged fp32 caches, one
cache per layer attended in turn so the KV is read from DRAM as in a decode step.
Engine-free (vLLM's custom ops and the plugin's kernel only)."""

from __future__ import annotations

import math
import statistics
import time
from itertools import accumulate
from typing import Sequence

#: query lengths of the micro-benchmark (1 + draft tokens)
MICRO_Q = (1, 2, 5, 9)


def synthetic_cache(context: int, *, hkv: int, d: int, block_size: int, seed: int = 0):
    """A paged fp32 cache ``[blocks, hkv, block_size, 2d]`` holding ``context`` tokens of
    one request in blocks ``1..n`` (block 0 unused, as vLLM's null block) and its block
    table ``[1, n]`` int32."""
    import torch

    n = -(-context // block_size)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(n + 1, hkv, block_size, 2 * d, generator=g) * 0.5
    table = torch.arange(1, n + 1, dtype=torch.int32).view(1, -1)
    return cache, table


def vllm_attention(query, kv_cache, block_table, q_lens: Sequence[int], seq_lens: Sequence[int],
                   scale: float, out=None, isa: str = "vec"):
    """vLLM's CPU attention as ``CPUAttentionBackendImpl.forward`` calls it (scheduler
    metadata from ``cpu_attn_get_scheduler_metadata``, KV split as the worker sets it):
    ``query`` ``[T, Hq, D]`` fp32 of requests with ``q_lens`` tokens each (in order),
    ``seq_lens`` their contexts including those tokens; returns ``out`` ``[T, Hq, D]``."""
    import torch
    from vllm import _custom_ops as ops
    from vllm import envs

    hq, d = query.shape[1], query.shape[2]
    nb, hkv, bs, _ = kv_cache.shape
    qsl = torch.tensor([0, *accumulate(int(q) for q in q_lens)], dtype=torch.int32)
    sl = torch.tensor(list(seq_lens), dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(q_lens), num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=sl, dtype=query.dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    kc, vc = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    out = torch.empty_like(query) if out is None else out
    ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                    seq_lens=sl, scale=scale, causal=True, alibi_slopes=None,
                                    sliding_window=-1, block_table=block_table, softcap=0.0,
                                    scheduler_metadata=md, s_aux=None)
    return out


def attention_microbench(contexts: Sequence[int], *, hq: int, hkv: int, d: int, block_size: int = 128,
                         q_lens: Sequence[int] = MICRO_Q, reps: int | None = None,
                         threads: int = 1, layers: int = 1) -> list[dict]:
    """Milliseconds of one layer's attention for one request, vLLM's op against the
    plugin's kernel, at each context and query length, over the same paged caches.

    ``layers`` caches (one per layer, ``[blocks, hkv, block_size, 2d]`` fp32 each) are
    attended in turn, as a decode step does: with the model's layer count their KV
    exceeds the last-level cache from a few thousand tokens on, so the op reads its
    context from DRAM as in the engine (with ``layers=1`` a 16K-token layer, 16.8 MB on
    the demo model, stays in a 32 MB L3 and the timing is cache-warm). The two ops are
    timed alternately, rep by rep, so a drift of the machine's memory bandwidth hits both.

    Returns rows ``{"context", "q", "layers", "vllm_ms", "plugin_ms", "max_abs_diff"}``
    (ms per layer, median of ``reps`` passes over the layers; default 20 below 16K tokens
    of context, else 7), on ``threads`` threads (the CPU worker's one by default).

    Raises:
        ValueError: ``layers`` < 1.
    """
    import torch

    from vllm_tokenswift.kernels import verify_attention as va

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for c in contexts:
            caches = [synthetic_cache(c + max(q_lens), hkv=hkv, d=d, block_size=block_size, seed=i)
                      for i in range(layers)]
            table = caches[0][1]
            for q in q_lens:
                seq = c + q
                query = torch.randn(q, hq, d)
                scale = 1.0 / math.sqrt(d)
                ref = torch.empty_like(query)
                mine = torch.empty_like(query)
                plan = va.make_plan([0], [q], [seq], [0], num_kv_heads=hkv, gqa=hq // hkv, head_dim=d,
                                    block_size=block_size, num_threads=threads)

                def run_vllm():
                    for cache, _ in caches:
                        vllm_attention(query, cache, table, [q], [seq], scale, ref)

                def run_plugin():
                    for cache, _ in caches:
                        va.verify_attention(query, cache, table, plan, mine, scale)

                n = reps or (20 if c < 16384 else 7)
                run_vllm()
                run_plugin()
                t_vllm, t_mine = [], []
                for _ in range(n):
                    for fn, ts in ((run_vllm, t_vllm), (run_plugin, t_mine)):
                        t = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t)
                rows.append({"context": int(c), "q": int(q), "layers": int(layers),
                             "vllm_ms": 1e3 * statistics.median(t_vllm) / layers,
                             "plugin_ms": 1e3 * statistics.median(t_mine) / layers,
                             "max_abs_diff": float((ref - mine).abs().max())})
    finally:
        torch.set_num_threads(prev)
    return rows
