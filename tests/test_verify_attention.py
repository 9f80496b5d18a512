"""The CPU verification-attention kernel (``vllm_tokenswift.kernels.verify_attention``) against
its float64 definition and against vLLM's own CPU attention op, engine-free.

Every case builds a paged cache in vLLM's "vec" layout with the request's blocks
scattered over the cache, NaN in every slot no request owns (a kernel that reads past a
request's context, or multiplies a masked probability by stale memory, returns NaN),
and query tokens of requests the plan leaves out (their output rows must stay as they
were).
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

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


def _bad_case():
    """A valid call (2 planned requests over 3 rows of the table, head_dim 64, blocks of 32),
    with ``out`` filled with a sentinel: the cases below each break one thing."""
    seq_lens, q_lens = [100, 40], [2, 3]
    query, cache, table, starts = _case(seq_lens, q_lens, hq=6, hkv=2, d=64, bs=32)
    plan = _plan(starts, q_lens, seq_lens, hkv=2, g=3, d=64, bs=32)
    out = torch.full(query.shape, 7.0)
    return dict(query=query, kv_cache=cache, block_table=table, plan=plan, out=out, scale=0.125)


def _with(**changes):
    def apply(a):
        for k, fn in changes.items():
            a[k] = fn(a)
        return a
    return apply


def _set_table(r, j, value):
    def fn(a):
        t = a["block_table"].clone()
        t[r, j] = value
        return t
    return fn


BAD_CALLS = [
    # (id, change, message the error must contain)
    ("query-dtype", _with(query=lambda a: a["query"].double()), "float32"),
    ("table-dtype", _with(block_table=lambda a: a["block_table"].long()), "int32 block table"),
    ("query-dims", _with(query=lambda a: a["query"].reshape(a["query"].shape[0], -1),
                         out=lambda a: a["out"].reshape(a["out"].shape[0], -1)), "must be [T, Hq, D]"),
    ("out-shape", _with(out=lambda a: a["out"][:-1]), "must have query's shape"),
    ("heads-not-a-multiple", _with(query=lambda a: a["query"][:, :5], out=lambda a: a["out"][:, :5]),
     "shapes do not fit"),
    ("cache-not-2d", _with(kv_cache=lambda a: a["kv_cache"][..., :64].contiguous()), "shapes do not fit"),
    ("head-dim-48", _with(query=lambda a: a["query"][..., :48], out=lambda a: a["out"][..., :48].contiguous(),
                          kv_cache=lambda a: a["kv_cache"][..., :96].contiguous()), "head_dim 48"),
    ("block-size-24", _with(kv_cache=lambda a: a["kv_cache"][:, :, :24].contiguous()), "block_size 24"),
    ("query-heads-strided", _with(query=lambda a: a["query"].transpose(0, 1).contiguous().transpose(0, 1)),
     "contiguous"),
    ("cache-not-contiguous", _with(kv_cache=lambda a: a["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
     "contiguous"),
    ("table-columns-strided", _with(block_table=lambda a: a["block_table"].t().contiguous().t()), "contiguous"),
    ("scratch-too-small", _with(plan=lambda a: dataclasses.replace(a["plan"], num_splits=2)),
     f"scratch holds 16 floats, the kernel needs {2 * 2 * 2 * 3 * 3 * 66} for 2 splits"),   # R Hkv splits q G D+2
    ("query-tokens-past-T", _with(query=lambda a: a["query"][:-1], out=lambda a: a["out"][:-1]),
     "past the batch's 7 tokens"),
    ("table-row-missing", _with(block_table=lambda a: a["block_table"][:2]), "row 2 requested, the table has 2 rows"),
    ("table-too-narrow", _with(block_table=lambda a: a["block_table"][:, :3]),
     "needs 4 blocks of 32, the block table is 3 wide"),
    ("block-id-too-large", _with(block_table=lambda a: _set_table(1, 3, a["kv_cache"].shape[0])(a)),
     "block id 11 out of range [0, 11): request 0 (block-table row 1), its block 3"),
    ("block-id-negative", _with(block_table=_set_table(2, 1, -1)),
     "block id -1 out of range [0, 11): request 1 (block-table row 2), its block 1"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_each_bad_argument_is_refused_before_the_kernel_runs(change, message):
    """Every argument the kernel indexes with is checked in Python first, each with its own
    message; a refused call writes nothing."""
    a = _bad_case()
    out = a["out"]
    va.verify_attention(**a)                                   # the unbroken call is fine
    out.fill_(7.0)
    a = change(a)
    with pytest.raises(va.VerifyAttentionError) as e:
        va.verify_attention(**a)
    assert message in str(e.value)
    assert (a["out"] == 7.0).all() and (out == 7.0).all()


def test_block_ids_past_a_context_are_not_read_nor_checked():
    a = _bad_case()
    table = a["block_table"]
    table[1, 4:] = -1                       # request 0 (row 1) uses 4 blocks of 32 for 100 tokens
    table[2, 2:] = 10 ** 6                  # request 1 (row 2) uses 2 for 40
    table[0] = -5                           # a row no request uses
    va.verify_attention(**a)
    want = va.reference_attention(a["query"], a["kv_cache"], table, a["plan"], 0.125)
    rows = torch.arange(3, 8)
    torch.testing.assert_close(a["out"][rows], want[rows], rtol=2e-5, atol=2e-6)


def test_block_ids_are_checked_once_per_plan_and_table(monkeypatch):
    """The per-block check runs on the first call with a table and again only when the
    table, its contents (torch's version counter), num_blocks or block_size change."""
    a = _bad_case()
    calls = []
    real = va.check_block_table

    def counting(*args):
        calls.append(args[2:])
        real(*args)

    monkeypatch.setattr(va, "check_block_table", counting)
    for _ in range(3):                                           # three "layers"
        va.verify_attention(**a)
    assert calls == [(11, 32)]
    a["kv_cache"] = torch.cat([a["kv_cache"], a["kv_cache"][:1]])   # another cache size: again
    va.verify_attention(**a)
    assert calls == [(11, 32), (12, 32)]
    a["block_table"][1, 0] = 10 ** 6                             # in place: the version moves on
    with pytest.raises(va.VerifyAttentionError, match="block id 1000000 out of range"):
        va.verify_attention(**a)


def test_plan_rejects_what_it_cannot_describe():
    mk = dict(num_kv_heads=2, gqa=3, head_dim=64, block_size=32)
    with pytest.raises(ValueError, match="q_start and bt_row must be >= 0"):
        va.make_plan([-1], [2], [100], [1], **mk)
    with pytest.raises(ValueError, match="q_start and bt_row must be >= 0"):
        va.make_plan([0], [2], [100], [-1], **mk)
    with pytest.raises(ValueError, match=">= 1 query token"):
        va.make_plan([0], [0], [100], [1], **mk)
    p = va.make_plan([0], [2], [100], [1], **mk)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        va.VerifyPlan(p.q_start, p.q_len, p.seq_len, p.bt_row, 0, p.scratch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_splits = 2                                        # the checked values stay true
    with pytest.raises(ValueError, match="scratch must be a contiguous float32"):
        va.VerifyPlan(p.q_start, p.q_len, p.seq_len, p.bt_row, 1, p.scratch.double())
    with pytest.raises(ValueError, match="int32"):
        va.VerifyPlan(p.q_start.long(), p.q_len, p.seq_len, p.bt_row, 1, p.scratch)
    with pytest.raises(ValueError, match="one entry per request"):
        va.VerifyPlan(p.q_start, p.q_len, p.seq_len, torch.zeros(2, dtype=torch.int32), 1, p.scratch)
    assert (p.max_q_len, p.max_seq_len, p.max_q_end, p.max_bt_row) == (2, 100, 2, 1)


C_CODES = dict((name, int(code)) for name, code in re.findall(r"(TS_E_\w+) = (-\d+)", kb.KERNEL_SOURCE.read_text()))


def test_every_kernel_error_code_has_its_own_message():
    assert len(C_CODES) >= 7 and sorted(C_CODES.values()) == sorted(va.ERROR_MESSAGES)
    assert len(set(va.ERROR_MESSAGES.values())) == len(va.ERROR_MESSAGES)


def _raw_call(lib, query, cache, table, plan, out, *, hq=None, hkv=None, d=None, bs=None, splits=None,
              n=None, scratch=True):
    t, q_hq, q_d = query.shape
    return lib.tokenswift_verify_attention_f32(
        query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0), cache.data_ptr(), table.data_ptr(),
        table.stride(0), plan.q_start.data_ptr(), plan.q_len.data_ptr(), plan.seq_len.data_ptr(),
        plan.bt_row.data_ptr(), plan.num_reqs if n is None else n, hq or q_hq, cache.shape[1] if hkv is None else hkv,
        d or q_d, bs or cache.shape[2], 0.125, plan.num_splits if splits is None else splits,
        plan.scratch.data_ptr() if scratch else None)


def test_the_kernels_own_checks_return_their_codes():
    """The kernel's O(num_reqs) checks, called directly (the Python checks come first in
    :func:`verify_attention`): each failure its own code, nothing written."""
    lib = va.load_kernel()
    a = _bad_case()
    q, c, t, p, out = a["query"], a["kv_cache"], a["block_table"], a["plan"], a["out"]
    assert _raw_call(lib, q, c, t, p, out) == 0
    out.fill_(7.0)
    bad_q = va.make_plan([3, 5], [2, 3], [100, 40], [1, 2], num_kv_heads=2, gqa=3, head_dim=64, block_size=32)
    bad_q.q_len[1] = 0                                      # behind the plan's back
    cases = {
        "TS_E_HEADS": dict(hkv=4), "TS_E_HEAD_DIM": dict(d=48), "TS_E_BLOCK_SIZE": dict(bs=24),
        "TS_E_SPLITS": dict(splits=0), "TS_E_NUM_REQS": dict(n=-1),
    }
    for name, kw in cases.items():
        assert _raw_call(lib, q, c, t, p, out, **kw) == C_CODES[name], name
    assert _raw_call(lib, q, c, t, p, out, splits=2, scratch=False) == C_CODES["TS_E_SPLITS"]
    assert _raw_call(lib, q, c, t, bad_q, out) == C_CODES["TS_E_REQUEST"]
    assert (out == 7.0).all()


@pytest.fixture(scope="module")
def alloc_fail_kernel(tmp_path_factory):
    """The kernel built with the test hook -DTOKENSWIFT_TEST_ALLOC_FAIL (a separate file)."""
    if kb.cpu_supports_kernel() is not None:
        pytest.skip(kb.cpu_supports_kernel())
    path = tmp_path_factory.mktemp("allocfail") / "verify_attention_allocfail.so"
    kb.build_kernel(path, extra_flags=("-DTOKENSWIFT_TEST_ALLOC_FAIL",))
    return kb.bind(ctypes.CDLL(str(path)))


@pytest.mark.parametrize("threads", [1, 2])
def test_allocation_failure_writes_nothing(alloc_fail_kernel, monkeypatch, threads):
    """A copy built with the test hook -DTOKENSWIFT_TEST_ALLOC_FAIL fails the last thread's
    allocation: with 2 threads, thread 0 got its buffers (and once wrote its items' rows);
    now every thread stops before its first item, the call raises the out-of-memory error
    and ``out`` is untouched, with one split and with several."""
    monkeypatch.setattr(va, "load_kernel", lambda: alloc_fail_kernel)
    seq_lens, q_lens = [4000, 2600], [5, 3]
    query, cache, table, starts = _case(seq_lens, q_lens, hq=6, hkv=2, d=64, bs=32)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for plan_threads in (1, 16):                            # one split; 4 splits
            plan = _plan(starts, q_lens, seq_lens, hkv=2, g=3, d=64, bs=32, threads=plan_threads)
            out = torch.full(query.shape, 7.0)
            with pytest.raises(va.VerifyAttentionError, match=r"code -7\): out of memory"):
                va.verify_attention(query, cache, table, plan, out, 0.125)
            assert (out == 7.0).all(), f"written despite the failed allocation ({plan.num_splits} splits)"
    finally:
        torch.set_num_threads(prev)


def test_the_kernel_uses_torchs_openmp_runtime():
    """Loaded after torch, the kernel binds torch's libgomp.so.1 (no second OpenMP runtime,
    and none needed on the system: the CPU image has none). Checked in a fresh interpreter:
    this test process may already hold the system's libgomp from an earlier test (inductor's
    C++ compiles in the compiled-engine tests load it), which says nothing about the kernel."""
    if not Path("/proc/self/maps").exists() or va.load_kernel() is None:
        pytest.skip("needs Linux and the kernel")
    # a runtime that can satisfy the kernel's NEEDED libgomp.so.1: torch's libgomp.so.1 or a
    # system libgomp.so.1[.0.0]; wheels' vendored copies (libgomp-<hash>.so.1.0.0, e.g.
    # sentencepiece's) carry their own SONAME and are not candidates
    code = (
        "import re, torch\n"
        "from pathlib import Path\n"
        "from vllm_tokenswift.kernels import verify_attention as va\n"
        "assert va.load_kernel() is not None\n"
        "maps = Path('/proc/self/maps').read_text().splitlines()\n"
        "print(sorted({str(Path(ln.split()[-1]).resolve()) for ln in maps\n"
        "              if re.search(r'/libgomp\\.so\\.1(\\.\\d+)*$', ln)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    gomp = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert gomp == {str((Path(torch.__file__).parent / "lib" / "libgomp.so.1").resolve())}, gomp


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
    # head_dim 48 is not a multiple of 32
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
    kb.build_kernel(path)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == [path.name]
