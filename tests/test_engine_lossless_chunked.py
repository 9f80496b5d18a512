"""Lossless end-to-end, chunked prefill and preemption (small max_num_batched_tokens and KV cache,
``policy="triforce"``: a self-speculative chain every step, written into the lookahead slots)
(see ``lossless_utils``)."""

from __future__ import annotations

import pytest
from lossless_utils import SHORT_MAX_TOKENS, VOCAB, check_identical, run_pair
from tiny_models import build_random_heads, build_tiny_model

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)


@pytest.fixture(scope="module")
def chunked_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_chunked")
    model = build_tiny_model(d / "model", "llama", vocab_size=VOCAB, hidden_size=128, heads=4, kv_heads=2, seed=5)
    heads = build_random_heads(d / "heads", 128, seed=6)
    # ~6K tokens of KV for 8 requests of up to 2.1K tokens (12.9K in all): preemption is certain
    return run_pair(str(model), str(heads), tmp_extra={"max_num_batched_tokens": 256, "max_num_seqs": 8,
                                                       "kv_cache_memory_bytes": 6 * 2**20},
                    ts_over={"policy": "triforce", "chain_length": 2}, modes=(None, "window"),   # the global penalty is covered by the other pairs
                    max_tokens=SHORT_MAX_TOKENS)


@pytest.mark.parametrize("mode", [None, "window"])
def test_chunked_prefill_identical(chunked_runs, mode):
    check_identical(chunked_runs, mode, SHORT_MAX_TOKENS)


def test_preemption_happened(chunked_runs):
    base, out, stats, metrics = chunked_runs
    assert metrics["vllm:num_preemptions"] > 0
    assert stats["num_live_requests"] <= 1
    # chains on every drafting step, several forwards each, and accepted
    kinds = stats["steps_by_kind"]
    assert kinds["chain"] > 1000 and kinds["forward"] == kinds["fused"] == kinds["ngram"] == 0, kinds
    assert stats["chain_forward_rows"] > 1.5 * kinds["chain"] and stats["accepted_chain"] > 0
    assert stats["skipped_no_slot"] == 0
    # through preemption and re-prefill, natively after the engine's first chain forward
    # (that first forward holds the rows of one step: at most max_num_seqs)
    assert stats["draft_forward"] == "native-bfloat16", stats["draft_forward"]
    assert 1 <= stats["chain_forward_rows"] - stats["native_draft_rows"] <= 8, stats
