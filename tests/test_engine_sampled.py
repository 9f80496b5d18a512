"""Lossless under sampling: TokenSwift and plain decoding draw from the same distribution.

Test: one 40-token prompt repeated N = 2,000 times, 8 new tokens each, on a tiny random
Llama with a 64-token vocabulary; per generated position, a chi-square test of
homogeneity between the token histograms of plain vLLM and vLLM + TokenSwift (bins with
fewer than 10 pooled observations are merged). Sampling settings: temperature 1.0, and the
paper's (temperature 1.0, min_p 0.1, repetition penalty 1.2 over a 16-token window).
The test fails if any of the 8 positions has p < 0.001 / 8 (Bonferroni), so under the null
hypothesis its false-alarm rate is at most 0.1% per setting. A control checks the test has
power: the same statistic separates plain decoding with and without min_p (p < 1e-6).

Two TokenSwift engines (and one plain engine, all on one random target, shared by the
tests below): the default adaptive policy, and ``policy="cycle"``, which makes
every request switch between the draft forward, a self-speculative chain (its tokens drawn
one forward after another, each from the q handed over), fused heads, an n-gram chain and
no draft from one step to the next (the draft forwards and chains run natively,
``kernels/draft_forward.c`` with bf16 weights, after each engine's first). A third setting mixes four different prompts (different
lengths and ``max_tokens``, so requests finish at different steps and batch rows move)
in one batch and tests each prompt's histograms separately: a misalignment between the
draft distributions handed to the rejection sampler and the requests would show there.
``test_q_reaches_the_rejection_sampler``: with ``policy="paper"`` and the whole context in
the view, the draft distribution of position 0 equals the target's, so the rejection
sampler accepts it almost always, far above the point-mass acceptance Σ p² it would have
if q were not handed over.
No per-request seeds: on CPU, vLLM's seeded rejection sampler fails (see plugin.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import make_llm, random_prompts, shutdown, spec_metrics, token_ids
from tiny_models import build_random_heads, build_tiny_model

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)

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


MULTI_LENS = [17, 40, 63, 90]


def _multi(vocab: int):
    """Four prompts of different lengths, N/4 copies each, interleaved; their params."""
    from vllm import SamplingParams

    base = random_prompts(MULTI_LENS, vocab, seed=5)
    prompts, params, which = [], [], []
    for i in range(N // len(base)):
        for j, pr in enumerate(base):
            prompts.append(pr)
            params.append(SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2,
                                         max_tokens=NEW + 2 * j, ignore_eos=True,
                                         extra_args={"repetition_penalty_window": 16}))
            which.append(j)
    return prompts, params, which


def _generate_all(llm, prompt):
    out = {k: token_ids(llm.generate(prompt, _params(k), use_tqdm=False)) for k in ("t1", "paper")}
    mp, mparams, which = _multi(VOCAB)
    toks = token_ids(llm.generate(mp, mparams, use_tqdm=False))
    out["multi"] = [[t for t, w in zip(toks, which) if w == j] for j in range(len(MULTI_LENS))]
    return out


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


def _tiny_target(d, seed: int) -> tuple[str, str]:
    """The random target (64-token vocabulary, hidden 128) and random heads for it."""
    model = str(build_tiny_model(d / "model", "llama", vocab_size=VOCAB, hidden_size=128, heads=4,
                                 kv_heads=2, init_std=0.08, seed=seed))
    return model, str(build_random_heads(d / "heads", 128, seed=seed + 1))


def _spec(heads: str, policy: str) -> dict:
    return {"method": "tokenswift", "model": heads, "num_speculative_tokens": 4,
            "tokenswift": {"kv_budget": 128, "sink_tokens": 16, "policy": policy}}


def _repetitive_prompt():
    """A prompt that repeats one 8-token phrase six times (:func:`repetitive`)."""
    from vllm.inputs import TokensPrompt

    phrase = random_prompts([PATTERN_LEN], VOCAB, seed=7)[0]["prompt_token_ids"]
    return [TokensPrompt(prompt_token_ids=phrase * 6)] * N


@pytest.fixture(scope="module")
def engines_run(tmp_path_factory):
    """Three engines on one random target (plain, adaptive, cycle), each running every
    workload of this file in turn: the main samples, then the repetitive phrase (plain
    and cycle only). TokenSwift's counters are read after the main workloads and reset
    before the repetitive one, so each workload's figures are its own."""
    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    model, heads = _tiny_target(tmp_path_factory.mktemp("sampled"), seed=11)
    prompt = random_prompts([40], VOCAB, seed=3) * N
    rep_prompt = _repetitive_prompt()
    plain = make_llm(model, max_model_len=512)
    base = _generate_all(plain, prompt)
    rep_base = token_ids(plain.generate(rep_prompt, _params("paper"), use_tqdm=False))
    shutdown(plain)
    out, metrics, stats = {}, {}, {}
    rep_out = rep_stats = None
    for policy in ("adaptive", "cycle"):
        ts = make_llm(model, _spec(heads, policy), max_model_len=512)
        if policy == "cycle":
            # the adaptive engine ran in this very process (in-process engines): nothing of
            # its counters, requests or attention counts reaches the new engine
            fresh = get_engine_stats(ts)
            assert fresh["accepted_tokens"] == 0 and fresh["verified_drafts"] == 0, fresh
            assert fresh["num_live_requests"] == 0 and fresh["verify_attention"] == {}, fresh
        out[policy] = _generate_all(ts, prompt)
        metrics[policy] = spec_metrics(ts)
        stats[policy] = get_engine_stats(ts)
        if policy == "cycle":
            ts.collective_rpc("tokenswift_reset_stats")
            assert get_engine_stats(ts)["accepted_tokens"] == 0   # nothing carried over
            rep_out = token_ids(ts.generate(rep_prompt, _params("paper"), use_tqdm=False))
            # a second pass for the counters only: n-gram drafts are accepted ~7 times per
            # pass (about 2% of ~340 one-token drafts), so one pass alone has P(0) ~ 1e-3
            # and the "some were accepted" check flaked; two passes make it ~1e-6
            ts.generate(rep_prompt, _params("paper"), use_tqdm=False)
            rep_stats = get_engine_stats(ts)
        shutdown(ts)
    return {"samples": (base, out, metrics, stats), "repetitive": (rep_base, rep_out, rep_stats)}


