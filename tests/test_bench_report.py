"""Benchmark report (vllm_tokenswift.bench.report) on synthetic records, plus the pure
helpers of the harness and the bench CLI parser. No engine is started here."""

import argparse
import csv
import json
from types import SimpleNamespace

import pytest

from vllm_tokenswift.cli import engine_helpers
from vllm_tokenswift.bench import harness, report


def _rec(method, tps, gen=1024, b=1, sampling="greedy", rep=0, **kw):
    r = {"method": method, "gen_len": gen, "batch_size": b, "sampling": sampling, "repeat": rep,
         "status": "ok", "tokens_per_s": tps, "latency_per_token_ms": 1000.0 / tps * b,
         "num_tokens": gen * b, "wall_s": gen * b / tps}
    r.update(kw)
    return r


def test_distinct_n_exact():
    toks = [1, 2, 1, 2, 3]
    assert report.distinct_n(toks, 1) == pytest.approx(3 / 5)
    assert report.distinct_n(toks, 2) == pytest.approx(3 / 4)  # (1,2) (2,1) (1,2) (2,3)
    assert report.distinct_n(toks, 3) == pytest.approx(3 / 3)
    assert report.distinct_n(toks, 4) == pytest.approx(2 / 2)
    assert report.distinct_n([7, 7, 7, 7], 1) == pytest.approx(1 / 4)
    assert report.distinct_n([7, 7, 7, 7], 2) == pytest.approx(1 / 3)
    assert report.distinct_n([1, 2], 3) is None


def test_distinct_scores_average_per_output():
    d = report.distinct_scores([[1, 2, 1, 2, 3], [7, 7, 7, 7]])
    assert d["distinct_1"] == pytest.approx((3 / 5 + 1 / 4) / 2)
    assert d["distinct_2"] == pytest.approx((3 / 4 + 1 / 3) / 2)
    assert d["distinct_4"] == pytest.approx((1.0 + 1 / 1) / 2)
    assert report.distinct_scores([[1]])["distinct_2"] is None


def _metric(name, value=None, values=None):
    return SimpleNamespace(name=name, labels={}, value=value, values=values)


def test_counters_delta_and_acceptance_exact():
    before = report.spec_counters_from_metrics([
        _metric("vllm:spec_decode_num_drafts", 10),
        _metric("vllm:spec_decode_num_draft_tokens", 40),
        _metric("vllm:spec_decode_num_accepted_tokens", 12),
        _metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[6, 4, 2, 0]),
        _metric("vllm:num_requests_running", 1),
    ])
    after = report.spec_counters_from_metrics([
        {"name": "vllm:spec_decode_num_drafts", "value": 30},
        {"name": "vllm:spec_decode_num_draft_tokens", "value": 110},
        {"name": "vllm:spec_decode_num_accepted_tokens", "value": 60},
        {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "values": [20, 14, 10, 4]},
    ])
    d = report.counter_delta(before, after)
    assert d == {"num_drafts": 20, "num_draft_tokens": 70, "num_accepted_tokens": 48,
                 "accepted_per_pos": [14, 10, 8, 4]}
    acc = report.acceptance_from_counters(d, num_speculative_tokens=4)
    assert acc["acceptance_rate"] == pytest.approx(48 / (4 * 20))  # Eq. 4 = 0.6
    assert acc["mean_accepted_length"] == pytest.approx(1 + 48 / 20)  # 3.4
    assert acc["draft_token_acceptance"] == pytest.approx(48 / 70)
    assert acc["acceptance_per_pos"] == pytest.approx([0.7, 0.5, 0.4, 0.2])
    none = report.acceptance_from_counters({"num_drafts": 0}, 4)
    assert none["acceptance_rate"] is None and none["mean_accepted_length"] is None


def test_counter_sum_over_engines():
    c = report.spec_counters_from_metrics([_metric("vllm:spec_decode_num_drafts", 3),
                                           _metric("vllm:spec_decode_num_drafts", 4)])
    assert c["num_drafts"] == 7


def test_throughput():
    t = report.throughput(num_tokens=2000, wall_s=4.0, batch_size=2)
    assert t["tokens_per_s"] == pytest.approx(500.0)
    assert t["latency_per_token_ms"] == pytest.approx(4.0)  # 1000 tokens per sequence in 4 s


def test_speedup_is_method_over_ar():
    recs = [_rec("ar", 100.0, rep=0), _rec("ar", 120.0, rep=1), _rec("ar", 80.0, rep=2),
            _rec("tokenswift", 300.0), _rec("ngram", 150.0),
            _rec("ngram", 50.0, sampling="paper"),  # no AR for paper: None
            {**_rec("suffix", 1.0), "status": "unavailable", "tokens_per_s": None}]
    report.compute_speedups(recs)
    assert recs[3]["speedup_vs_ar"] == pytest.approx(3.0)  # 300 / median(100, 120, 80)
    assert recs[4]["speedup_vs_ar"] == pytest.approx(1.5)
    assert recs[0]["speedup_vs_ar"] == pytest.approx(1.0)
    assert recs[5]["speedup_vs_ar"] is None
    assert recs[6]["speedup_vs_ar"] is None
    # Eq. 5: AR latency / method latency gives the same number
    assert recs[3]["speedup_vs_ar"] == pytest.approx(
        10.0 / recs[3]["latency_per_token_ms"])


def _records():
    recs = [
        _rec("ar", 100.0, rep=0, distinct_1=0.5), _rec("ar", 110.0, rep=1, distinct_1=0.5),
        _rec("tokenswift", 250.0, rep=0, acceptance_rate=0.5, mean_accepted_length=3.0,
             ngram_acceptance=0.2, draft_time_share=0.3, time_draft_s=1.0, time_verify_s=2.0,
             identical_to_ar=True),
        _rec("tokenswift", 350.0, rep=1, acceptance_rate=0.7, mean_accepted_length=3.8,
             ngram_acceptance=0.3, draft_time_share=0.3, time_draft_s=1.2, time_verify_s=2.1,
             identical_to_ar=True),
        _rec("ar", 90.0, gen=2048), _rec("tokenswift", 300.0, gen=2048, acceptance_rate=0.8,
                                          time_draft_s=2.0, time_verify_s=3.0),
        _rec("ngram", 120.0, acceptance_rate=0.1, sampling="greedy"),
        {**_rec("suffix", 1.0), "status": "unavailable", "tokens_per_s": None,
         "latency_per_token_ms": None, "note": "unavailable: arctic-inference missing"},
    ]
    return report.compute_speedups(recs)


