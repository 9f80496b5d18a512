"""A TokenSwift server (`vllm-tokenswift serve`, the bundled demo model, greedy) under faults,
shrunk for CI (vllm_tokenswift/bench/serving_faults.py, size "ci"; the full size is the
`faults` block of scripts/bench-serve.sh).

At the server's highest concurrency (max_num_seqs = 10): 10 streaming clients of which a
fifth disconnect mid-stream; a burst of 20 requests sent at the same instant; 4 long
requests whose KV needs exceed the 2,560-token cache, so vLLM preempts and recomputes. A
warm-up pass of the streams and long phases (other prompts, no disconnects) runs first. Throughout, /health answers 200 (polled from a thread) and no request gets a 5xx. Every
request not cancelled completes with exactly max_tokens tokens, token-identical to plain
decoding of the same prompt (vLLM without speculative decoding, same engine arguments
but a KV cache that never preempts; run in this process while the server starts, so the
test pays for one server start-up); vLLM finished exactly the requests not cancelled and
ends with none running or waiting (the disconnects were aborted), and preempted in the
long phase. Afterwards the proposer holds no per-request state
(`vllm_tokenswift:live_requests`, `stale_requests`, `history_tokens` all 0 on /metrics)
and the worker's RSS (`vllm_tokenswift:worker_rss_bytes`) is within 5% of its level after
the warm-up pass (the server runs with glibc's thresholds fixed and oneDNN's primitive
cache off, so that its RSS follows what it holds: vllm_tokenswift/bench/serving_faults.py
says why).
"""

from __future__ import annotations

import time

import pytest
from engine_utils import make_llm, shutdown
from server_utils import vllm_servers

from vllm_tokenswift.bench.serving_faults import (RSS_TOLERANCE, SERVER_ENV, SIZES, kv_bytes_per_token,
                                                  plan_jobs, problems, prompt_streams, run_faults, server_args)
from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL

pytestmark = pytest.mark.engine  # starts a vLLM server and an in-process engine

LOAD = SIZES["ci"]
MODEL = "demo"
INTERVAL_S = 0.5   # VLLM_TOKENSWIFT_METRICS_INTERVAL_S of the server


def _plain_reference(jobs) -> dict[str, list[int]]:
    """Plain decoding's greedy output of every job, in one offline vLLM engine. Outside
    ./scripts/test.sh's pinned workers, its OpenMP thread is bound to the last core: it runs
    while the server starts, and two engines spinning OpenMP threads on the same cores slow
    each other down several times."""
    import os

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and hasattr(os, "sched_getaffinity"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(max(os.sched_getaffinity(0)))
    llm = make_llm(str(DEMO_MODEL), max_model_len=LOAD.max_model_len, block_size=LOAD.block_size,
                   max_num_seqs=LOAD.max_num_seqs,
                   kv_cache_memory_bytes=4 * LOAD.kv_cache_tokens * kv_bytes_per_token(str(DEMO_MODEL)))
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=j.prompt) for j in jobs],
                            [SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True) for j in jobs],
                            use_tqdm=False)
    finally:
        shutdown(llm)
    return {j.name: list(o.outputs[0].token_ids) for j, o in zip(jobs, outs)}


def test_tokenswift_server_under_faults(tmp_path):
    jobs = plan_jobs(LOAD, prompt_streams(str(DEMO_MODEL)))
    kept = [j for j in jobs if j.disconnect_after is None]
    loaded = [j for j in kept if not j.warmup]
    cut = [j.name for j in jobs if j.disconnect_after is not None]
    assert len(cut) == LOAD.disconnects == 2
    # the long phase alone needs more KV than the cache holds: preemption is certain
    assert LOAD.long_phase_tokens() > LOAD.kv_cache_tokens
    reference: dict[str, list[int]] = {}
    lines: list[str] = []
    t0 = time.perf_counter()

    def plain_reference():
        reference.update(_plain_reference(loaded))
        lines.append(f"plain reference done at {time.perf_counter() - t0:.0f} s")

    args = server_args(LOAD, str(DEMO_MODEL), MODEL, heads=str(DEMO_HEADS))
    with vllm_servers([(str(DEMO_MODEL), args, tmp_path / "ts.log",
                        {"VLLM_TOKENSWIFT_METRICS_INTERVAL_S": str(INTERVAL_S), **SERVER_ENV})],
                      before_wait=plain_reference) as (ts,):
        lines.append(f"server up at {time.perf_counter() - t0:.0f} s")
        report = run_faults(ts, MODEL, LOAD, jobs, interval_s=INTERVAL_S, log=lines.append)
        lines.append(f"load done at {time.perf_counter() - t0:.0f} s")
    lines.append(f"server stopped at {time.perf_counter() - t0:.0f} s")
    print("\n".join(lines))
    res = {r["name"]: r for r in report["results"]}

    # /health answered 200 to every poll, from the warm-up to the end of the load
    h = report["health"]
    assert h["polls"] >= 10 and h["statuses"] == {"200": h["polls"]}, h
    # no 5xx, no error of any kind
    assert [(n, r["status"], r["error"]) for n, r in res.items() if r["status"] != 200 or
            (r["error"] and not r["cancelled"])] == []
    # exactly the disconnecting clients cancelled, each after some of its tokens
    assert sorted(n for n, r in res.items() if r["cancelled"]) == sorted(cut)
    for n in cut:
        assert LOAD.disconnect_after_tokens <= len(res[n]["token_ids"]) < LOAD.stream_tokens
    # every other request completed: max_tokens tokens, "length", and (past the warm-up)
    # token-identical to plain decoding
    for j in kept:
        r = res[j.name]
        assert (r["finish_reason"], len(r["token_ids"]), r["completion_tokens"]) == \
            ("length", j.max_tokens, j.max_tokens), j.name
    for j in loaded:
        assert res[j.name]["token_ids"] == reference[j.name], f"{j.name}: differs from plain decoding"
    # vLLM's own counts over the loaded phases: every kept request finished by length and
    # nothing else finished (vLLM counts no client abort), yet the engine ends empty: the
    # disconnected requests were aborted, not run to the end; the long phase preempted
    md = report["metrics_delta"]
    assert len(loaded) == LOAD.max_num_seqs - 2 + 2 * LOAD.max_num_seqs + LOAD.long_requests == 32
    assert md["finished"] == {"stop": 0, "length": len(loaded), "abort": 0, "error": 0, "repetition": 0}
    assert (md["running_after"], md["waiting_after"]) == (0, 0)
    assert md["num_preemptions_long_phase"] > 0
    assert md["spec_decode_num_drafts"] > 0 and md["spec_decode_num_accepted_tokens"] > 0
    # afterwards the proposer holds no per-request state, and the worker's memory is back
    after, before = report["gauges_after"], report["gauges_before"]
    assert (after["live_requests"], after["stale_requests"], after["history_tokens"]) == (0, 0, 0), after
    assert before["live_requests"] == 0 and before["worker_rss_bytes"] > 0
    rss_change = (after["worker_rss_bytes"] - before["worker_rss_bytes"]) / before["worker_rss_bytes"]
    assert abs(rss_change) <= RSS_TOLERANCE, f"worker RSS changed {rss_change:+.1%}"
    # the script's pass/fail check agrees
    assert problems(report, jobs, reference) == []
