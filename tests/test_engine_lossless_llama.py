"""Lossless end-to-end, a Llama-style GQA model with policy "paper" (a draft forward every step) through vLLM's model
(``draft_forward: "vllm"``; the other pairs run the native draft forward) (see ``lossless_utils``)."""

from __future__ import annotations

import pytest
from lossless_utils import VOCAB, check_identical, check_view_reselected_and_drafts_counted, run_pair
from tiny_models import build_random_heads, build_tiny_model

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    model = build_tiny_model(d / "model", "llama", vocab_size=VOCAB, hidden_size=128, heads=4, kv_heads=2)
    heads = build_random_heads(d / "heads", 128)
    # vLLM's global penalty is covered by the Qwen2 pair
    return run_pair(str(model), str(heads), ts_over={"policy": "paper", "draft_forward": "vllm"},
                    modes=(None, "window"))


@pytest.mark.parametrize("mode", [None, "window"])
def test_llama_gqa_greedy_identical(llama_runs, mode):
    check_identical(llama_runs, mode)


def test_view_reselected_and_drafts_counted(llama_runs):
    check_view_reselected_and_drafts_counted(llama_runs)


def test_the_draft_forward_ran_through_vllms_model(llama_runs):
    stats = llama_runs[2]
    assert stats["draft_forward"] == "vllm: draft_forward is 'vllm'" and stats["native_draft_rows"] == 0, stats


def test_window_changes_output(llama_runs):
    base = llama_runs[0]
    assert base["window"] != base[None]
