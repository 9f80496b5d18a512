"""Lossless end-to-end, a Qwen2-style model (qkv bias, tied embeddings, MHA) with policy "cycle" and per-layer views,
the draft forwards and chains through the native draft forward (see ``lossless_utils``)."""

from __future__ import annotations

import pytest
from lossless_utils import SHORT_MAX_TOKENS, VOCAB, check_identical, check_view_reselected_and_drafts_counted, run_pair
from tiny_models import build_random_heads, build_tiny_model

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)


@pytest.fixture(scope="module")
def qwen_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    model = build_tiny_model(d / "model", "qwen2", vocab_size=VOCAB, hidden_size=128, heads=4)
    heads = build_random_heads(d / "heads", 128, seed=3)
    # every request switches between all five options step by step, per-layer views
    return run_pair(str(model), str(heads), ts_over={"view_granularity": "layer", "policy": "cycle"},
                    max_tokens=SHORT_MAX_TOKENS)


@pytest.mark.parametrize("mode", [None, "window", "global"])
def test_qwen2_mha_tied_greedy_identical(qwen_runs, mode):
    check_identical(qwen_runs, mode, SHORT_MAX_TOKENS)


def test_view_reselected_and_drafts_counted(qwen_runs):
    check_view_reselected_and_drafts_counted(qwen_runs)


def test_cycle_policy_used_every_option(qwen_runs):
    stats = qwen_runs[2]
    assert all(stats["steps_by_kind"][k] > 1000 for k in ("forward", "chain", "fused", "none")), stats["steps_by_kind"]
    assert stats["accepted_by_kind"]["forward"] > 0 and stats["accepted_by_kind"]["chain"] > 0
    assert stats["chain_forward_rows"] >= stats["steps_by_kind"]["chain"]
    # with q/k/v biases and one view per layer, natively after the engine's first draft forward
    assert stats["draft_forward"] == "native-bfloat16", stats["draft_forward"]
    assert stats["native_draft_rows"] > stats["chain_forward_rows"], stats


def test_each_penalty_changes_output(qwen_runs):
    base = qwen_runs[0]
    assert base["window"] != base["global"]
    assert base["window"] != base[None] and base["global"] != base[None]
