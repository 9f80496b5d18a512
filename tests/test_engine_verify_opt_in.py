"""vLLM's own n-gram speculative decoding with the plugin's verification-attention kernel
(``additional_config={"tokenswift_verify_attention": true}``, issue 44): greedy output
equals plain decoding, and the kernel computed every verifying step's attention.

The demo model (6 layers), a 1,536-token prompt whose second half repeats its first (so
the n-gram proposer finds matches from the first step), 96 greedy tokens; plain decoding
against ``{"method": "ngram", "num_speculative_tokens": 4}`` with the opt-in. Engine-free
cases check who may opt in (:func:`vllm_tokenswift.cpu_attention.builder_settings`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_tokenswift import cpu_attention as ca
from vllm_tokenswift.assets_cli import DEMO_MODEL, PROMPTS_DIR
from vllm_tokenswift.bench import methods

NEW = 96


def _builder(method: str | None, extra: dict | None):
    sc = None if method is None else SimpleNamespace(method=method, model=None, num_speculative_tokens=4)
    vc = SimpleNamespace(speculative_config=sc, additional_config=extra)
    return SimpleNamespace(vllm_config=vc, isa="vec", dtype=torch.float32, kv_cache_dtype="auto",
                           window_size=-1, is_cross_attention=False, is_encoder_only_attention=False,
                           head_dim=64, block_size=128)


def test_who_may_opt_in():
    on = {ca.OPT_IN_KEY: True}
    assert ca._decide(_builder("suffix", on)).max_query_len == 5          # kernel present in CI
    assert ca._decide(_builder("ngram", on)).enabled
    assert ca._decide(_builder("ngram", None)) == ca.BuilderSettings(False)
    assert ca._decide(_builder(None, on)) == ca.BuilderSettings(False)     # plain decoding
    s = ca._decide(_builder("eagle", on))
    assert not s.enabled and "'eagle'" in s.reason
    assert methods.VERIFY_KERNEL_OPT_IN == ca.OPT_IN_KEY


def test_bench_methods_carry_the_opt_in():
    cfg = methods.BenchConfig(engine_kwargs={"additional_config": {"x": 1}})
    assert methods.speculative_config("suffix-vk", cfg) == methods.speculative_config("suffix", cfg)
    assert methods.method_engine_args("suffix-vk", cfg) == {"additional_config": {"x": 1, ca.OPT_IN_KEY: True}}
    assert methods.method_engine_args("suffix", cfg) == {}


def _counts(worker):
    return ca.verify_attention_counts(worker.model_runner)


@pytest.mark.engine
def test_ngram_with_the_kernel_equals_plain_decoding():
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from engine_utils import make_llm, shutdown

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    text = "\n\n".join(p.read_text() for p in sorted(PROMPTS_DIR.glob("*.txt")))
    half = tok(text, add_special_tokens=False)["input_ids"][:768]
    prompt = [{"prompt_token_ids": half + half}]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    kw = dict(max_model_len=2048, block_size=128, skip_tokenizer_init=False)
    plain = make_llm(str(DEMO_MODEL), **kw)
    want = list(plain.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    shutdown(plain)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    ng = make_llm(str(DEMO_MODEL), spec, additional_config={ca.OPT_IN_KEY: True}, **kw)
    got = list(ng.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    counts = ng.collective_rpc(_counts)[0]
    shutdown(ng)
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert len(got) == NEW and first is None, f"ngram + kernel differs from plain decoding at token {first}"
    # every verifying step ran the kernel in all 6 layers, without a fallback
    assert counts.get("steps", 0) > 5 and counts["layer_calls"] == 6 * counts["steps"], counts
    assert counts.get("fallbacks", 0) == 0
