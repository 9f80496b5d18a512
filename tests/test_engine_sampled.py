"""Lossless under sampling: TokenSwift and plain decoding draw from the same distribution.

Test: one 40-token prompt repeated N = 2,000 times, 8 new tokens each, on a tiny random
Llama with a 64-token vocabulary; per generated position, a chi-square test of
homogeneity between the token histograms of plain vLLM and vLLM + TokenSwift (bins with
fewer than 10 pooled observations are merged). Sampling settings: temperature 1.0, and the
paper's (temperature 1.0, min_p 0.1, repetition penalty 1.2 over a 16-token window).
The test fails if any of the 8 positions has p < 0.001 / 8 (Bonferroni), so under the null
hypothesis its false-alarm rate is at most 0.1% per setting. A control checks the test has
power: the same statistic separates plain decoding with and without min_p (p < 1e-6).
No per-request seeds: on CPU, vLLM's seeded rejection sampler fails (see plugin.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import make_llm, random_prompts, shutdown, spec_metrics, token_ids
from tiny_models import build_random_heads, build_tiny_model

VOCAB = 64
N = 2000
NEW = 8
ALPHA = 0.001


def _params(kind: str):
    from vllm import SamplingParams

    if kind == "t1":
        return SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    return SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, max_tokens=NEW,
                          ignore_eos=True, extra_args={"repetition_penalty_window": 16})


def _min_pvalue(a: list[list[int]], b: list[list[int]]) -> float:
    from scipy.stats import chi2_contingency

    pmin = 1.0
    for pos in range(NEW):
        ca = np.bincount([t[pos] for t in a], minlength=VOCAB)
        cb = np.bincount([t[pos] for t in b], minlength=VOCAB)
        keep = (ca + cb) >= 10
        table = np.stack([np.append(ca[keep], ca[~keep].sum()), np.append(cb[keep], cb[~keep].sum())])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        pmin = min(pmin, chi2_contingency(table)[1])
    return pmin


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampled")
    model = str(build_tiny_model(d / "model", "llama", vocab_size=VOCAB, hidden_size=128, heads=4,
                                 kv_heads=2, init_std=0.08, seed=11))
    heads = str(build_random_heads(d / "heads", 128, seed=12))
    prompt = random_prompts([40], VOCAB, seed=3) * N
    plain = make_llm(model, max_model_len=512)
    base = {k: token_ids(plain.generate(prompt, _params(k), use_tqdm=False)) for k in ("t1", "paper")}
    shutdown(plain)
    spec = {"method": "tokenswift", "model": heads, "num_speculative_tokens": 4,
            "tokenswift": {"kv_budget": 128, "sink_tokens": 16}}
    ts = make_llm(model, spec, max_model_len=512)
    out = {k: token_ids(ts.generate(prompt, _params(k), use_tqdm=False)) for k in ("t1", "paper")}
    metrics = spec_metrics(ts)
    shutdown(ts)
    return base, out, metrics


@pytest.mark.parametrize("kind", ["t1", "paper"])
def test_same_distribution(samples, kind):
    base, out, _ = samples
    assert len(base[kind]) == len(out[kind]) == N
    assert all(len(t) == NEW for t in out[kind])
    p = _min_pvalue(base[kind], out[kind])
    assert p >= ALPHA / NEW, f"TokenSwift changed the {kind} sampling distribution (min p = {p:.2e})"


def test_drafts_were_both_accepted_and_rejected(samples):
    metrics = samples[2]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 1000  # the accept path is exercised
    assert metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]


def test_statistic_has_power(samples):
    base = samples[0]
    assert _min_pvalue(base["t1"], base["paper"]) < 1e-6
