"""Batches and request lifecycles with TokenSwift on the bundled demo model.

* One offline ``LLM.generate`` call with 36 prompts of mixed lengths (shorter and longer
  than the 256-token draft KV budget), greedy and sampled requests mixed, mixed
  ``max_tokens`` and stop strings: every greedy output equals plain decoding of the same
  batch, sampled ones are well-formed, stop strings stop.
* Requests aborted mid-generation, requests preempted and recomputed under KV-cache
  pressure, and requests that run into ``max_model_len``, all in one engine: no crash,
  the survivors' outputs equal plain decoding, aborted requests end as aborted, and no
  per-request proposer state outlives its request.
* The benchmark's per-segment run (``bench --segment-tokens``) on the TokenSwift engine.
"""

from __future__ import annotations

import pytest
from engine_utils import make_llm, shutdown, spec_metrics

from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR

pytestmark = pytest.mark.engine  # starts vLLM engines (not in ./scripts/test.sh --fast)

BUDGET = 256
SPEC = {"method": "tokenswift", "model": str(DEMO_HEADS), "num_speculative_tokens": 4,
        "tokenswift": {"kv_budget": BUDGET}}
KW = dict(skip_tokenizer_init=False, max_model_len=2048)


@pytest.fixture(scope="module")
def book_tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    books = [p for p in sorted(PROMPTS_DIR.glob("*.txt")) if not p.stem.endswith(("-2k", "-short"))]
    ids = [tok(p.read_text(), add_special_tokens=False)["input_ids"] for p in books]
    assert len(ids) >= 4 and min(len(x) for x in ids) >= 1800
    return ids


def _prompt(book_tokens, i: int, n: int):
    from vllm.inputs import TokensPrompt

    src = book_tokens[i % len(book_tokens)]
    start = (97 * i) % (len(src) - n)
    return TokensPrompt(prompt_token_ids=src[start:start + n])


def _batch(book_tokens):
    from vllm import SamplingParams

    lengths = [12, 40, 90, 150, 230, 255, 256, 257, 300, 420, 610, 800, 1000, 1200, 1500, 1700]
    prompts, params, greedy = [], [], []
    for i in range(36):
        n = lengths[i % len(lengths)]
        prompts.append(_prompt(book_tokens, i, n))
        max_tokens = [64, 200, 333, 500][i % 4]
        stop = [" the", "."] if i % 5 == 0 else None
        if i % 3 == 2:  # sampled, the paper's setting
            params.append(SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2,
                                         extra_args={"repetition_penalty_window": 128},
                                         max_tokens=max_tokens, stop=stop, ignore_eos=True))
            greedy.append(False)
        else:
            extra = {"repetition_penalty": 1.1, "extra_args": {"repetition_penalty_window": 64}} if i % 4 == 1 else {}
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop,
                                         ignore_eos=True, **extra))
            greedy.append(True)
    return prompts, params, greedy


def _segments_run(llm, prompt):
    """One greedy request of 48 tokens through the benchmark's per-segment run (16-token
    segments), as ``bench --segment-tokens`` does it."""
    from vllm_tokenswift.bench.harness import timed_run_segments

    return timed_run_segments(llm, list(prompt["prompt_token_ids"]), {"temperature": 0.0}, 48, 4, 16,
                              plugin_stats=True)


def test_mixed_batch_of_36_greedy_equal(book_tokens):
    prompts, params, greedy = _batch(book_tokens)
    plain = make_llm(str(DEMO_MODEL), **KW)
    want = plain.generate(prompts, params, use_tqdm=False)
    shutdown(plain)
    ts = make_llm(str(DEMO_MODEL), SPEC, **KW)
    got = ts.generate(prompts, params, use_tqdm=False)
    metrics = spec_metrics(ts)
    seg_rec, seg_ids = _segments_run(ts, prompts[9])
    shutdown(ts)
    # the benchmark's per-segment figures on a real TokenSwift engine (bench --segment-tokens)
    assert "segments_error" not in seg_rec and len(seg_ids[0]) == 48
    rows = seg_rec["segments"]
    assert rows[0]["start"] == 1 and rows[-1]["end"] == 48 and len(rows) >= 3
    assert sum(r["tokens"] for r in rows) == 47
    assert all(set(r["steps_by_kind"]) == {"forward", "chain", "fused", "ngram", "none"} for r in rows)
    assert rows[-1]["history_tokens"] > 0 and rows[-1]["ngram_entries"] > 0 and rows[-1]["rss_bytes"] > 0
    stopped = 0
    for i, (w, g) in enumerate(zip(want, got)):
        wo, go = w.outputs[0], g.outputs[0]
        if greedy[i]:
            assert list(go.token_ids) == list(wo.token_ids), f"request {i} differs"
            assert go.text == wo.text and go.finish_reason == wo.finish_reason
        else:
            assert 0 < len(go.token_ids) <= params[i].max_tokens
        if go.finish_reason == "stop":
            stopped += 1
            assert params[i].stop and go.stop_reason in params[i].stop
            assert not any(s in go.text for s in params[i].stop)
        else:
            # max_tokens, or max_model_len for the longest prompts
            n_prompt = len(prompts[i]["prompt_token_ids"])
            assert go.finish_reason == "length"
            assert len(go.token_ids) == min(params[i].max_tokens, KW["max_model_len"] - n_prompt)
    assert stopped >= 3  # stop strings did stop some requests
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_abort_preemption_and_max_model_len(book_tokens):
    from vllm import SamplingParams

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    max_len = 1536
    # ~2,700 tokens of KV for 8 requests growing to 1,536 tokens each: preemption is certain
    kw = dict(KW, max_model_len=max_len, kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8,
              max_num_batched_tokens=512)
    lengths = [200, 300, 500, 700, 900, 1100, 1300, 1450]
    prompts = [_prompt(book_tokens, 50 + i, n) for i, n in enumerate(lengths)]
    sp = SamplingParams(temperature=0.0, max_tokens=700, ignore_eos=True)
    aborted = {"1", "4", "6"}

    ts = make_llm(str(DEMO_MODEL), SPEC, **kw)
    eng = ts.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    final, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == 60:
            eng.abort_request(sorted(aborted))
    # one more request lets the workers see the last finished/aborted ids
    ts.generate([_prompt(book_tokens, 99, 40)], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    stats = get_engine_stats(ts)
    metrics = spec_metrics(ts)
    shutdown(ts)

    survivors = [str(i) for i in range(len(prompts)) if str(i) not in aborted]
    assert sorted(final) == sorted(survivors), "aborted requests must not finish normally"
    plain = make_llm(str(DEMO_MODEL), **kw)
    want = plain.generate([prompts[int(r)] for r in survivors], sp, use_tqdm=False)
    shutdown(plain)
    for r, w in zip(survivors, want):
        got = list(final[r].outputs[0].token_ids)
        assert got == list(w.outputs[0].token_ids), f"request {r} differs"
        # capped by max_model_len (prompt + output <= 1536) or by max_tokens
        assert len(got) == min(700, max_len - lengths[int(r)])
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    # No stale state once the batch has drained: the plugin's hook on the runner's state
    # update frees a request's proposer state in the same step the runner drops it, also
    # when vLLM flushes the finish in a step that runs no proposer. Only the probe may still
    # be live (its finish is reported to the worker with the next step).
    assert stats["num_stale_states"] == 0
    assert stats["num_live_requests"] <= 1
