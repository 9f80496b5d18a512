"""Shared helpers for the engine tests (vLLM offline engines on tiny random models)."""

from __future__ import annotations

import random

ENGINE_KW = dict(
    dtype="float32",
    block_size=32,
    max_model_len=4096,
    kv_cache_memory_bytes=512 * 1024 * 1024,
    skip_tokenizer_init=True,
    enforce_eager=True,
    disable_log_stats=False,
    seed=0,
)


def make_llm(model: str, speculative_config: dict | None = None, **kw):
    from vllm import LLM

    args = dict(ENGINE_KW)
    args.update(kw)
    if speculative_config is not None:
        args["speculative_config"] = speculative_config
    return LLM(model=model, **args)


def shutdown(llm) -> None:
    from vllm_tokenswift.bench.harness import teardown_engine

    teardown_engine(llm)


def random_prompts(lengths, vocab: int, seed: int = 0):
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(2, vocab) for _ in range(n)]) for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") or m.name == "vllm:num_preemptions":
            out[m.name] = getattr(m, "value", None) if getattr(m, "value", None) is not None else getattr(m, "values", None)
    return out
