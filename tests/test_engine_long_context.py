"""Greedy TokenSwift at a long context equals plain decoding, with the verification
attention kernel doing the verifying (issue 44).

The bundled demo model with YaRN rope scaling (x2: a 40,960-token window), a 16,384-token
prefix of the bundled book openings, 128 greedy tokens, plain decoding against TokenSwift with
``policy="triforce"`` (a self-speculative chain of 3 draft forwards over a 1,024-token view
every step, the chain's K/V in the lookahead slots, verified by the next step). The kernel must have computed the attention of every
decode request, verifying or not, the chains' forwards must have run natively
(``kernels/draft_forward.c``, bf16 weights) after the first, and the outputs must be
token-identical.
"""

from __future__ import annotations

import pytest
from engine_utils import shutdown

from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)

CONTEXT = 16384
NEW = 128


@pytest.fixture(scope="module")
def runs():
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats
    from vllm_tokenswift.cli.models import yarn_overrides

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    # the bundled book openings, one after another (about 32K tokens)
    text = "\n\n".join(p.read_text() for p in sorted(PROMPTS_DIR.glob("*.txt")))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= CONTEXT
    prompt = [{"prompt_token_ids": ids[-CONTEXT:]}]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    kw = dict(model=str(DEMO_MODEL), dtype="float32", max_model_len=CONTEXT + 1024, enforce_eager=True,
              kv_cache_memory_bytes=256 * 2**20, seed=0, hf_overrides=yarn_overrides(DEMO_MODEL, 2.0),
              disable_log_stats=False)
    plain = LLM(**kw)
    want = list(plain.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    shutdown(plain)
    spec = {"method": "tokenswift", "model": str(DEMO_HEADS), "num_speculative_tokens": 6,
            "tokenswift": {"kv_budget": 1024, "policy": "triforce", "chain_length": 3}}
    ts = LLM(speculative_config=spec, **kw)
    got = list(ts.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    stats = get_engine_stats(ts)
    shutdown(ts)
    return want, got, stats


def test_greedy_identical_at_16k_context(runs):
    want, got, _ = runs
    assert len(want) == len(got) == NEW
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert first is None, f"TokenSwift differs from plain decoding at token {first}"


def test_the_kernel_verified_the_drafts(runs):
    stats = runs[2]
    va = stats["verify_attention"]
    # every verifying step went through the kernel: one call per layer (6) per such step
    assert va["steps"] > 10 and va["layer_calls"] == 6 * va["steps"], va
    assert va.get("fallbacks", 0) == 0
    assert va["requests"] == va["steps"]          # batch of one
    # the chains' forwards ran natively (kernels/draft_forward.c) after the first, which went
    # through vLLM's model and showed the two agree; that one, and every draft-free step (a
    # "none" decision, when no lookahead slot was free), are one-token rows of the kernel
    kinds = stats["steps_by_kind"]
    rows = stats["chain_forward_rows"]
    assert stats["draft_forward"] == "native-bfloat16", stats["draft_forward"]
    assert stats["native_draft_rows"] == rows - 1, stats
    vllm_rows = rows - stats["native_draft_rows"]
    assert vllm_rows <= va["decode_requests"] <= vllm_rows + kinds["none"], (va, stats)
    # every other step the kernel ran verified a chain (the last one planned never runs)
    assert va["steps"] - va["decode_requests"] in (kinds["chain"], kinds["chain"] - 1), (va, kinds)
    assert kinds["chain"] > 5 and stats["accepted_chain"] > 0, kinds
    assert rows == stats["chain_forwards"] == 3 * kinds["chain"]    # batch of one, 3 forwards per chain