def test_summary_median_and_min():
    rows = report.summarize(_records())
    by = {(r["method"], r["gen_len"]): r for r in rows}
    ts = by[("tokenswift", 1024)]
    assert ts["repeats"] == 2
    assert ts["tokens_per_s_median"] == pytest.approx(300.0)
    assert ts["tokens_per_s_min"] == pytest.approx(250.0)
    assert ts["latency_ms_min"] == pytest.approx(1000.0 / 350.0)
    assert ts["speedup_median"] == pytest.approx(300.0 / 105.0)
    assert ts["acceptance_rate"] == pytest.approx(0.6)
    assert ts["identical_to_ar"] is True
    assert by[("suffix", 1024)]["status"] == "unavailable"
    assert by[("suffix", 1024)]["repeats"] == 0


def test_markdown_rows():
    rows = report.summarize(_records())
    md = report.markdown_table(rows)
    lines = md.splitlines()
    assert lines[0].startswith("| method | sampling | batch | gen_len |")
    assert len(lines) == 2 + len(rows) == 2 + 6
    ts_line = next(line for line in lines if line.startswith("| tokenswift | greedy | 1 | 1024 |"))
    cells = [c.strip() for c in ts_line.strip("|").split("|")]
    col = dict(zip(report.SUMMARY_COLUMNS, cells))
    assert col["repeats"] == "2"
    assert col["tok/s med"] == "300.0"
    assert col["tok/s min"] == "250.0"
    assert col["speedup med"] == "2.86"
    assert col["alpha"] == "0.600"
    assert col["identical to AR"] == "yes"
    suffix_line = next(line for line in lines if line.startswith("| suffix |"))
    assert "unavailable: arctic-inference missing" in suffix_line
    assert "unavailable: unavailable" not in suffix_line


def test_write_report_files(tmp_path):
    recs = _records()
    paths = report.write_report(recs, str(tmp_path), meta={"model": "toy"}, plots=False)
    assert paths["plots"] == []
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == report.RECORD_FIELDS
    for col in ("method", "gen_len", "batch_size", "sampling", "repeat", "tokens_per_s",
                "latency_per_token_ms", "speedup_vs_ar", "acceptance_rate",
                "mean_accepted_length", "ngram_acceptance", "draft_time_share",
                "identical_to_ar", "distinct_1", "distinct_2", "distinct_3", "distinct_4",
                "num_tokens", "wall_s"):
        assert col in rows[0]
    assert len(rows) == len(recs)
    assert rows[2]["method"] == "tokenswift" and float(rows[2]["speedup_vs_ar"]) == pytest.approx(250 / 105)
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data) == len(recs) and data[0]["method"] == "ar"
    md = (tmp_path / "summary.md").read_text()
    assert "| tokenswift | greedy | 1 | 1024 | 2 |" in md and "**model**: toy" in md


def test_png_plots_written(tmp_path):
    import matplotlib  # noqa: F401  (a core dependency: the PNGs must be written)
    paths = report.write_report(_records(), str(tmp_path))
    assert len(paths["plots"]) == 3
    for p in paths["plots"]:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / p.split("/")[-1]).stat().st_size > 1000


def test_plots_without_speculative_runs(tmp_path):
    import matplotlib  # noqa: F401
    paths = report.write_plots([_rec("ar", 100.0)], str(tmp_path))
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 0 for p in paths)


# --- harness helpers (pure parts) ------------------------------------------------

def _cfg(**kw):
    kw.setdefault("heads", "/h")
    return harness.BenchConfig(**kw)


def test_speculative_configs():
    cfg = _cfg(tokenswift={"kv_budget": 1024})
    assert harness.speculative_config("ar", cfg) is None
    ts = harness.speculative_config("tokenswift", cfg)
    assert ts == {"method": "tokenswift", "model": "/h", "num_speculative_tokens": 8,
                  "tokenswift": {"kv_budget": 1024}}
    assert harness.speculative_config("tokenswift-k0", cfg)["tokenswift"] == {
        "kv_budget": 1024, "ngram_topk": 0}
    assert harness.speculative_config("tokenswift-noheads", cfg)["tokenswift"]["use_heads"] is False
    assert harness.speculative_config("tokenswift-fullkv", cfg)["tokenswift"]["draft_kv"] == "full"
    assert harness.speculative_config("tokenswift-static", cfg)["tokenswift"]["draft_kv"] == "static"
    assert harness.speculative_config("tokenswift-paper", cfg)["tokenswift"] == {
        "kv_budget": 1024, "policy": "paper"}
    assert harness.speculative_config("tokenswift-nofused", cfg)["tokenswift"] == {
        "kv_budget": 1024, "fused_heads": False}
    assert {"tokenswift-paper", "tokenswift-nofused"} <= set(harness.KNOWN_METHODS)
    assert harness.speculative_config("ngram", cfg) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
    assert harness.speculative_config("suffix", cfg)["method"] == "suffix"
    cfg2 = _cfg(method_configs={"ngram": {"method": "ngram", "num_speculative_tokens": 2},
                                "plain": None})
    assert harness.speculative_config("ngram", cfg2)["num_speculative_tokens"] == 2
    assert harness.speculative_config("plain", cfg2) is None
    with pytest.raises(ValueError):
        harness.speculative_config("bogus", cfg)


