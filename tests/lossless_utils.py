"""Shared parts of the lossless end-to-end tests (``test_engine_lossless_*.py``): TokenSwift
inside vLLM equals vLLM without speculation.

Greedy: token-identical outputs, with and without the windowed repetition penalty, for 8
prompts of different lengths (longer than the draft KV budget, so the view is re-selected
several times) and max_tokens, on three engine pairs:

- a Llama-style GQA model, ``policy="paper"`` (the draft forward every step), >= 2,048 new
  tokens per request;
- a Qwen2-style model (qkv bias, tied embeddings, MHA), ``policy="cycle"`` (every request
  switches between the draft forward, self-speculative chains, fused heads, n-gram chains and
  no draft from step to step), per-layer views, also with vLLM's global penalty;
- a small max_num_batched_tokens (prefill is chunked for real) and a KV cache too small for
  the batch, so requests are preempted and resumed, ``policy="triforce"`` (a
  self-speculative chain every step, its K/V in the lookahead slots).

The last two generate >= 1,024 tokens per request (``SHORT_MAX_TOKENS``, which keeps the
suite's time in bounds). vLLM defaults (prefix caching, chunked prefill) stay on; the modes
of the first two pairs run as one batch.
One file per engine pair, so that the test workers can run the pairs side by side.
"""

from __future__ import annotations

from engine_utils import make_llm, random_prompts, shutdown, spec_metrics, token_ids

VOCAB = 512
BUDGET = 256  # 8 blocks of 32 tokens
PROMPT_LENS = [300, 420, 520, 610, 700, 350, 900, 480]
MAX_TOKENS = [2048, 2100, 2050, 2200, 2048, 2300, 2060, 2400]
#: the Qwen2 and chunked-prefill pairs, at about half the time: every request still outgrows
#: the 256-token budget several times, and the cycle policy still runs each option on more
#: than 1,000 steps (both asserted)
SHORT_MAX_TOKENS = [1024, 1050, 1025, 1100, 1024, 1150, 1030, 1200]


def sampling(with_penalty: str | None, max_tokens: list[int] = MAX_TOKENS):
    from vllm import SamplingParams

    params = []
    for mt in max_tokens:
        kw = dict(temperature=0.0, max_tokens=mt, ignore_eos=True)
        if with_penalty == "window":
            kw.update(repetition_penalty=1.2, extra_args={"repetition_penalty_window": 64})
        elif with_penalty == "global":
            kw.update(repetition_penalty=1.2)
        params.append(SamplingParams(**kw))
    return params


def ts_config(heads: str, **over):
    ts = {"kv_budget": BUDGET, "sink_tokens": 16}
    ts.update(over)
    return {"method": "tokenswift", "model": heads, "num_speculative_tokens": 4, "tokenswift": ts}


def generate_modes(llm, prompts, modes, one_batch: bool, max_tokens: list[int] = MAX_TOKENS) -> dict:
    """Every mode's outputs. ``one_batch``: all modes in one ``generate`` call (a batch of
    ``len(modes) x 8`` requests takes about half the time of one call per mode); else one
    call per mode (the preemption pair: with ``max_num_seqs=8`` a bigger batch only waits)."""
    if not one_batch:
        return {m: token_ids(llm.generate(prompts, sampling(m, max_tokens), use_tqdm=False)) for m in modes}
    params = [p for m in modes for p in sampling(m, max_tokens)]
    toks = token_ids(llm.generate(prompts * len(modes), params, use_tqdm=False))
    n = len(prompts)
    return {m: toks[i * n:(i + 1) * n] for i, m in enumerate(modes)}


def run_pair(model: str, heads: str, tmp_extra: dict | None = None, ts_over: dict | None = None,
             modes: tuple = (None, "window", "global"), max_tokens: list[int] = MAX_TOKENS):
    """A plain engine, then a TokenSwift engine, on the same prompts and modes, request ``i``
    generating ``max_tokens[i]`` tokens.

    Returns ``(plain outputs by mode, TokenSwift outputs by mode, plugin stats, vLLM
    spec-decode metrics)``; outputs are lists of token-id lists, one per prompt."""
    prompts = random_prompts(PROMPT_LENS, VOCAB, seed=1)
    extra = tmp_extra or {}
    one_batch = "max_num_seqs" not in extra
    plain = make_llm(model, **extra)
    base = generate_modes(plain, prompts, modes, one_batch, max_tokens)
    shutdown(plain)
    ts = make_llm(model, ts_config(heads, **(ts_over or {})), **extra)
    out = generate_modes(ts, prompts, modes, one_batch, max_tokens)
    from vllm import SamplingParams

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    # finished requests are reported to the worker at the next step: run one more
    ts.generate(random_prompts([40], VOCAB, seed=9), SamplingParams(max_tokens=3, ignore_eos=True),
                use_tqdm=False)
    stats = get_engine_stats(ts)
    metrics = spec_metrics(ts)
    shutdown(ts)
    return base, out, stats, metrics


def check_identical(runs, mode, max_tokens: list[int] = MAX_TOKENS):
    """Every request of ``mode`` has ``max_tokens`` tokens and equals plain decoding exactly."""
    base, out, stats, metrics = runs
    assert [len(t) for t in base[mode]] == max_tokens
    assert [len(t) for t in out[mode]] == max_tokens
    for i, (a, b) in enumerate(zip(base[mode], out[mode])):
        assert a == b, f"request {i} ({mode}) differs at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def check_view_reselected_and_drafts_counted(runs):
    """The view counters and vLLM's spec-decode metrics of a greedy pair (its modes x 8 requests)."""
    base, out, stats, metrics = runs
    n_req = len(base) * len(PROMPT_LENS)
    # every request outgrows the 256-token budget many times over
    assert stats["view_selections"] >= 3 * n_req
    # policy "paper" (a draft forward every step) and "cycle" (a draft forward every 4th step
    # of each request, requests out of phase): a request that needs a selection drafts over
    # its whole context once and is selected from that forward's own queries, so budgeted
    # views dominate either way
    assert stats["views_budgeted"] > 10 * stats["views_full"]
    assert stats["key_layout"] is not None
    assert stats["skipped_no_slot"] == 0
    assert stats["num_live_requests"] <= 1  # per-request state freed: only the probe may be live
    # vLLM's own spec-decode metrics count TokenSwift's drafts
    assert metrics["vllm:spec_decode_num_drafts"] == stats["verified_drafts"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == stats["accepted_tokens"]
    assert stats["accepted_tokens"] == (stats["accepted_heads"] + stats["accepted_ngram"] + stats["accepted_fused"]
                                        + stats["accepted_chain"])
    assert stats["accepted_tokens"] > 0
