"""The CPU verification-attention kernel (``vllm_tokenswift.kernels.verify_attention``) against
its float64 definition and against vLLM's own CPU attention op, engine-free.

Every case builds a paged cache in vLLM's "vec" layout with the request's blocks
scattered over the cache, NaN in every slot no request owns (a kernel that reads past a
request's context, or multiplies a masked probability by stale memory, returns NaN),
and query tokens of requests the plan leaves out (their output rows must stay as they
were).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_tokenswift.kernels import build as kb
from vllm_tokenswift.kernels import verify_attention as va


def _case(seq_lens, q_lens, *, hq, hkv, d, bs, seed=0, extra_tokens=3, token_pad=0):
    """A batch: ``extra_tokens`` tokens of an unplanned request first, then the planned
    requests' query tokens. Returns query, cache, block table, plan arrays."""
    g = torch.Generator().manual_seed(seed)
    nbs = [(s + bs - 1) // bs for s in seq_lens]
    num_blocks = sum(nbs) + 5
    cache = torch.full((num_blocks, hkv, bs, 2 * d), float("nan"))
    perm = torch.randperm(num_blocks - 1, generator=g) + 1           # block 0 stays unused
    table = torch.zeros(len(seq_lens) + 1, max(nbs) + 2, dtype=torch.int32)
    chunks = cache.view(num_blocks, hkv, 2, bs * d)
    off = 0
    for r, (s, nb) in enumerate(zip(seq_lens, nbs)):
        ids = perm[off: off + nb]
        off += nb
        table[r + 1, :nb] = ids.int()
        for j, b in enumerate(ids.tolist()):
            n = min(bs, s - j * bs)
            kt = torch.randn(hkv, d, bs, generator=g)
            vv = torch.randn(hkv, bs, d, generator=g)
            kt[:, :, n:] = float("nan")   # slots past the context: never written by vLLM
            vv[:, n:] = float("nan")
            chunks[b, :, 0] = kt.reshape(hkv, bs * d)
            chunks[b, :, 1] = vv.reshape(hkv, bs * d)
    total = extra_tokens + sum(q_lens)
    base = torch.randn(total, hq * d + token_pad, generator=g) * 2.0
    query = base[:, : hq * d].view(total, hq, d)   # token stride hq*d + token_pad
    starts, s0 = [], extra_tokens
    for q in q_lens:
        starts.append(s0)
        s0 += q
    return query, cache, table, starts


def _plan(starts, q_lens, seq_lens, *, hkv, g, d, bs, threads=1):
    return va.make_plan(starts, q_lens, seq_lens, list(range(1, len(q_lens) + 1)), num_kv_heads=hkv,
                        gqa=g, head_dim=d, block_size=bs, num_threads=threads)


CASES = [
    # hq, hkv, d, bs, seq_lens, q_lens
    (6, 2, 64, 128, [1000], [5]),                  # the demo model's heads, one verifying request
    (9, 3, 64, 32, [300, 77, 129], [9, 2, 1]),     # SmolLM2's heads, several requests, a partial block
    (4, 4, 32, 32, [64, 33], [3, 17]),             # MHA, the query straddles a block boundary
    (8, 2, 128, 64, [517], [8]),                   # GQA 4, head_dim 128
    (6, 2, 64, 128, [130, 2], [2, 2]),             # a context of just the query tokens
]


@pytest.mark.parametrize("hq, hkv, d, bs, seq_lens, q_lens", CASES)
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_equals_the_definition(hq, hkv, d, bs, seq_lens, q_lens, threads):
    query, cache, table, starts = _case(seq_lens, q_lens, hq=hq, hkv=hkv, d=d, bs=bs, token_pad=7)
    plan = _plan(starts, q_lens, seq_lens, hkv=hkv, g=hq // hkv, d=d, bs=bs, threads=threads)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(query.contiguous(), 123.0)
    va.verify_attention(query, cache, table, plan, out, scale)
    want = va.reference_attention(query, cache, table, plan, scale)
    rows = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.isfinite(out[rows]).all()
    torch.testing.assert_close(out[rows], want[rows], rtol=2e-5, atol=2e-6)
    assert (out[others] == 123.0).all()   # rows outside the plan untouched


def test_context_splits_merge_exactly_like_one_pass():
    seq_lens, q_lens = [4000, 2600], [5, 3]
    query, cache, table, starts = _case(seq_lens, q_lens, hq=6, hkv=2, d=64, bs=32)
    one = _plan(starts, q_lens, seq_lens, hkv=2, g=3, d=64, bs=32, threads=1)
    many = _plan(starts, q_lens, seq_lens, hkv=2, g=3, d=64, bs=32, threads=16)
    assert one.num_splits == 1 and many.num_splits == 4        # 16 threads over 2 requests x 2 heads
    assert many.scratch.numel() >= 2 * 2 * 4 * 15 * 66
    a, b = torch.zeros(query.shape), torch.zeros(query.shape)
    va.verify_attention(query, cache, table, one, a, 0.125)
    va.verify_attention(query, cache, table, many, b, 0.125)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    want = va.reference_attention(query, cache, table, one, 0.125)
    torch.testing.assert_close(b, want, rtol=2e-5, atol=2e-6)


def test_split_count_keeps_enough_blocks_per_split():
    p = va.make_plan([0], [5], [100 * 32], [0], num_kv_heads=2, gqa=3, head_dim=64, block_size=32,
                     num_threads=64)
    assert p.num_splits == 100 // va.MIN_BLOCKS_PER_SPLIT       # 6, not 16
    p1 = va.make_plan([0], [5], [100 * 32], [0], num_kv_heads=2, gqa=3, head_dim=64, block_size=32,
                      num_threads=2)
    assert p1.num_splits == 1 and p1.scratch.numel() == 16      # 2 items already fill 2 threads


@pytest.mark.parametrize("q", [1, 2, 5, 9])
def test_kernel_matches_vllms_cpu_attention_op(q):
    """The same call vLLM's CPU backend makes for one decoding request
    (``CPUAttentionBackendImpl.forward``), against the kernel: equal to float32 rounding."""
    from vllm import _custom_ops as ops

    hq, hkv, d, bs, ctx = 6, 2, 64, 128, 3000
    seq = ctx + q
    query, cache, table, starts = _case([seq], [q], hq=hq, hkv=hkv, d=d, bs=bs, extra_tokens=0)
    cache = torch.nan_to_num(cache)                 # vLLM's kernel reads whole 32-token groups
    query = query.contiguous()
    qsl = torch.tensor([0, q], dtype=torch.int32)
    sl = torch.tensor([seq], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                             seq_lens=sl, dtype=torch.float32, query_start_loc=qsl,
                                             causal=True, sliding_window_size=-1, isa="vec",
                                             enable_kv_split=True)
    kv = cache.view(cache.shape[0], hkv, 2 * bs, d)
    kc, vc = kv.chunk(2, dim=2)
    want = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=want,
                                    query_start_loc=qsl, seq_lens=sl, scale=1 / math.sqrt(d), causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table[1:],
                                    softcap=0.0, scheduler_metadata=md, s_aux=None)
    plan = va.make_plan([0], [q], [seq], [1], num_kv_heads=hkv, gqa=hq // hkv, head_dim=d, block_size=bs,
                        num_threads=1)
    got = torch.empty_like(query)
    va.verify_attention(query, cache, table, plan, got, 1 / math.sqrt(d))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused_before_the_kernel_runs():
    query, cache, table, starts = _case([100], [2], hq=6, hkv=2, d=64, bs=32)
    plan = _plan(starts, [2], [100], hkv=2, g=3, d=64, bs=32)
    out = torch.zeros(query.shape)
    with pytest.raises(va.VerifyAttentionError, match="float32"):
        va.verify_attention(query.double(), cache, table, plan, out, 0.1)
    with pytest.raises(va.VerifyAttentionError, match="shapes do not fit"):
        va.verify_attention(query[:, :5], cache, table, plan, out[:, :5], 0.1)   # 5 heads on 2 KV heads
    with pytest.raises(va.VerifyAttentionError, match="contiguous"):
        va.verify_attention(query.transpose(0, 1).contiguous().transpose(0, 1), cache, table, plan, out, 0.1)
    assert (out == 0).all()
    with pytest.raises(ValueError, match="one entry per request"):
        va.make_plan([0, 1], [2], [100], [1], num_kv_heads=2, gqa=3, head_dim=64, block_size=32)
    with pytest.raises(ValueError, match="seq_len >= q_len"):
        va.make_plan([0], [5], [3], [1], num_kv_heads=2, gqa=3, head_dim=64, block_size=32)
    # head_dim 48 is not a multiple of 32: the kernel itself refuses
    q48 = torch.zeros(2, 6, 48)
    c48 = torch.zeros(4, 2, 32, 96)
    p48 = va.make_plan([0], [2], [40], [0], num_kv_heads=2, gqa=3, head_dim=48, block_size=32)
    with pytest.raises(va.VerifyAttentionError, match="multiple of 32"):
        va.verify_attention(q48, c48, torch.tensor([[1, 2]], dtype=torch.int32), p48, torch.zeros(2, 6, 48), 0.1)


def test_kernel_is_built_once_into_the_cache(tmp_path, monkeypatch):
    """A fresh cache folder gets one library, named by the source hash; loading again in
    the same process reuses it."""
    monkeypatch.setenv("VLLM_TOKENSWIFT_CACHE", str(tmp_path))
    path = kb.kernel_path()
    assert path.parent == tmp_path / "kernels" and not path.exists()
    kb._build(path)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == [path.name]