def test_sampling_kwargs_min_p_handling():
    ng = {"method": "ngram", "num_speculative_tokens": 4}
    ts = {"method": "tokenswift", "num_speculative_tokens": 4}
    kw, note = harness.sampling_kwargs("ar", "paper", None)
    assert kw["min_p"] == 0.1 and kw["repetition_penalty"] == 1.2 and note is None
    assert kw["extra_args"] == {"repetition_penalty_window": 1024}
    kw, note = harness.sampling_kwargs("ngram", "paper", ng)
    assert "min_p" not in kw and "min_p" in note and kw["repetition_penalty"] == 1.2
    kw, note = harness.sampling_kwargs("tokenswift", "paper", ts)
    assert kw["min_p"] == 0.1 and note is None
    kw, note = harness.sampling_kwargs("tokenswift-nopenalty", "paper", ts)
    assert "repetition_penalty" not in kw and "extra_args" not in kw and "penalty" in note
    kw, note = harness.sampling_kwargs("ngram", "greedy", ng)
    assert kw == {"temperature": 0.0} and note is None
    # paper-no-min-p: every method, AR included, gets the same kwargs and no note
    for m, spec in (("ar", None), ("ngram", ng), ("tokenswift", ts)):
        kw, note = harness.sampling_kwargs(m, "paper-no-min-p", spec)
        assert kw == {"temperature": 1.0, "repetition_penalty": 1.2,
                      "extra_args": {"repetition_penalty_window": 1024}} and note is None
    # presets are not mutated
    assert harness.SAMPLING_PRESETS["paper"]["min_p"] == 0.1
    assert "repetition_penalty_window" in harness.SAMPLING_PRESETS["paper"]["extra_args"]


def test_prompts_and_prefix_cap():
    streams = [list(range(10)), list(range(100, 105))]
    p = harness.build_prompts(streams, batch_size=3, prefix_len=4)
    assert p == [[0, 1, 2, 3], [100, 101, 102, 103], [2, 3, 4, 5]]
    # short stream wraps around
    assert harness.build_prompts([[1, 2, 3]], 1, 7) == [[1, 2, 3, 1, 2, 3, 1]]
    assert harness.effective_prefix_len(2048, [256, 512], 4096) == 2048
    assert harness.effective_prefix_len(2048, [4000], 5096) == 5096 - 4000 - 64
    assert harness.effective_prefix_len(2048, [4000], None) == 2048
    with pytest.raises(ValueError):
        harness.effective_prefix_len(2048, [4090], 4096)


def test_book_prompts_one_per_long_enough_book(tmp_path, monkeypatch):
    """Prompts come from the first books with ``skip + prefix_len`` tokens, one per book,
    after ``skip`` tokens; a book longer than the tokenised prefix of its text is still
    found; too few books is a clear error."""
    books = tmp_path / "books.jsonl"
    texts = ["abc", "0123456789" * 3, "x" * 200 + "y" * 10, "klmnopqrstuv"]
    books.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def tok(text, add_special_tokens=False):    # one token per character
        return {"input_ids": [ord(c) for c in text]}

    got = harness.book_prompts(tok, 2, 4, skip=2, path=books)
    assert got == [[ord(c) for c in "2345"], [ord(c) for c in "xxxx"]]
    got = harness.book_prompts(tok, 1, 5, skip=200, path=books)
    assert got == [[ord("y")] * 5]
    # 16 * (skip + prefix_len) characters are tokenised first, the whole text if they
    # give too few tokens (here one token per 30-character word)
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"text": " ".join(f"{i:030d}" for i in range(10))}) + "\n")

    def word_tok(text, add_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}

    assert harness.book_prompts(word_tok, 1, 4, skip=1, path=words) == [[1, 2, 3, 4]]
    monkeypatch.setenv("TOKENSWIFT_BOOKS", str(books))
    assert harness.book_prompts(tok, 3, 4) == [[48, 49, 50, 51], [ord("x")] * 4, [ord(c) for c in "klmn"]]
    with pytest.raises(ValueError, match="only 3 books"):
        harness.book_prompts(tok, 4, 4)


def test_json_token_prompt_files(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([[5, 6, 7], [8]]))
    cfg = _cfg(prompt_files=[str(f)])
    assert harness.load_prompt_tokens(cfg) == [[5, 6, 7, 8]]


def test_identical_to_ar():
    recs = [{"method": m, "gen_len": 4, "batch_size": 2, "sampling": s, "repeat": 0, "status": "ok"}
            for m, s in (("ar", "greedy"), ("ngram", "greedy"), ("ts", "greedy"), ("ngram", "paper"))]
    outs = {("ar", 4, 2, "greedy", 0): [[1, 2, 3, 4], [5, 6, 7, 8]],
            ("ngram", 4, 2, "greedy", 0): [[1, 2, 3, 4], [5, 6, 7, 8]],
            ("ts", 4, 2, "greedy", 0): [[1, 2, 9, 4], [5, 6, 7, 8]],
            ("ngram", 4, 2, "paper", 0): [[1, 2, 3, 4], [5, 6, 7, 8]]}
    harness.fill_identical_to_ar(recs, outs)
    assert [r["identical_to_ar"] for r in recs] == [True, True, False, None]
    assert recs[2]["ar_common_prefix_tokens"] == 2


def test_new_variants_are_valid_plugin_settings():
    """The settings of every TokenSwift variant pass the plugin's own validation."""
    from vllm_tokenswift.core.config import TokenSwiftConfig

    cfg = _cfg(heads=str(harness.TINY_HEADS))
    for m in harness.TOKENSWIFT_VARIANTS:
        spec = harness.speculative_config(m, cfg)
        ts = TokenSwiftConfig.from_speculative_dict(spec)
        assert ts is not None, m


def test_unavailable_reasons(monkeypatch):
    assert harness.method_unavailable("ar", None) is None
    assert "pass --heads" in harness.method_unavailable(
        "tokenswift", {"method": "tokenswift", "model": "", "tokenswift": {}})
    ts = {"method": "tokenswift", "model": "/definitely/missing", "tokenswift": {}}
    assert "not found" in harness.method_unavailable("tokenswift", ts)
    ts_noheads = {"method": "tokenswift", "model": "/definitely/missing",
                  "tokenswift": {"use_heads": False}}
    assert harness.method_unavailable("tokenswift-noheads", ts_noheads) is None
    from vllm_tokenswift.bench import methods

    monkeypatch.setattr(methods.importlib.util, "find_spec", lambda name: None)
    assert "arctic-inference" in harness.method_unavailable("suffix", {"method": "suffix"})