@pytest.fixture(scope="module")
def samples(engines_run):
    return engines_run["samples"]


@pytest.mark.parametrize("policy", ["adaptive", "cycle"])
@pytest.mark.parametrize("kind", ["t1", "paper"])
def test_same_distribution(samples, kind, policy):
    base, out, _, _ = samples
    assert len(base[kind]) == len(out[policy][kind]) == N
    assert all(len(t) == NEW for t in out[policy][kind])
    p = _min_pvalue(base[kind], out[policy][kind])
    assert p >= ALPHA / NEW, f"TokenSwift ({policy}) changed the {kind} sampling distribution (min p = {p:.2e})"


@pytest.mark.parametrize("policy", ["adaptive", "cycle"])
def test_same_distribution_per_prompt_in_a_mixed_batch(samples, policy):
    base, out, _, _ = samples
    for j in range(len(MULTI_LENS)):
        a, b = base["multi"][j], out[policy]["multi"][j]
        assert len(a) == len(b) == N // len(MULTI_LENS)
        assert all(len(t) == NEW + 2 * j for t in b)
        p = _min_pvalue(a, b)
        # Bonferroni over the prompts too
        assert p >= ALPHA / (NEW * len(MULTI_LENS)), \
            f"prompt {j} ({MULTI_LENS[j]} tokens): distribution changed (min p = {p:.2e})"


