"""Unit tests of the budgeted draft KV view (Sec 3.3): planning, selection, importance."""

import math

import numpy as np
import pytest
import torch

from vllm_tokenswift.core.kv_view import RequestView, ViewPlanner, block_importance
from vllm_tokenswift.engine.kv_cache import detect_key_layout, keys_cpu_vec, keys_split_last

BS = 32


def test_short_context_uses_everything():
    pl = ViewPlanner(256, 16, BS)  # 8 blocks
    st = RequestView()
    plan = pl.plan(st, pos=200)  # 7 blocks of context
    assert plan.full and not plan.needs_selection
    assert plan.blocks[0].tolist() == list(range(7))
    assert plan.seq_len == 201


def test_selection_keeps_sink_topscoring_and_recent():
    pl = ViewPlanner(256, 16, BS)  # budget 8 blocks, sink 1 block
    st = RequestView()
    pos = 20 * BS + 5  # newest token in block 20
    assert pl.plan(st, pos).needs_selection  # never selected: full view to capture the query
    imp = np.zeros(19)  # blocks 1..19
    imp[[3, 7, 11, 15, 17, 2]] = [9, 8, 7, 6, 5, 4]  # blocks 4, 8, 12, 16, 18, 3
    pl.select(st, pos, [imp])
    plan = pl.plan(st, pos)
    assert not plan.full
    # sink block 0, the 6 best blocks (8 - 1 sink - 1 recent), newest block 20 last
    assert plan.blocks[0].tolist() == [0, 3, 4, 8, 12, 16, 18, 20]
    assert plan.seq_len == 7 * BS + 6
    # two blocks later the two least important selected blocks have been displaced
    plan = pl.plan(st, pos + 2 * BS)
    assert plan.blocks[0].tolist() == [0, 4, 8, 12, 16, 20, 21, 22]
    # once the recent part displaced all of them, a re-selection is requested
    assert not pl.plan(st, pos + 6 * BS).needs_selection
    assert pl.plan(st, pos + 7 * BS).needs_selection


def test_per_layer_groups_and_recency_fallback():
    pl = ViewPlanner(128, 0, BS, num_groups=2)  # 4 blocks, no sink
    st = RequestView()
    pos = 10 * BS
    pl.select(st, pos, [np.arange(10.0), -np.arange(10.0)])
    plan = pl.plan(st, pos)
    assert [b.tolist() for b in plan.blocks] == [[7, 8, 9, 10], [0, 1, 2, 10]]
    st2 = RequestView()
    pl.select(st2, pos, None)  # no importance: most recent blocks
    assert pl.plan(st2, pos).blocks[0].tolist() == [7, 8, 9, 10]


def test_static_mode_selects_once():
    pl = ViewPlanner(128, 32, BS, mode="static")
    st = RequestView()
    pos = 10 * BS
    pl.select(st, pos, [np.arange(9.0)])  # blocks 1..9, 9 most important
    assert pl.plan(st, pos).blocks[0].tolist() == [0, 8, 9, 10]
    far = pl.plan(st, pos + 50 * BS)
    assert far.blocks[0].tolist() == [0, 8, 9, 60] and not far.needs_selection


def test_full_mode_never_budgets():
    pl = ViewPlanner(64, 16, BS, mode="full")
    plan = pl.plan(RequestView(), 100 * BS)
    assert plan.full and len(plan.blocks[0]) == 101


def test_block_importance_gqa_matches_repeated_k_reference():
    torch.manual_seed(0)
    hq, hkv, d, nb = 8, 2, 16, 5
    q = torch.randn(hq, d)
    keys = torch.randn(nb, hkv, BS, d)
    got = block_importance(q, keys)
    # reference: repeat K per query head, sum raw scores over each group (Eq. 2)
    g = hq // hkv
    ref = torch.zeros(nb)
    for h in range(hkv):
        k = keys[:, h].reshape(nb * BS, d)
        s = sum(q[h * g + j] @ k.T for j in range(g)) / math.sqrt(d)
        ref += torch.softmax(s, 0).view(nb, BS).sum(1)
    assert torch.allclose(got, ref, atol=1e-5)
    assert got.sum().item() == pytest.approx(hkv, abs=1e-4)
    with pytest.raises(ValueError):
        block_importance(torch.randn(3, d), keys)


def test_block_importance_finds_the_key_the_query_matches():
    d = 32
    keys = torch.zeros(6, 1, BS, d)
    q = torch.zeros(1, d)
    q[0, 0] = 10.0
    keys[4, 0, 7, 0] = 3.0  # one strongly matching key in block 4
    imp = block_importance(q, keys)
    assert int(imp.argmax()) == 4


def test_cpu_vec_layout_reader_and_detection():
    nb, h, d = 3, 2, 32
    kv = torch.zeros(nb, h, BS, 2 * d)
    k_true = torch.randn(nb, h, BS, d)
    v_true = torch.randn(nb, h, BS, d)
    flat = kv.view(nb, h, 2 * BS * d)
    flat[..., : BS * d] = k_true.transpose(-1, -2).reshape(nb, h, BS * d)
    flat[..., BS * d:] = v_true.reshape(nb, h, BS * d)
    ids = torch.tensor([2, 0])
    assert torch.equal(keys_cpu_vec(kv, ids), k_true[[2, 0]])
    assert detect_key_layout(kv, 2 * BS + 5, BS, k_true[2, :, 5]) == "cpu_vec"
    kv2 = torch.cat([k_true, v_true], dim=-1)
    assert torch.equal(keys_split_last(kv2, ids), k_true[[2, 0]])
    assert detect_key_layout(kv2, BS + 3, BS, k_true[1, :, 3]) == "split_last"
    assert detect_key_layout(kv2, BS + 3, BS, torch.randn(h, d)) is None
