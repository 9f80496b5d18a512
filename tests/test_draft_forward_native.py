"""The native draft forward (``vllm_tokenswift.kernels.draft_forward``) against its float64
definition, engine-free.

Every case builds a random Llama/Qwen2-style decoder and a paged cache in vLLM's "vec" layout,
the views' blocks scattered over the cache and NaN in every slot no view owns (a forward that
reads past a view, or writes a slot it was not given, leaves NaN behind or picks it up). The
reference writes the same K/V into a copy of the cache, so the written slots are compared too.
"""

from __future__ import annotations

import pytest
import torch

from vllm_tokenswift.kernels import build as kb
from vllm_tokenswift.kernels import draft_forward as df

pytestmark = pytest.mark.skipif(kb.cpu_supports_kernel() is not None, reason="the kernel needs x86-64 with AVX2")

H, HQ, HKV, D, INTER, BS = 96, 6, 2, 32, 160, 16


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _decoder(dtype, *, layers=2, bias=False, neox=True, rot=D, num_blocks=24, seed=0, lm_vocab=0):
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return df.pack_weight(torch.randn(n, k, generator=g) / k ** 0.5, dtype)

    def b(n):
        return torch.randn(n, generator=g) * 0.1 if bias else None

    qkv = (HQ + 2 * HKV) * D
    lys = [df.DecoderLayerWeights(
        ln1=torch.rand(H, generator=g) + 0.5, qkv=w(qkv, H), o=w(H, HQ * D), ln2=torch.rand(H, generator=g) + 0.5,
        gate_up=w(2 * INTER, H), down=w(H, INTER), kv_cache=torch.full((num_blocks, HKV, BS, 2 * D), float("nan")),
        b_qkv=b(qkv), b_o=b(H), b_gate_up=b(2 * INTER), b_down=b(H)) for _ in range(layers)]
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(2048).float()[:, None] * inv[None]
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    lm = df.pack_weight(torch.randn(lm_vocab, H, generator=g), dtype) if lm_vocab else None
    return df.PackedDecoder(lys, torch.rand(H, generator=g) + 0.5, cs, H, HQ, HKV, D, INTER, BS, 1e-5, D ** -0.5,
                            neox, dtype, lm_head=lm, vocab_size=lm_vocab)