def test_cycle_switched_between_all_options(samples):
    kinds = samples[3]["cycle"]["steps_by_kind"]
    assert all(kinds[k] > 500 for k in ("forward", "chain", "fused", "none")), kinds
    assert samples[3]["cycle"]["accepted_fused"] > 0 and samples[3]["cycle"]["accepted_chain"] > 0
    # the draft forwards and chains whose samples the distribution tests compare ran natively
    # (kernels/draft_forward.c, bf16 weights): all but the engine's first one
    st = samples[3]["cycle"]
    assert st["draft_forward"] == "native-bfloat16", st["draft_forward"]
    assert st["native_draft_rows"] > 1000, st["native_draft_rows"]


def test_drafts_were_both_accepted_and_rejected(samples):
    """The cycle policy drafts every other step, so accept and reject paths are both
    exercised (the adaptive policy may rightly decide that drafting on this random model
    does not pay)."""
    metrics = samples[2]["cycle"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 500
    assert metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]


def test_statistic_has_power(samples):
    base = samples[0]
    assert _min_pvalue(base["t1"], base["paper"]) < 1e-6


def test_q_reaches_the_rejection_sampler(tmp_path):
    """Flat target distribution; the draft forward sees the whole context, so q = p at
    position 0 and the rejection sampler, given q, accepts with Σ min(p, q) = 1. Treated as
    a point mass the same draft would be accepted with probability p(draft), Σ p² on
    average (about 1/30 here): far below what is measured."""
    from vllm import SamplingParams

    model = str(build_tiny_model(tmp_path / "flat", "llama", vocab_size=VOCAB, hidden_size=128, heads=4,
                                 kv_heads=2, init_std=0.02, seed=21))
    heads = str(build_random_heads(tmp_path / "heads", 128, seed=22))
    prompt = random_prompts([40], VOCAB, seed=4) * 300
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    plain = make_llm(model, max_model_len=512)
    first = np.bincount([t[0] for t in token_ids(plain.generate(prompt, params, use_tqdm=False))],
                        minlength=VOCAB) / len(prompt)
    shutdown(plain)
    spec = {"method": "tokenswift", "model": heads, "num_speculative_tokens": 4,
            "tokenswift": {"kv_budget": 512, "sink_tokens": 16, "policy": "paper"}}
    ts = make_llm(model, spec, max_model_len=512)
    ts.generate(prompt, params, use_tqdm=False)
    m = spec_metrics(ts)
    shutdown(ts)
    point_mass = float((first ** 2).sum())
    assert point_mass < 0.2  # the target is flat
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    acc0 = per_pos[0] / m["vllm:spec_decode_num_drafts"]
    assert acc0 > 0.9 > 4 * point_mass, (acc0, point_mass)


PATTERN_LEN = 8


@pytest.fixture(scope="module")
def repetitive(engines_run):
    """A prompt that repeats one 8-token phrase six times: the n-gram table proposes the
    phrase's continuation as a point mass (q = one-hot) from the first step on, while the
    windowed repetition penalty pushes the target away from exactly those tokens, the
    case where a wrong q (or a draft the penalty was not applied to) would show. Run on
    the plain and cycle engines of :func:`engines_run`; the cycle engine runs it twice and
    its counters cover both passes (the distribution test uses the first)."""
    return engines_run["repetitive"]


def test_same_distribution_with_ngram_drafts_of_repeated_text(repetitive):
    base, out, stats = repetitive
    assert len(base) == len(out) == N and all(len(t) == NEW for t in out)
    p = _min_pvalue(base, out)
    assert p >= ALPHA / NEW, f"n-gram drafts of a repeated phrase changed the distribution (min p = {p:.2e})"
    # the n-gram path was taken, and its point-mass drafts were both accepted and rejected
    assert stats["steps_by_kind"]["ngram"] > 300, stats["steps_by_kind"]
    shown = {k: stats[k] for k in ("accepted_ngram", "draft_tokens_ngram", "steps_by_kind")}
    assert 0 < stats["accepted_ngram"] < stats["draft_tokens_ngram"], shown