def test_bench_cli_parser():
    from vllm_tokenswift.bench import cli
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["bench", "--model", "tiny", "--methods", "ar,ngram", "--gen-lens", "256,512",
                              "--batch-sizes", "1,2", "--sampling", "greedy", "--repeats", "3",
                              "--out", "/tmp/x", "--method-config",
                              'ngram-x={"method": "ngram", "num_speculative_tokens": 8}',
                              "--engine-arg", "block_size=32"])
    cfg = cli.config_from_args(args)
    assert cfg.methods == ["ar", "ngram"] and cfg.gen_lens == [256, 512]
    assert cfg.batch_sizes == [1, 2] and cfg.samplings == ["greedy"] and cfg.repeats == 3
    assert cfg.method_configs["ngram-x"]["num_speculative_tokens"] == 8
    assert cfg.engine_kwargs == {"block_size": 32}
    assert cfg.model == str(harness.TINY_MODEL) and cfg.heads == str(harness.TINY_HEADS)
    assert cfg.k == 8 and cfg.tokenswift == {"kv_budget": 1024} and cfg.yarn is None
    args = parser.parse_args(["bench", "--model", "tiny", "--heads", "/x", "--kv-budget", "512",
                              "--tokenswift", '{"sink_tokens": 32}', "--k", "4"])
    cfg = cli.config_from_args(args)
    assert cfg.heads == "/x" and cfg.k == 4
    assert cfg.tokenswift == {"kv_budget": 512, "sink_tokens": 32}
    assert callable(args.func)
    bad = parser.parse_args(["bench", "--sampling", "nucleus"])
    assert bad.func(bad) == 2


def test_plugin_stats_delta_without_reset(monkeypatch):
    snaps = iter([
        {"verified_drafts": 10, "accepted_ngram": 4, "time_draft_s": 1.0, "time_total_s": 4.0,
         "num_speculative_tokens": 4, "ngram_acceptance": 0.1, "draft_time_share": 0.25},
        {"verified_drafts": 30, "accepted_ngram": 20, "time_draft_s": 3.0, "time_total_s": 8.0,
         "num_speculative_tokens": 4, "ngram_acceptance": 0.9, "draft_time_share": 0.9},
    ])
    fns = {"reset_engine_stats": lambda llm: False, "get_engine_stats": lambda llm: next(snaps)}
    monkeypatch.setattr(engine_helpers, "_plugin_fn", lambda name: fns.get(name))
    was_reset, before = harness.plugin_stats_before(object())
    assert was_reset is False and before["verified_drafts"] == 10
    res = harness.plugin_stats_after(object(), was_reset, before, k=4)
    assert res["ngram_acceptance"] == pytest.approx(16 / (4 * 20))  # Eq. 6 over this run only
    assert res["draft_time_share"] == pytest.approx(2.0 / 4.0)
    assert res["time_draft_s"] == pytest.approx(2.0)
    assert res["time_verify_s"] == pytest.approx(2.0)


def test_plugin_stats_with_reset_and_absent(monkeypatch):
    stats = {"verified_drafts": 5, "ngram_acceptance": 0.3, "draft_time_share": 0.4,
             "time_draft_s": 0.5, "time_total_s": 1.25}
    fns = {"reset_engine_stats": lambda llm: True, "get_engine_stats": lambda llm: dict(stats)}
    monkeypatch.setattr(engine_helpers, "_plugin_fn", lambda name: fns.get(name))
    was_reset, before = harness.plugin_stats_before(object())
    res = harness.plugin_stats_after(object(), was_reset, before, k=4)
    assert (res["ngram_acceptance"], res["draft_time_share"]) == (0.3, 0.4)
    assert res["time_verify_s"] == pytest.approx(0.75)
    monkeypatch.setattr(engine_helpers, "_plugin_fn", lambda name: None)
    res = harness.plugin_stats_after(object(), False, None, k=4)
    assert res["ngram_acceptance"] is None and res["time_draft_s"] is None


def test_bench_report_merges_runs_keeping_each_runs_baseline(tmp_path):
    import argparse

    from vllm_tokenswift.bench.cli import run_report_cli

    a = [_rec("ar", 100.0, gen=2048), _rec("tokenswift", 150.0, gen=2048)]
    # a second invocation at another length, with a slower machine state: its own AR
    b = [_rec("ar", 50.0, gen=16384, rep=r) for r in (0, 1)] + \
        [_rec("tokenswift", 80.0, gen=16384, rep=0), _rec("tokenswift", 90.0, gen=16384, rep=1)]
    for name, recs in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(recs))
    out = tmp_path / "merged"
    args = argparse.Namespace(results=[str(tmp_path / "a"), str(tmp_path / "b" / "results.json")],
                              out=str(out), title_note=None, no_plots=True)
    assert run_report_cli(args) == 0
    merged = json.loads((out / "results.json").read_text())
    assert len(merged) == 6
    sp = {(r["method"], r["gen_len"], r["repeat"]): r["speedup_vs_ar"] for r in merged}
    assert sp[("tokenswift", 2048, 0)] == pytest.approx(1.5)
    assert sp[("tokenswift", 16384, 0)] == pytest.approx(1.6)
    assert sp[("tokenswift", 16384, 1)] == pytest.approx(1.8)
    assert {r["source"] for r in merged} == {"a", "b"}
    md = (out / "summary.md").read_text()
    assert "| tokenswift | greedy | 1 | 16384 | 2 |" in md
    # overlapping inputs are refused
    args.results = [str(tmp_path / "a"), str(tmp_path / "a")]
    assert run_report_cli(args) == 2


def test_step_breakdown_per_step_ms():
    recs = [_rec("ar", 100.0, gen=1000),  # 10 s wall, 1000 steps -> 10 ms/step
            _rec("tokenswift", 200.0, gen=1000, mean_accepted_length=2.5, time_draft_s=1.0,
                 time_verify_s=3.0)]  # 5 s wall, 400 steps -> 12.5 ms/step
    rows = report.summarize(recs)
    bars = report.step_breakdown(rows)
    assert [b["method"] for b in bars] == ["ar", "tokenswift"]
    assert bars[0]["step_ms"] == pytest.approx(10.0)
    ts = bars[1]
    assert ts["step_ms"] == pytest.approx(12.5)
    assert ts["draft_ms"] == pytest.approx(2.5) and ts["verify_ms"] == pytest.approx(7.5)
    assert ts["other_ms"] == pytest.approx(2.5)


