"""`vllm-tokenswift serve` (vLLM's `serve` with the plugin) end to end with the bundled
demo model, driven by the `openai` client.

Two servers run side by side on 127.0.0.1 (random free ports, started together): plain decoding and
TokenSwift (through the plugin's `--speculative-model tokenswift` alias). Greedy
completions and chat completions, streamed and not, with long `max_tokens`, with the
windowed repetition penalty in `vllm_xargs`, and sent concurrently, must be identical on
both. /metrics must show vLLM's spec-decode acceptance counters and TokenSwift's own
`vllm_tokenswift:*` counters for the TokenSwift server (and none of them for the plain
one), and a bad request must be an HTTP 400 that leaves the engine serving. vLLM's own
serving benchmark client (`vllm-tokenswift bench-serve`, i.e. `vllm bench serve`) runs
against the TokenSwift server and saves a result whose counts are exact.
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from server_utils import cli_command, metric_samples, metric_total, vllm_servers

from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR

pytestmark = pytest.mark.engine  # starts vLLM servers (not in ./scripts/test.sh --fast)

MODEL = "demo"
COMMON = ["--served-model-name", MODEL, "--dtype", "float32",
          "--max-model-len", "4096", "--block-size", "32", "--enforce-eager",
          "--kv-cache-memory-bytes", str(512 * 2**20), "--seed", "0"]
TOKENSWIFT = ["--speculative-model", "tokenswift", "--tokenswift-heads", str(DEMO_HEADS),
              "--tokenswift-config", '{"kv_budget": 512, "num_speculative_tokens": 4}']


def _prompts() -> list[str]:
    texts = [p.read_text() for p in sorted(PROMPTS_DIR.glob("*-short.txt"))]
    assert len(texts) >= 4, "bundled short prompts missing"
    return texts


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    with vllm_servers([(str(DEMO_MODEL), COMMON, d / "ar.log", None),
                       (str(DEMO_MODEL), COMMON + TOKENSWIFT, d / "ts.log",
                        {"VLLM_TOKENSWIFT_METRICS_INTERVAL_S": "0.5"})]) as (ar, ts):
        yield {"ar": ar, "ts": ts, "ar_log": d / "ar.log", "ts_log": d / "ts.log"}


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)


def _complete(base, prompt, max_tokens, stream=False, **extra):
    c = _client(base)
    body = {"ignore_eos": True, **extra}
    if not stream:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                 extra_body=body)
        assert r.usage.completion_tokens == max_tokens
        return r.choices[0].text
    parts = []
    chunks = 0
    for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                   extra_body=body, stream=True):
        chunks += 1
        if ch.choices:
            parts.append(ch.choices[0].text)
    assert chunks > 1
    return "".join(parts)


def _chat(base, content, max_tokens, stream=False):
    c = _client(base)
    msgs = [{"role": "user", "content": content}]
    if not stream:
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens
        return r.choices[0].message.content
    parts = []
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0.0,
                                        extra_body={"ignore_eos": True}, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
    return "".join(parts)


#: the long completion's length: longer than the server's 512-token draft KV budget
LONG_TOKENS = 1000


def test_long_greedy_completion_equal_and_counted(servers):
    prompt = _prompts()[0]
    drafts0 = metric_total(servers["ts"], "vllm:spec_decode_num_drafts_total")
    want = _complete(servers["ar"], prompt, LONG_TOKENS)
    got = _complete(servers["ts"], prompt, LONG_TOKENS)
    assert got == want
    # the acceptance figures are on /metrics, and only on the speculative server
    drafts = metric_total(servers["ts"], "vllm:spec_decode_num_drafts_total") - drafts0
    draft_toks = metric_total(servers["ts"], "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_total(servers["ts"], "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = metric_total(servers["ts"], "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and 0 < accepted <= draft_toks
    assert per_pos == accepted
    # fewer steps than tokens: LONG_TOKENS tokens took at most LONG_TOKENS - accepted forward passes
    assert drafts < LONG_TOKENS
    assert metric_total(servers["ar"], "vllm:spec_decode_num_drafts_total") == 0


def test_streaming_completion_equal(servers):
    prompt = _prompts()[1]
    want = _complete(servers["ar"], prompt, 400)
    assert _complete(servers["ts"], prompt, 400, stream=True) == want
    assert _complete(servers["ar"], prompt, 400, stream=True) == want


def test_chat_completions_equal(servers):
    content = _prompts()[2][:600]
    want = _chat(servers["ar"], content, 400)
    assert _chat(servers["ts"], content, 400) == want
    assert _chat(servers["ts"], content, 400, stream=True) == want


def test_windowed_penalty_in_vllm_xargs_equal(servers):
    prompt = _prompts()[3]
    extra = {"repetition_penalty": 1.2, "vllm_xargs": {"repetition_penalty_window": 64}}
    want = _complete(servers["ar"], prompt, 500, **extra)
    got = _complete(servers["ts"], prompt, 500, **extra)
    assert got == want
    # the window changes the output (it is applied, not ignored)
    assert _complete(servers["ar"], prompt, 500) != want


def test_concurrent_requests_equal(servers):
    prompts = _prompts()
    jobs = [(prompts[i % len(prompts)][: 400 + 150 * i], 120 + 60 * i) for i in range(8)]

    def run(base):
        with ThreadPoolExecutor(len(jobs)) as ex:
            return list(ex.map(lambda j: _complete(base, j[0], j[1]), jobs))

    want = run(servers["ar"])
    assert run(servers["ts"]) == want
    assert len(set(want)) == len(jobs)


def test_bad_request_is_400_and_engine_keeps_serving(servers):
    from openai import BadRequestError

    c = _client(servers["ts"])
    with pytest.raises(BadRequestError, match="repetition_penalty_window"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                             extra_body={"vllm_xargs": {"repetition_penalty_window": -1}})
    r = requests.post(servers["ts"] + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4,
                            "vllm_xargs": {"repetition_penalty_window": "ten"}})
    assert r.status_code == 400, r.text
    assert requests.get(servers["ts"] + "/health", timeout=10).status_code == 200
    # min_p is honoured by TokenSwift engines (stock vLLM refuses it with speculation)
    r2 = c.completions.create(model=MODEL, prompt="The house", max_tokens=16, temperature=1.0,
                              extra_body={"min_p": 0.1, "ignore_eos": True})
    assert r2.usage.completion_tokens == 16


def _wait_for(fn, timeout_s=30.0):
    deadline = time.time() + timeout_s
    while True:
        v = fn()
        if v or time.time() > deadline:
            return v
        time.sleep(0.5)


def test_tokenswift_counters_on_metrics(servers):
    prompt = _prompts()[0]
    before = metric_total(servers["ts"], "vllm_tokenswift:accepted_tokens_total")
    _complete(servers["ts"], prompt, 400)
    # the exporter refreshes every 0.5 s here (VLLM_TOKENSWIFT_METRICS_INTERVAL_S)
    assert _wait_for(lambda: metric_total(servers["ts"], "vllm_tokenswift:accepted_tokens_total") > before)
    text = requests.get(servers["ts"] + "/metrics", timeout=10).text
    for fam in ("accepted_tokens", "draft_tokens", "draft_steps", "view_selections", "draft_seconds",
                "draft_forwards"):
        assert f"# TYPE vllm_tokenswift:{fam}_total counter" in text, fam
    acc = metric_samples(servers["ts"], "vllm_tokenswift:accepted_tokens_total")
    assert set(acc) == {f'{{engine="0",model_name="{MODEL}",source="{s}"}}' for s in ("chain", "fused", "heads", "ngram")}
    steps = metric_samples(servers["ts"], "vllm_tokenswift:draft_steps_total")
    assert set(steps) == {f'{{engine="0",kind="{k}",model_name="{MODEL}"}}'
                          for k in ("forward", "chain", "fused", "ngram", "none")}
    assert sum(steps.values()) > 0
    assert metric_total(servers["ts"], "vllm_tokenswift:draft_seconds_total") > 0
    # TokenSwift's accepted tokens are a subset of vLLM's count (a request's last
    # verification is not seen by the proposer when the request ends)
    vllm_acc = metric_total(servers["ts"], "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < sum(acc.values()) <= vllm_acc
    # plain decoding exports none of them
    assert "vllm_tokenswift:" not in requests.get(servers["ar"] + "/metrics", timeout=10).text


def test_no_misleading_min_p_warning(servers):
    # vLLM warns that min_p does not work with speculative decoding; on a TokenSwift
    # engine it does, so the plugin drops that warning (issue 12)
    log = servers["ts_log"].read_text()
    assert "EngineCore" in log  # the engine core's output is in this log (where vLLM warns)
    assert "min_p and logit_bias parameters won't work" not in log


def test_bench_serve_client_against_the_tokenswift_server(servers, tmp_path):
    """`vllm-tokenswift bench-serve` is vLLM's `vllm bench serve`, flags passed through:
    a custom JSONL dataset, concurrency, greedy sampling with the windowed penalty in
    --extra-body, --save-result. Exact counts in the saved JSON, and the texts it
    received are the plain server's."""
    n, out_len = 5, 40
    prompts = [p[:700] for p in (_prompts() * 2)[:n]]
    prompts[-1] = prompts[-1][:300]   # distinct prompts, even where the texts repeat
    ds = tmp_path / "prompts.jsonl"
    ds.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    extra = {"vllm_xargs": {"repetition_penalty_window": 64}}
    cmd = [*cli_command("bench-serve"), "--base-url", servers["ts"], "--model", str(DEMO_MODEL),
           "--served-model-name", MODEL, "--dataset-name", "custom", "--dataset-path", str(ds),
           "--num-prompts", str(n), "--custom-output-len", str(out_len), "--skip-chat-template",
           "--disable-shuffle", "--max-concurrency", "2", "--temperature", "0", "--ignore-eos",
           "--repetition-penalty", "1.2", "--extra-body", json.dumps(extra),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--goodput", "tpot:100000", "--save-result", "--save-detailed", "--disable-tqdm",
           "--result-dir", str(tmp_path), "--result-filename", "ts.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Serving Benchmark Result" in r.stdout   # vLLM's own table
    res = json.loads((tmp_path / "ts.json").read_text())
    assert (res["completed"], res["failed"], res["num_prompts"]) == (n, 0, n)
    assert res["output_lens"] == [out_len] * n and res["total_output_tokens"] == n * out_len
    assert res["max_concurrency"] == 2 and res["request_goodput"] > 0
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                "p99_itl_ms", "output_throughput", "request_throughput"):
        assert res[key] > 0, key
    # the server speculated while the client measured (vLLM reads /metrics before and after)
    assert res["spec_decode_num_drafts"] > 0 and res["spec_decode_accepted_tokens"] > 0
    # greedy, penalty window passed through --extra-body: the plain server's text
    want = [_complete(servers["ar"], p, out_len, repetition_penalty=1.2, **extra) for p in prompts]
    assert res["generated_texts"] == want