def _views(dec, seq_lens, *, per_layer=False, seed=1):
    """Block tables for views of ``seq_lens`` tokens: each row's last block holds its own
    slot (the newest token's, the same block in every layer, left NaN from there: the forward
    writes it), the others drawn at random per table (block 0 unused); the views' cached K/V
    random, everything else NaN. Returns tables (one, or one per layer), slots, positions."""
    g = torch.Generator().manual_seed(seed)
    nb = dec.num_blocks()
    n = len(seq_lens)
    nblk = [-(-s // BS) for s in seq_lens]
    width = max(nblk) + 1
    pool = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    own, pool = pool[:n], pool[n:]
    slots = [own[r] * BS + (s - 1) % BS for r, s in enumerate(seq_lens)]
    tables = []
    for li in range(dec.num_layers if per_layer else 1):
        order = [pool[i] for i in torch.randperm(len(pool), generator=g).tolist()]
        t = torch.zeros(n, width, dtype=torch.int32)
        for r in range(n):
            ids, order = order[: nblk[r] - 1] + [own[r]], order[nblk[r] - 1:]
            t[r, : nblk[r]] = torch.tensor(ids, dtype=torch.int32)
        tables.append(t)
        for ly in (dec.layers if not per_layer else [dec.layers[li]]):
            chunks = ly.kv_cache.view(nb, HKV, 2, BS * D)
            for r, s in enumerate(seq_lens):
                for j, blk in enumerate(t[r, : nblk[r]].tolist()):
                    filled = min(BS, s - j * BS) - (1 if j == nblk[r] - 1 else 0)
                    kt = torch.randn(HKV, D, BS, generator=g)
                    vv = torch.randn(HKV, BS, D, generator=g)
                    kt[:, :, filled:] = float("nan")
                    vv[:, filled:] = float("nan")
                    chunks[blk, :, 0] = kt.reshape(HKV, BS * D)
                    chunks[blk, :, 1] = vv.reshape(HKV, BS * D)
    positions = [100 + 37 * r for r in range(n)]
    return tables, slots, positions


def _run_both(dec, seq_lens, **kw):
    tables, slots, positions = _views(dec, seq_lens, per_layer=kw.pop("per_layer", False))
    x = torch.randn(len(seq_lens), H, generator=torch.Generator().manual_seed(7))
    before = [ly.kv_cache.clone() for ly in dec.layers]
    got = df.draft_forward(dec, x, positions, slots, tables, seq_lens, capture_queries=True)
    written = [ly.kv_cache.clone() for ly in dec.layers]
    for ly, c in zip(dec.layers, before):
        ly.kv_cache.copy_(c)
    ref = df.reference_draft_forward(dec, x, positions, slots, tables, seq_lens)
    return got, ref, written, [ly.kv_cache.clone() for ly in dec.layers], before, slots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias,neox,rot", [(False, True, D), (True, False, D), (True, True, D // 2)])
def test_matches_the_float64_definition(dtype, bias, neox, rot):
    dec = _decoder(dtype, bias=bias, neox=neox, rot=rot)
    (pre, hid, q), (rpre, rhid, rq), written, ref_written, before, slots = _run_both(dec, [40, 1, 17, 33])
    assert pre.shape == hid.shape == (4, H) and q.shape == (2, 4, HQ * D)
    assert not torch.isnan(hid).any()
    assert _rel(pre, rpre) < 2e-5 and _rel(hid, rhid) < 2e-5 and _rel(q, rq) < 2e-5
    for got, want, old in zip(written, ref_written, before):
        changed = ~(torch.isnan(got) & torch.isnan(old)) & ~(got == old)
        assert torch.allclose(got[changed], want[changed], rtol=1e-4, atol=1e-5)
        # only the rows' own slots changed: 2 heads x (K + V) x D values per row
        assert int(changed.sum()) == 4 * HKV * 2 * D


def test_per_layer_views():
    dec = _decoder("float32", layers=3)
    (pre, hid, q), (rpre, rhid, rq), *_ = _run_both(dec, [30, 50], per_layer=True)
    assert _rel(hid, rhid) < 2e-5 and _rel(q, rq) < 2e-5


def test_bf16_weights_are_the_rounded_values():
    w = torch.randn(37, 50)
    p = df.pack_weight(w, "bfloat16")
    assert p.shape == (3, 50, 16) and p.dtype == torch.bfloat16
    assert torch.equal(df.unpack_weight(p, 37), w.to(torch.bfloat16).float())
    pf = df.pack_weight(w, "float32")
    assert torch.equal(df.unpack_weight(pf, 37), w)
    assert torch.equal(pf.transpose(1, 2).reshape(48, 50)[37:], torch.zeros(11, 50))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_packed_linear(dtype, rows):
    w, b, x = torch.randn(50, 33), torch.randn(50), torch.randn(rows, 33)
    y = df.packed_linear(df.pack_weight(w, dtype), 50, x, b)
    ref = x.double() @ df.unpack_weight(df.pack_weight(w, dtype), 50).double().t() + b.double()
    assert y.shape == (rows, 50) and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_forward_stays_close_to_the_fp32_one():
    """What the engine's self-check tolerates (NATIVE_TOLERANCE): the same decoder with bf16
    weights moves the final hidden state by well under 5%."""
    f32, bf = _decoder("float32"), _decoder("bfloat16")     # the same draws (seed), rounded or not
    assert torch.equal(bf.layers[0].ln1, f32.layers[0].ln1)
    tables, slots, positions = _views(f32, [40, 20])
    x = torch.randn(2, H)
    for ly_b, ly_f in zip(bf.layers, f32.layers):
        ly_b.kv_cache.copy_(ly_f.kv_cache)
    _, h32, _ = df.draft_forward(f32, x, positions, slots, tables, [40, 20])
    _, h16, _ = df.draft_forward(bf, x, positions, slots, tables, [40, 20])
    assert 0 < _rel(h16, h32) < 0.05


def test_bad_arguments_are_refused_before_the_call():
    dec = _decoder("float32")
    tables, slots, positions = _views(dec, [20])
    x = torch.randn(1, H)
    with pytest.raises(ValueError, match="x must be"):
        df.draft_forward(dec, torch.randn(1, H + 1), positions, slots, tables, [20])
    with pytest.raises(ValueError, match="rotary table"):
        df.draft_forward(dec, x, [5000], slots, tables, [20])
    with pytest.raises(ValueError, match="slots must lie"):
        df.draft_forward(dec, x, positions, [dec.num_blocks() * BS], tables, [20])
    with pytest.raises(ValueError, match="blocks, the table is"):
        df.draft_forward(dec, x, positions, slots, tables, [20 + BS * tables[0].shape[1]])
    bad = tables[0].clone()
    bad[0, 0] = dec.num_blocks()
    with pytest.raises(ValueError, match="block id outside"):
        df.draft_forward(dec, x, positions, slots, [bad], [20])
    with pytest.raises(ValueError, match="one block table for all layers"):
        df.draft_forward(dec, x, positions, slots, tables * 3, [20])
    with pytest.raises(ValueError, match="one entry per row"):
        df.draft_forward(dec, x, positions + [1], slots, tables, [20])


def test_the_decoder_checks_its_tensors():
    dec = _decoder("bfloat16")
    ly = dec.layers[0]
    with pytest.raises(ValueError, match="qkv must be a packed bfloat16"):
        df.PackedDecoder([df.DecoderLayerWeights(ly.ln1, df.pack_weight(torch.randn(10, H), "bfloat16"), ly.o, ly.ln2,
                                                 ly.gate_up, ly.down, ly.kv_cache)],
                         dec.final_norm, dec.cos_sin, H, HQ, HKV, D, INTER, BS, 1e-5, 1.0)
    with pytest.raises(ValueError, match="KV cache must be"):
        df.PackedDecoder([df.DecoderLayerWeights(ly.ln1, ly.qkv, ly.o, ly.ln2, ly.gate_up, ly.down,
                                                 torch.zeros(4, HKV, BS, D))],
                         dec.final_norm, dec.cos_sin, H, HQ, HKV, D, INTER, BS, 1e-5, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        df.PackedDecoder(dec.layers, dec.final_norm, dec.cos_sin, H, HQ, HKV, 48, INTER, BS, 1e-5, 1.0)
    with pytest.raises(ValueError, match="weight_dtype"):
        df.PackedDecoder(dec.layers, dec.final_norm, dec.cos_sin, H, HQ, HKV, D, INTER, BS, 1e-5, 1.0,
                         weight_dtype="float16")


def test_kernel_codes_have_messages():
    import re

    src = (kb.KERNEL_SOURCES[1]).read_text()
    codes = {int(c) for c in re.findall(r"TSD_E_\w+ = (-\d+)", src)}
    assert codes and codes == set(df.DRAFT_ERROR_MESSAGES)