def test_step_breakdown_counts_plain_steps_from_the_decision_mix():
    """With the adaptive policy most steps draft nothing: mean_accepted_length (1 +
    accepted / drafting steps) would undercount the steps; the decision counts give
    them all (two repeats of 300 request-steps at batch 2: 75 steps per request)."""
    recs = [_rec("ar", 100.0, gen=100, b=2),
            *[_rec("tokenswift", 50.0, gen=100, b=2, rep=i, mean_accepted_length=3.0, time_draft_s=0.2,
                   time_verify_s=1.0, steps_by_kind={"forward": 20, "fused": 0, "ngram": 10, "none": 120})
              for i in range(2)]]
    rows = report.summarize(recs)
    ts = next(b for b in report.step_breakdown(rows) if b["method"] == "tokenswift")
    assert ts["tokens_per_step"] == pytest.approx(100 / 75)
    assert ts["step_ms"] == pytest.approx(1000.0 * 4.0 / 75)   # 4 s wall (2 x 100 tokens at 50 tok/s)


def test_default_gen_lens_cpu_and_gpu(monkeypatch):
    from vllm_tokenswift.bench import cli

    assert harness.default_gen_lens(cuda=False) == [2048, 4096, 8192, 16384]
    assert harness.default_gen_lens(cuda=True) == [20480, 40960, 61440, 81920, 102400]
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    import torch
    # the tiny demo model's window (20,480) holds 2,048 + 16,384: the whole CPU ladder
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = cli.config_from_args(parser.parse_args(["bench", "--model", "tiny"]))
    assert cfg.gen_lens == [2048, 4096, 8192, 16384]
    # ... but not the GPU ladder: cut at 20,480 - 2,048
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.config_from_args(parser.parse_args(["bench", "--model", "tiny"])).gen_lens == [18432]
    assert cli.config_from_args(parser.parse_args(["bench", "--model", "tiny", "--yarn", "8"])
                                ).gen_lens == [20480, 40960, 61440, 81920, 102400]


def test_default_gen_lens_from_the_window():
    # SmolLM2: 8,192-token window
    assert harness.default_gen_lens(cuda=False, window=8192, prefix_len=2048) == [2048, 4096, 6144]
    assert harness.default_gen_lens(cuda=False, window=16384, prefix_len=2048) == [2048, 4096, 8192, 14336]
    assert harness.default_gen_lens(cuda=False, window=8192, prefix_len=1024) == [2048, 4096, 7168]
    # the ladder fits whole: nothing added
    assert harness.default_gen_lens(cuda=False, window=32768, prefix_len=2048) == [2048, 4096, 8192, 16384]
    assert harness.default_gen_lens(cuda=True, window=8192, prefix_len=2048) == [6144]
    # the longest length plus the prefix minus the harness' margin fits the window
    assert harness.effective_prefix_len(2048, [2048, 4096, 6144], 8192) == 2048 - 64
    with pytest.raises(ValueError, match="no room"):
        harness.default_gen_lens(cuda=False, window=2048, prefix_len=2040)


def test_bench_yarn_config(tmp_path):
    from vllm_tokenswift.bench import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    cfg = cli.config_from_args(parser.parse_args(["bench", "--model", "tiny", "--yarn", "2",
                                                  "--gen-lens", "512"]))
    assert cfg.yarn == 2.0
    assert harness.model_max_len(cfg.model, cfg.yarn) == 2 * 20480
    assert harness.model_max_len(cfg.model) == 20480
    args = parser.parse_args(["bench", "--model", "tiny", "--yarn", "0.5", "--out", str(tmp_path)])
    assert args.func(args) == 2  # refused before any engine starts


def test_decision_mix_fractions_and_format():
    sk = {"forward": 62, "fused": 20, "ngram": 15, "none": 3}
    fr = report.decision_mix_fractions(sk)
    assert list(fr) == ["forward", "fused", "ngram", "none"]
    assert fr == pytest.approx({"forward": 0.62, "fused": 0.20, "ngram": 0.15, "none": 0.03})
    assert report.format_decision_mix(sk) == "62/20/15/3"
    assert report.format_decision_mix(fr) == "62/20/15/3"  # fractions in, same shares out
    assert report.format_decision_mix({"forward": 0, "fused": 0}) is None
    assert report.decision_mix_fractions(None) is None
    # counters are cumulative: nested dicts are differenced key by key
    d = report.counter_delta({"steps_by_kind": {"forward": 10, "fused": 5}, "drafts": 3},
                             {"steps_by_kind": {"forward": 40, "fused": 5, "ngram": 7}, "drafts": 9})
    assert d == {"steps_by_kind": {"forward": 30, "fused": 0, "ngram": 7}, "drafts": 6}


def test_decision_mix_in_summary_csv_and_breakdown(tmp_path):
    recs = [_rec("ar", 100.0, gen=1000),
            _rec("tokenswift", 200.0, gen=1000, rep=0, mean_accepted_length=2.5, time_draft_s=1.0,
                 time_verify_s=3.0, steps_by_kind={"forward": 30, "fused": 10, "ngram": 0, "none": 0},
                 accepted_by_kind={"forward": 60, "fused": 12, "ngram": 0, "none": 0}),
            _rec("tokenswift", 200.0, gen=1000, rep=1, mean_accepted_length=2.5, time_draft_s=1.0,
                 time_verify_s=3.0, steps_by_kind={"forward": 30, "fused": 10, "ngram": 20, "none": 0},
                 accepted_by_kind={"forward": 58, "fused": 10, "ngram": 30, "none": 0})]
    rows = report.summarize(recs)
    ts = next(r for r in rows if r["method"] == "tokenswift")
    assert ts["steps_by_kind"] == {"forward": 60, "fused": 20, "ngram": 20, "none": 0}  # summed
    assert ts["accepted_by_kind"] == {"forward": 118, "fused": 22, "ngram": 30, "none": 0}
    assert next(r for r in rows if r["method"] == "ar")["steps_by_kind"] is None
    md = report.markdown_table(rows)
    assert "decision mix % fwd/fused/ngram/none[/chain]" in md.splitlines()[0]
    assert "| 60/20/20/0 |" in md
    bars = report.step_breakdown(rows)
    assert bars[0]["decision_mix"] is None
    assert bars[1]["decision_mix"] == pytest.approx({"forward": 0.6, "fused": 0.2, "ngram": 0.2, "none": 0.0})
    paths = report.write_report(recs, str(tmp_path), plots=True)
    with open(paths["csv"]) as f:
        rows_csv = list(csv.DictReader(f))
    assert json.loads(rows_csv[1]["steps_by_kind"]) == {"forward": 30, "fused": 10, "ngram": 0, "none": 0}
    assert rows_csv[0]["steps_by_kind"] == ""


