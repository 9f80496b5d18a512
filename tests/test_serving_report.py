"""The serving benchmark's engine-free parts (scripts/bench-serve.sh): the report module on
synthetic `vllm bench serve --save-result` JSONs (tables, × plain, PNGs), the method and
sampling flags, the prompt windows, the poisson block's rate and TPOT target, and the
fault run's plan and pass/fail check (the run itself: test_serve_faults.py)."""

from __future__ import annotations

import json

import pytest

from vllm_tokenswift.bench import serving, serving_faults, serving_report
from vllm_tokenswift.cli.locations import SMOLLM2_HEADS


def _result(method, sampling, conc, out_tps, tpot, *, rate="inf", spec=False, p90=False, goodput=None):
    """The keys vLLM 0.32's `vllm bench serve --save-result` writes (benchmarks/serve.py),
    with the script's --metadata."""
    r = {"date": "20261205-120000", "backend": "openai", "label": method, "model_id": "m",
         "num_prompts": 4 * conc, "request_rate": rate, "burstiness": 1.0, "max_concurrency": conc,
         "method": method, "sampling": sampling, "block": "smollm2",
         "duration": 10.0, "completed": 4 * conc, "failed": 0, "total_input_tokens": 4096 * conc,
         "total_output_tokens": 2048 * conc, "request_throughput": out_tps / 512,
         "request_goodput": goodput, "output_throughput": out_tps, "total_token_throughput": 3 * out_tps,
         "max_output_tokens_per_s": out_tps * 1.5, "max_concurrent_requests": conc}
    for m, v in (("ttft", 200.0 * conc), ("tpot", tpot), ("itl", tpot * 0.9)):
        r.update({f"mean_{m}_ms": v, f"median_{m}_ms": v, f"std_{m}_ms": 1.0, f"p99_{m}_ms": 2 * v})
        if p90:
            r[f"p90_{m}_ms"] = 1.5 * v
    if spec:
        r.update(spec_decode_acceptance_rate=42.0, spec_decode_acceptance_length=3.5,
                 spec_decode_num_drafts=321, spec_decode_draft_tokens=2568, spec_decode_accepted_tokens=803,
                 spec_decode_per_position_acceptance_rates=[0.8, 0.6])
    return r


@pytest.fixture
def block(tmp_path):
    runs = [_result("plain", "greedy", 1, 30.0, 33.0), _result("plain", "greedy", 4, 80.0, 50.0),
            _result("tokenswift", "greedy", 1, 120.0, 8.0, spec=True),
            _result("tokenswift", "greedy", 4, 200.0, 20.0, spec=True),
            _result("plain", "paper", 1, 29.0, 34.0),
            _result("tokenswift", "paper", 2, 31.0, 32.0, rate="0.05", p90=True, goodput=0.04, spec=True)]
    for r in runs:
        (tmp_path / f"{r['method']}-{r['sampling']}-c{r['max_concurrency']}-{r['request_rate']}.json").write_text(
            json.dumps(r))
    (tmp_path / "faults-report.json").write_text(json.dumps({"results": []}))   # not a vLLM result
    return tmp_path


def test_report_tables_and_plots(block):
    md, pngs = serving_report.report(str(block))
    rows = serving_report.rows(serving.load_results(str(block)))
    assert len(rows) == 6
    ts4 = next(x for x in rows if x["method"] == "tokenswift" and x["concurrency"] == 4)
    assert ts4["speedup"] == pytest.approx(2.5) and ts4["tpot_p50"] == 20.0 and ts4["itl_p99"] == 36.0
    assert ts4["acceptance_rate"] == 42.0 and ts4["drafts"] == 321
    # open-loop run: no plain run at its rate, so no × plain
    open_row = next(x for x in rows if x["rate"] is not None)
    assert open_row["rate"] == 0.05 and open_row["speedup"] is None and open_row["tpot_p90"] == 48.0
    assert "**greedy**, closed loop" in md and "**paper**, open loop (Poisson arrivals)" in md
    assert "| tokenswift | 4 | 16 | 0 | 200.0 | 2.50x | 0.391 | 800.0 | 1600.0 | 20.0 | 40.0 | 18.0 | 36.0 | " \
           "42.0 | 3.50 | 321 |" in md
    # the open-loop table asked for p90 and goodput, so it has the columns
    assert "TPOT p90 (ms)" in md and "goodput (req/s)" in md and "| tokenswift | 0.050 | 8 | 0 |" in md
    # plain greedy rows come before tokenswift, by concurrency
    greedy = md.split("**paper**")[0]
    assert greedy.index("| plain | 1 |") < greedy.index("| plain | 4 |") < greedy.index("| tokenswift | 1 |")
    assert (block / "report.md").read_text().endswith(md)
    # PNGs only where a sampling has closed-loop runs at two concurrencies (greedy)
    assert sorted(p.rsplit("/", 1)[1] for p in pngs) == ["throughput-greedy.png", "tpot-greedy.png"]
    for p in pngs:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_of_an_empty_folder_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no vllm bench serve result"):
        serving_report.report(str(tmp_path))
    assert serving_report.main([str(tmp_path)]) == 2


