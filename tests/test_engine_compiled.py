"""TokenSwift with vLLM's default compiled model (no ``enforce_eager``).

vLLM compiles the target with torch.compile on this CPU too. The proposer's hooks on the
final norm and the attention layers are no-ops while a graph is traced
(``torch.compiler.is_compiling()``), so the compiled verification forward is untouched;
the draft forward runs eagerly (``skip_compiled=True``) and its hooks fire. Fused heads
need the verification forward's hidden states, which a compiled forward does not hand
out, so the policy never chooses them here.
"""

from __future__ import annotations

import pytest
from engine_utils import make_llm, random_prompts, shutdown, token_ids
from tiny_models import build_random_heads, build_tiny_model

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)

VOCAB = 512


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    from vllm import SamplingParams

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    d = tmp_path_factory.mktemp("compiled")
    model = str(build_tiny_model(d / "model", "llama", vocab_size=VOCAB, hidden_size=128, heads=4, kv_heads=2))
    heads = str(build_random_heads(d / "heads", 128))
    prompts = random_prompts([300, 520], VOCAB, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=380, ignore_eos=True, repetition_penalty=1.2,
                             extra_args={"repetition_penalty_window": 64})]
    plain = make_llm(model, enforce_eager=False)
    base = token_ids(plain.generate(prompts, params, use_tqdm=False))
    shutdown(plain)
    out, stats = {}, {}
    for policy in ("paper", "cycle"):
        spec = {"method": "tokenswift", "model": heads, "num_speculative_tokens": 4,
                "tokenswift": {"kv_budget": 256, "sink_tokens": 16, "policy": policy}}
        ts = make_llm(model, spec, enforce_eager=False)
        out[policy] = token_ids(ts.generate(prompts, params, use_tqdm=False))
        stats[policy] = get_engine_stats(ts)
        shutdown(ts)
    return base, out, stats


@pytest.mark.parametrize("policy", ["paper", "cycle"])
def test_compiled_greedy_identical(compiled_runs, policy):
    base, out, _ = compiled_runs
    assert [len(t) for t in base] == [400, 380]
    assert out[policy] == base


def test_compiled_draft_forward_ran_and_fused_heads_stayed_off(compiled_runs):
    stats = compiled_runs[2]
    assert stats["paper"]["draft_steps"] > 100 and stats["paper"]["accepted_tokens"] > 0
    assert stats["paper"]["key_layout"] is not None        # hooks fired in the eager draft forward
    assert stats["paper"]["view_selections"] > 0
    # compiled verification: no hidden states for fused heads; cycle falls back
    assert stats["cycle"]["steps_by_kind"]["fused"] == 0
    assert stats["cycle"]["steps_by_kind"]["forward"] > 50