def test_plugin_stats_carry_steps_by_kind(monkeypatch):
    snaps = iter([
        {"verified_drafts": 10, "accepted_ngram": 4, "time_draft_s": 1.0, "time_total_s": 4.0,
         "steps_by_kind": {"forward": 8, "fused": 2, "ngram": 0, "none": 0},
         "accepted_by_kind": {"forward": 12, "fused": 3, "ngram": 0, "none": 0}},
        {"verified_drafts": 30, "accepted_ngram": 20, "time_draft_s": 3.0, "time_total_s": 8.0,
         "steps_by_kind": {"forward": 20, "fused": 6, "ngram": 4, "none": 1},
         "accepted_by_kind": {"forward": 30, "fused": 9, "ngram": 10, "none": 0}},
    ])
    fns = {"reset_engine_stats": lambda llm: False, "get_engine_stats": lambda llm: next(snaps)}
    monkeypatch.setattr(engine_helpers, "_plugin_fn", lambda name: fns.get(name))
    was_reset, before = harness.plugin_stats_before(object())
    res = harness.plugin_stats_after(object(), was_reset, before, k=4)
    assert res["steps_by_kind"] == {"forward": 12, "fused": 4, "ngram": 4, "none": 1}
    assert res["accepted_by_kind"] == {"forward": 18, "fused": 6, "ngram": 10, "none": 0}