def test_paired_rounds_are_merged_into_medians_with_the_rounds_ratio(tmp_path):
    # round 1: plain 30, TokenSwift 60 (2.0x); round 2: plain 40, TokenSwift 100 (2.5x).
    # Paired: the median of the rounds' ratios is 2.25x, not the ratio of the medians (80/35).
    runs = []
    for rnd, (p, t) in enumerate(((30.0, 60.0), (40.0, 100.0)), start=1):
        for method, tps, tpot in (("plain", p, 30.0 + rnd), ("tokenswift", t, 10.0 * rnd)):
            r = _result(method, "paper", 2, tps, tpot, spec=method == "tokenswift")
            r["round"] = str(rnd)      # --metadata values are strings
            runs.append(r)
    for r in runs:
        (tmp_path / f"{r['method']}-paper-c2-r{r['round']}.json").write_text(json.dumps(r))
    per_run = serving_report.rows(serving.load_results(str(tmp_path)))
    assert sorted((x["method"], x["round"], x["speedup"]) for x in per_run) == [
        ("plain", 1, 1.0), ("plain", 2, 1.0), ("tokenswift", 1, 2.0), ("tokenswift", 2, 2.5)]
    merged = serving_report.merge_rounds(per_run)
    assert len(merged) == 2
    ts = next(x for x in merged if x["method"] == "tokenswift")
    assert ts["rounds"] == 2 and ts["speedup"] == pytest.approx(2.25)
    assert ts["speedup_range"] == (2.0, 2.5)
    assert ts["output_tps"] == 80.0 and ts["tpot_p50"] == 15.0 and ts["completed"] == 16
    md, _ = serving_report.report(str(tmp_path), draw=False)
    assert "| method | concurrency | rounds | completed | failed | output tok/s | × plain (rounds) |" in md
    assert "| tokenswift | 2 | 2 | 16 | 0 | 80.0 | 2.25x (2.00-2.50) |" in md
    assert "| plain | 2 | 2 | 16 | 0 | 35.0 | 1.00x (1.00-1.00) |" in md
    # a run without round metadata is round 1; a lone round merges to itself
    single = serving_report.merge_rounds(serving_report.rows([_result("plain", "greedy", 1, 30.0, 33.0)]))
    assert single[0]["rounds"] == 1 and single[0]["speedup_range"] is None and single[0]["output_tps"] == 30.0


def test_rate_and_tpot_target_from_the_smollm2_block(block):
    results = serving.load_results(str(block))
    assert serving.capacity(results, "plain", "greedy") == pytest.approx(80.0 / 512)
    assert serving.tpot_target_ms(results, "plain", "greedy", factor=2.0) == 66.0   # c=1: 33 ms
    with pytest.raises(ValueError, match="no closed-loop result of ngram-vk"):
        serving.capacity(results, "ngram-vk", "greedy")


def test_method_flags_follow_the_bench_methods():
    assert serving.server_args("plain") == []
    assert serving.server_args("ar-vk") == ["--additional-config", '{"tokenswift_verify_attention": true}']
    ts = serving.server_args("tokenswift", str(SMOLLM2_HEADS))
    assert ts[0] == "--speculative-config" and json.loads(ts[1]) == {
        "method": "tokenswift", "model": str(SMOLLM2_HEADS), "num_speculative_tokens": 8,
        "tokenswift": {"kv_budget": 1024}}
    ng = serving.server_args("ngram-vk")
    assert json.loads(ng[1])["method"] == "ngram" and ng[2:] == serving.server_args("ar-vk")
    # the kernel alone without asynchronous scheduling, as vLLM runs speculative servers
    assert serving.server_args("ar-vk-sync") == serving.server_args("ar-vk") + ["--no-async-scheduling"]
    with pytest.raises(ValueError, match="heads folder not found"):
        serving.server_args("tokenswift", "/no/such/heads")
    with pytest.raises(ValueError, match="unknown serving method"):
        serving.server_args("eagle")


def test_sampling_flags_and_the_penalty_window():
    assert serving.client_args("plain", "greedy") == (["--temperature", "0.0"], None)
    flags, note = serving.client_args("tokenswift", "paper")
    assert note is None and flags == ["--temperature", "1.0", "--min-p", "0.1", "--repetition-penalty", "1.2",
                                      "--extra-body", '{"vllm_xargs": {"repetition_penalty_window": 1024}}']
    flags, note = serving.client_args("ngram-vk", "paper")
    assert "--min-p" not in flags and "min_p=0.1 dropped" in note


def test_prompt_windows_alternate_between_books():
    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    texts = serving.prompt_texts(Tok(), [list(range(100)), list(range(1000, 1100))], 4, 10)
    assert texts == ["0 1 2 3 4 5 6 7 8 9", " ".join(map(str, range(1000, 1010))),
                     " ".join(map(str, range(10, 20))), " ".join(map(str, range(1010, 1020)))]
    with pytest.raises(ValueError, match="too short"):
        serving.prompt_texts(Tok(), [list(range(15))], 2, 10)
    # the held-out books are the last two of the corpus, which no bundled model trained on
    assert serving.HELDOUT_BOOKS == ("19942", "28054")


def test_fault_plan_and_its_check_can_fail():
    load = serving_faults.SIZES["ci"]
    streams = [list(range(3000)), list(range(5000, 9000))]
    jobs = serving_faults.plan_jobs(load, streams)
    phases = [j.phase for j in jobs if not j.warmup]
    assert phases.count("streams") == load.max_num_seqs and phases.count("burst") == 2 * load.max_num_seqs
    # the warm-up pass: the phases it names, no disconnects
    assert load.warmup_phases == ("streams", "long")
    assert [j.phase for j in jobs if j.warmup] == [p for p in phases if p in load.warmup_phases]
    assert not [j for j in jobs if j.warmup and j.disconnect_after is not None]
    cut = [j for j in jobs if j.disconnect_after is not None]
    assert len(cut) == load.disconnects == 2 and all(j.stream for j in cut)
    assert len({tuple(j.prompt) for j in jobs}) == len(jobs)   # every prompt differs
    assert load.long_phase_tokens() > load.kv_cache_tokens

    # a synthetic report of a run that passed ...
    ref = {j.name: [7] * j.max_tokens for j in jobs if j.disconnect_after is None and not j.warmup}
    results = []
    for j in jobs:
        if j.disconnect_after is not None:
            results.append(dict(name=j.name, phase=j.phase, status=200, token_ids=[7] * 12, finish_reason=None,
                                completion_tokens=None, cancelled=True, error=None, seconds=1.0))
        else:
            results.append(dict(name=j.name, phase=j.phase, status=200, token_ids=[7] * j.max_tokens,
                                finish_reason="length", completion_tokens=j.max_tokens, cancelled=False,
                                error=None, seconds=1.0))
    loaded = len(ref)
    gauges = {"live_requests": 0.0, "stale_requests": 0.0, "history_tokens": 0.0, "worker_rss_bytes": 1e9}
    report = {"results": results, "health": {"polls": 40, "statuses": {"200": 40}, "failures": []},
              "gauges_before": dict(gauges), "gauges_after": dict(gauges, worker_rss_bytes=1.04e9),
              "metrics_delta": {"num_preemptions": 3, "num_preemptions_long_phase": 2, "running_after": 0,
                                "waiting_after": 0,
                                "finished": {"stop": 0, "length": loaded, "abort": 0, "error": 0, "repetition": 0}}}
    assert serving_faults.problems(report, jobs, ref) == []
    # ... and each fault it must catch
    bad = json.loads(json.dumps(report))
    bad["health"]["statuses"] = {"200": 39, "error": 1}
    i = next(k for k, j in enumerate(jobs) if j.name == "stream-2")
    bad["results"][i]["status"] = 503
    bad["results"][i + 1]["token_ids"][5] = 8
    bad["metrics_delta"]["num_preemptions_long_phase"] = 0
    bad["metrics_delta"]["running_after"] = 2
    bad["metrics_delta"]["finished"]["length"] = 0
    bad["gauges_after"].update(live_requests=2.0, worker_rss_bytes=1.06e9)
    found = serving_faults.problems(bad, jobs, ref)
    for text in ("/health not always 200", "stream-2: HTTP 503", "stream-3: output differs from plain decoding from token 5",
                 "no preemption", "2 running", "live_requests = 2.0", "worker RSS", "+6.0%",
                 "finished 0 requests by length"):
        assert any(text in f for f in found), (text, found)


def test_fault_server_flags():
    load = serving_faults.SIZES["ci"]
    from vllm_tokenswift.cli.locations import DEMO_HEADS, DEMO_MODEL

    assert serving_faults.kv_bytes_per_token(str(DEMO_MODEL)) == 6 * 2 * 2 * 64 * 4
    args = serving_faults.server_args(load, str(DEMO_MODEL), "demo", str(DEMO_HEADS))
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(2560 * 6144)
    assert args[args.index("--max-num-seqs") + 1] == "10" and "--speculative-model" in args
    assert "--speculative-model" not in serving_faults.server_args(load, str(DEMO_MODEL), "demo")