def test_engine_output_goes_to_the_log_file(tmp_path, capfd, monkeypatch):
    """Descriptor-level redirection: Python prints, raw writes and child processes (like
    vLLM's engine core) land in the log; the command's own streams reach the terminal."""
    import os
    import subprocess
    import sys

    # as in a real process: sys.stdout/sys.stderr write to descriptors 1 and 2 (pytest
    # swaps in its own objects)
    monkeypatch.setattr(sys, "stdout", open(1, "w", buffering=1, closefd=False))
    monkeypatch.setattr(sys, "stderr", open(2, "w", buffering=1, closefd=False))
    log = tmp_path / "logs" / "vllm.log"
    with harness.engine_output_to(log) as (out, err):
        print("python stdout")
        print("python stderr", file=sys.stderr)
        os.write(1, b"raw fd 1\n")
        os.write(2, b"raw fd 2\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)
        print("our result", file=out)
        print("our progress", file=err)
    text = log.read_text()
    for line in ("python stdout", "python stderr", "raw fd 1", "raw fd 2", "child out", "child err"):
        assert line in text
    assert "our result" not in text and "our progress" not in text
    cap = capfd.readouterr()
    assert cap.out == "our result\n" and cap.err == "our progress\n"
    # restored afterwards
    print("after")
    assert capfd.readouterr().out == "after\n"
    with harness.engine_output_to(None) as (out, err):
        assert (out, err) == (sys.stdout, sys.stderr)


def test_paired_speedup_uses_the_ar_run_of_the_same_round():
    recs = [_rec("ar", 100.0, rep=0, paired_speedup=True), _rec("ar", 50.0, rep=1, paired_speedup=True),
            _rec("tokenswift", 110.0, rep=0, paired_speedup=True),
            _rec("tokenswift", 60.0, rep=1, paired_speedup=True),
            _rec("tokenswift", 80.0, rep=2, paired_speedup=True),     # its AR run is missing: median
            _rec("ngram", 150.0, rep=0)]                               # not paired: median
    report.compute_speedups(recs)
    assert [r["speedup_vs_ar"] for r in recs[:5]] == pytest.approx([1.0, 1.0, 1.1, 1.2, 80.0 / 75.0])
    assert recs[5]["speedup_vs_ar"] == pytest.approx(2.0)
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["tokenswift"]["speedup_median"] == pytest.approx(1.1)   # median of 1.1, 1.2, 1.067


def test_decode_speedup_pairs_the_decode_phase_like_the_speedup():
    # a tie on the whole run, decided by the prefill: TokenSwift's decode is ahead
    recs = [_rec("ar", 100.0, rep=0, paired_speedup=True, decode_tokens_per_s=120.0),
            _rec("ar", 50.0, rep=1, paired_speedup=True, decode_tokens_per_s=60.0),
            _rec("tokenswift", 110.0, rep=0, paired_speedup=True, decode_tokens_per_s=150.0),
            _rec("tokenswift", 55.0, rep=1, paired_speedup=True, decode_tokens_per_s=66.0),
            _rec("suffix", 110.0, rep=0, paired_speedup=True, decode_tokens_per_s=144.0),
            _rec("ngram", 150.0, rep=0),                      # no decode figure: None
            _rec("ngram", 90.0, rep=0, sampling="paper", decode_tokens_per_s=90.0)]   # no AR: None
    report.compute_speedups(recs)
    assert [r["decode_speedup_vs_ar"] for r in recs[:5]] == pytest.approx([1.0, 1.0, 1.25, 1.1, 1.2])
    assert recs[5]["decode_speedup_vs_ar"] is None and recs[5]["speedup_vs_ar"] == pytest.approx(2.0)
    assert recs[6]["decode_speedup_vs_ar"] is None
    rows = {r["method"]: r for r in report.summarize(recs) if r["sampling"] == "greedy"}
    assert rows["tokenswift"]["speedup_median"] == pytest.approx(1.1)
    assert rows["tokenswift"]["decode_speedup_median"] == pytest.approx(1.175)
    assert rows["ngram"]["decode_speedup_median"] is None
    lines = report.markdown_table(list(rows.values())).splitlines()
    col = dict(zip(report.SUMMARY_COLUMNS, [c.strip() for c in lines[3].strip("|").split("|")]))
    assert (col["method"], col["speedup med"], col["decode speedup med"]) == ("tokenswift", "1.10", "1.18")
    col = dict(zip(report.SUMMARY_COLUMNS, [c.strip() for c in lines[5].strip("|").split("|")]))
    assert (col["method"], col["speedup med"], col["decode speedup med"]) == ("ngram", "2.00", "–")


def _fake_engines(monkeypatch, log):
    """Replace the harness' engine functions by fakes that log what runs when."""
    class Fake:
        def __init__(self, name):
            self.name = name

    def build(cfg, spec, mml, engine_args=None):
        name = "ar" if spec is None else spec["method"]
        log.append(("start", name) if not engine_args else ("start", name, engine_args))
        return Fake(name)

    speeds = {"ar": 100.0, "ngram": 150.0}

    def timed(llm, prompts, sp_kw, g, k, plugin_stats=False, collectors=None):
        log.append(("run", llm.name, g, sp_kw.get("temperature")))
        tps = speeds[llm.name] * (1.0 if sum(1 for e in log if e[0] == "run") <= 2 else 0.5)
        return {"tokens_per_s": tps, "num_tokens": g, "wall_s": g / tps}, [[1] * g for _ in prompts]

    monkeypatch.setattr(harness, "build_engine", build)
    monkeypatch.setattr(harness, "warmup", lambda *a, **k: None)
    monkeypatch.setattr(harness, "timed_run", timed)
    monkeypatch.setattr(harness, "teardown_engine", lambda llm: log.append(("stop", llm.name)))


@pytest.mark.parametrize("scope", ["method", "interleave"])
def test_run_bench_order_of_runs_and_engines(monkeypatch, tmp_path, scope):
    log = []
    _fake_engines(monkeypatch, log)
    cfg = harness.BenchConfig(methods=["ar", "ngram"], gen_lens=[16], batch_sizes=[1], samplings=["greedy"],
                              repeats=2, out_dir=str(tmp_path), random_prompts=True, prefix_len=32,
                              engine_scope=scope)
    recs = harness.run_bench(cfg, progress=False)
    if scope == "method":
        assert log == [("start", "ar"), ("run", "ar", 16, 0.0), ("run", "ar", 16, 0.0), ("stop", "ar"),
                       ("start", "ngram"), ("run", "ngram", 16, 0.0), ("run", "ngram", 16, 0.0),
                       ("stop", "ngram")]
    else:   # both engines first, then the runs alternate round by round
        assert log == [("start", "ar"), ("start", "ngram"),
                       ("run", "ar", 16, 0.0), ("run", "ngram", 16, 0.0),
                       ("run", "ar", 16, 0.0), ("run", "ngram", 16, 0.0),
                       ("stop", "ar"), ("stop", "ngram")]
    ng = sorted((r["repeat"], r["speedup_vs_ar"]) for r in recs if r["method"] == "ngram")
    if scope == "interleave":
        # round 0: 150 / 100; round 1 (machine "twice as slow"): 75 / 50
        assert ng == [(0, pytest.approx(1.5)), (1, pytest.approx(1.5))]
        assert all(r["paired_speedup"] for r in recs)
    else:
        # ar 100, 100 (its two runs came first); ngram 75, 75 against the median AR 100
        assert ng == [(0, pytest.approx(0.75)), (1, pytest.approx(0.75))]
    assert all(r["identical_to_ar"] for r in recs)


@pytest.mark.parametrize("scope", ["method", "interleave"])
def test_run_bench_several_engine_instances(monkeypatch, tmp_path, scope):
    """--engines 2: every method's engine is started twice, afresh; repeats are numbered across
    instances, interleaved runs pair with the AR run of their own round, the second round
    rotates the methods' order, an unavailable method is recorded once, and the summary gives
    each instance's speedup."""
    log = []
    _fake_engines(monkeypatch, log)
    monkeypatch.setattr(harness, "method_unavailable",
                        lambda method, spec: "not installed" if method == "suffix" else None)
    cfg = harness.BenchConfig(methods=["ar", "ngram", "suffix"], gen_lens=[16], batch_sizes=[1],
                              samplings=["greedy"], repeats=1, out_dir=str(tmp_path), random_prompts=True,
                              prefix_len=32, engine_scope=scope, engines=2)
    recs = harness.run_bench(cfg, progress=False)
    if scope == "interleave":
        assert log == [("start", "ar"), ("start", "ngram"),
                       ("run", "ar", 16, 0.0), ("run", "ngram", 16, 0.0),
                       ("stop", "ar"), ("stop", "ngram"),
                       ("start", "ngram"), ("start", "ar"),      # fresh instances, order rotated
                       ("run", "ngram", 16, 0.0), ("run", "ar", 16, 0.0),
                       ("stop", "ngram"), ("stop", "ar")]
    else:
        assert log == [("start", "ar"), ("run", "ar", 16, 0.0), ("stop", "ar"),
                       ("start", "ar"), ("run", "ar", 16, 0.0), ("stop", "ar"),
                       ("start", "ngram"), ("run", "ngram", 16, 0.0), ("stop", "ngram"),
                       ("start", "ngram"), ("run", "ngram", 16, 0.0), ("stop", "ngram")]
    ok = sorted((r["method"], r["repeat"], r["engine"], r["tokens_per_s"]) for r in recs if r["status"] == "ok")
    if scope == "interleave":
        assert ok == [("ar", 0, 0, 100.0), ("ar", 1, 1, 50.0), ("ngram", 0, 0, 150.0), ("ngram", 1, 1, 75.0)]
    else:   # the first two runs (both AR instances) at full speed, then both ngram ones at half
        assert ok == [("ar", 0, 0, 100.0), ("ar", 1, 1, 100.0), ("ngram", 0, 0, 75.0), ("ngram", 1, 1, 75.0)]
    assert [r["status"] for r in recs if r["method"] == "suffix"] == ["unavailable"]
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["ngram"]["engines"] == 2 and rows["ngram"]["repeats"] == 2
    want = [1.5, 1.5] if scope == "interleave" else [0.75, 0.75]
    assert rows["ngram"]["speedup_by_engine"] == pytest.approx(want)
    md = report.markdown_table(report.summarize(recs))
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    assert header[header.index("speedup med") + 1] == "speedup per engine"
    ng_line = next(line for line in md.splitlines() if line.startswith("| ngram |"))
    cells = [c.strip() for c in ng_line.strip("|").split("|")]
    assert cells[header.index("speedup per engine")] == " / ".join(f"{v:.3f}" for v in want)
    assert "speedup per engine" not in report.markdown_table(report.summarize(recs[:1]))


def test_method_config_engine_args_reach_only_that_engine(monkeypatch, tmp_path):
    """``--method-config 'ar-sync={"engine_args": {...}}'``: an AR engine with its own vLLM
    keyword arguments (e.g. asynchronous scheduling off); other engines get none, and a
    non-object ``engine_args`` is refused with the method named."""
    log = []
    _fake_engines(monkeypatch, log)
    cfg = harness.BenchConfig(methods=["ar", "ar-sync"], gen_lens=[16], batch_sizes=[1],
                              samplings=["greedy"], repeats=1, out_dir=str(tmp_path), random_prompts=True,
                              prefix_len=32, engine_scope="interleave",
                              method_configs={"ar-sync": {"engine_args": {"async_scheduling": False}}})
    assert harness.speculative_config("ar-sync", cfg) is None
    assert harness.method_engine_args("ar-sync", cfg) == {"async_scheduling": False}
    assert harness.method_engine_args("ar", cfg) == {}
    recs = harness.run_bench(cfg, progress=False)
    assert log[:2] == [("start", "ar"), ("start", "ar", {"async_scheduling": False})]
    assert sorted(r["method"] for r in recs if r["status"] == "ok") == ["ar", "ar-sync"]
    bad = harness.BenchConfig(method_configs={"x": {"engine_args": [1]}})
    with pytest.raises(ValueError, match="'x'.*engine_args.*JSON object"):
        harness.method_engine_args("x", bad)


def test_bench_cli_interleave_flag():
    from vllm_tokenswift.bench import cli

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    cli.add_parser(sub)
    assert ap.parse_args(["bench", "--interleave"]).engine_scope == "interleave"
    assert ap.parse_args(["bench", "--engine-scope", "interleave"]).engine_scope == "interleave"
    assert ap.parse_args(["bench"]).engine_scope == "method"
    assert ap.parse_args(["bench"]).engines == 1
    assert ap.parse_args(["bench", "--engines", "3"]).engines == 3


def test_spec_counters_from_collectors_outlive_the_registry():
    """An engine's counters are read from its own collector objects, also after they were
    unregistered (vLLM does that to the previous engine's metrics when it builds one)."""
    from prometheus_client import CollectorRegistry, Counter

    reg = CollectorRegistry()
    drafts = Counter("vllm:spec_decode_num_drafts", "d", ["engine"], registry=reg)
    toks = Counter("vllm:spec_decode_num_draft_tokens", "t", ["engine"], registry=reg)
    acc = Counter("vllm:spec_decode_num_accepted_tokens", "a", ["engine"], registry=reg)
    pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", ["engine", "position"], registry=reg)
    drafts.labels("0").inc(3)
    toks.labels("0").inc(24)
    acc.labels("0").inc(10)
    for p, v in ((0, 3), (1, 3), (2, 2), (3, 2)):
        pos.labels("0", str(p)).inc(v)
    collectors = [drafts, toks, acc, pos]
    for c in collectors:
        reg.unregister(c)
    drafts.labels("0").inc(1)                      # the engine goes on counting
    got = report.spec_counters_from_collectors(collectors)
    assert got == {"num_drafts": 4, "num_draft_tokens": 24, "num_accepted_tokens": 10,
                   "accepted_per_pos": [3, 3, 2, 2]}


def test_summary_carries_the_step_breakdown_table(tmp_path):
    """summary.md has the per-step time split, the decision mix and the accepted draft
    tokens per step of each kind (two repeats summed: 60 forward steps accepted 118)."""
    recs = [_rec("ar", 100.0, gen=1000),
            *[_rec("tokenswift", 200.0, gen=1000, rep=i, mean_accepted_length=2.5, time_draft_s=1.0,
                   time_verify_s=3.0, steps_by_kind={"forward": 30, "fused": 10, "ngram": 0, "none": 360},
                   accepted_by_kind={"forward": 59, "fused": 11, "ngram": 0, "none": 0})
              for i in range(2)]]
    rows = report.summarize(recs)
    table = report.step_breakdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].startswith("| method | sampling | batch | gen_len |")
    ar, ts = table[2], table[3]
    assert ar.startswith("| ar | greedy | 1 | 1000 | 1000 | 1.00 | 10.0 | 0.0 | 10.0 | 0.0 | – | – |")
    # 400 steps per request; 5 s wall -> 12.5 ms per step, 1 s proposer -> 2.5, 3 s -> 7.5
    assert ts == "| tokenswift | greedy | 1 | 1000 | 400 | 2.50 | 12.5 | 2.5 | 7.5 | 2.5 | 8/2/0/90 | 1.97/1.10/– |"
    paths = report.write_report(recs, str(tmp_path), plots=False)
    md = open(paths["markdown"]).read()
    assert "## Where a TokenSwift step's time goes" in md and ts in md
    assert report.step_breakdown_table(report.summarize([_rec("ar", 100.0, gen=1000)])) == ""


def test_empty_proposer_makes_the_drafter_return_no_drafts():
    """``empty_proposer`` (sent to workers by the research scripts' ``ts-empty`` mode)
    replaces the drafter's proposal with one empty chain per batch row; a worker without a
    drafter raises AttributeError."""
    drafter = SimpleNamespace(propose_step=lambda step: None)
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=drafter))
    assert harness.empty_proposer(worker) is True
    out = drafter.propose_step(SimpleNamespace(num_rows=3))
    assert out.draft_token_ids == [[], [], []] and out.draft_probs is None
    with pytest.raises(AttributeError):
        harness.empty_proposer(SimpleNamespace(model_runner=SimpleNamespace()))
