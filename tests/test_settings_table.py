"""`vllm-tokenswift bench-table` (vllm_tokenswift.bench.settings_table) on synthetic
bench folders: exact medians, runs, verdicts, footnotes and the CLI. No engine."""

import argparse
import json

import pytest

from vllm_tokenswift.bench import settings_table as st
from vllm_tokenswift.bench.cli import run_table_cli

SMOL = "/cache/models/SmolLM2-135M-Instruct"


def _rec(method, tps, gen=2048, b=1, sampling="greedy", rep=0, model=SMOL, **kw):
    r = {"method": method, "gen_len": gen, "batch_size": b, "sampling": sampling, "repeat": rep,
         "status": "ok", "tokens_per_s": tps, "model": model, "paired_speedup": True}
    r.update(kw)
    return r


def _folder(tmp_path, name, recs, yarn=None):
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps(recs))
    (d / "config.json").write_text(json.dumps({"yarn": yarn}))
    return str(d)


@pytest.fixture
def folders(tmp_path):
    # invocation A: two rounds of greedy 2K with every peer; its own AR per round
    a = [_rec("ar", 10.0, rep=0), _rec("tokenswift", 48.0, rep=0,
                                        steps_by_kind={"forward": 0, "fused": 1, "ngram": 8, "none": 1}),
         _rec("suffix", 50.0, rep=0), _rec("ar", 12.0, rep=1),
         _rec("tokenswift", 60.0, rep=1, steps_by_kind={"forward": 0, "fused": 1, "ngram": 8, "none": 1}),
         _rec("suffix", 54.0, rep=1),
         _rec("ar", 10.0, sampling="paper"), _rec("tokenswift", 9.6, sampling="paper"),
         _rec("ngram", 9.9, sampling="paper", note="min_p dropped (ngram)"),
         _rec("suffix", 0.0, sampling="paper", status="error")]
    # invocation B: the paper policy at greedy 2K against its own (slower) AR, and a YaRN run
    b = [_rec("ar", 5.0), _rec("tokenswift-paper", 15.0)]
    c = [_rec("ar", 8.0, gen=12288, sampling="paper"), _rec("tokenswift", 8.4, gen=12288, sampling="paper")]
    return [_folder(tmp_path, "a", a), _folder(tmp_path, "b", b), _folder(tmp_path, "yarn", c, yarn=2.0)]


def test_pivot_rows_cells_and_verdicts(folders):
    recs = st.load_invocations(folders)
    assert {r["source"] for r in recs} == {"a", "b", "yarn"}
    methods, rows = st.settings_table(recs)
    assert methods == ["tokenswift", "tokenswift-paper", "ngram", "suffix"]
    assert [r["label"] for r in rows] == [
        "SmolLM2-135M-Instruct, greedy, 2K, b=1",
        "SmolLM2-135M-Instruct, paper, 2K, b=1",
        "SmolLM2-135M-Instruct YaRN ×2, paper, 12K, b=1"]
    greedy, paper, yarn = rows
    # each run over the AR run of its own round and invocation
    assert greedy["cells"]["tokenswift"]["runs"] == pytest.approx([4.8, 5.0])
    assert greedy["cells"]["tokenswift"]["median"] == pytest.approx(4.9)
    assert greedy["cells"]["suffix"]["runs"] == pytest.approx([5.0, 4.5])
    assert greedy["cells"]["tokenswift-paper"]["runs"] == pytest.approx([3.0])  # over B's AR, not A's
    assert greedy["ar_tokens_per_s"] == pytest.approx(10.0)  # median of 10, 12, 5
    assert greedy["mix"] == {"forward": 0, "fused": 2, "ngram": 16, "none": 2}
    assert greedy["best_peer"] == "suffix"
    assert greedy["meets_floor"] is True and greedy["beats_peers"] is True  # 4.9 >= 4.75
    # the failed suffix run is left out; ngram carries its note
    assert "suffix" not in paper["cells"]
    assert paper["cells"]["ngram"]["notes"] == ["min_p dropped (ngram)"]
    assert paper["best_peer"] == "ngram"
    assert paper["meets_floor"] is False and paper["beats_peers"] is False  # 0.96 < 0.97, < 0.99
    assert yarn["key"] == ("SmolLM2-135M-Instruct", 2.0, "paper", 1, 12288)
    assert yarn["cells"]["tokenswift"]["median"] == pytest.approx(1.05)
    assert yarn["best_peer"] is None and yarn["beats_peers"] is None and yarn["meets_floor"] is True


def test_markdown_bold_runs_footnotes(folders):
    methods, rows = st.settings_table(st.load_invocations(folders), floor=0.97)
    md = st.markdown(methods, rows).splitlines()
    assert md[0] == ("| setting | AR tok/s | tokenswift | tokenswift-paper | ngram | suffix | "
                     "tokenswift decision mix % fwd/fused/ngram/none[/chain] | tokenswift ≥ 0.97x AR | "
                     "tokenswift ≥ best peer |")
    assert md[2] == ("| SmolLM2-135M-Instruct, greedy, 2K, b=1 | 10.0 | **4.90x** (4.800, 5.000) | 3.00x | – "
                     "| 4.75x (5.000, 4.500) | 0/10/80/10 | yes | yes (suffix) |")
    assert md[3] == ("| SmolLM2-135M-Instruct, paper, 2K, b=1 | 10.0 | 0.96x | – | **0.99x** [1] | – | – "
                     "| **no** | **no** (ngram) |")
    assert md[4].endswith("| **1.05x** | – | – | – | – | yes | – |")
    assert md[-1] == "[1] min_p dropped (ngram)"


def test_explicit_methods_and_focus(folders):
    methods, rows = st.settings_table(st.load_invocations(folders), methods=["suffix", "tokenswift"],
                                      focus="suffix", peers=["tokenswift"])
    assert methods == ["suffix", "tokenswift"]
    assert rows[0]["best_peer"] == "tokenswift" and rows[0]["beats_peers"] is False
    # the focus is never its own peer
    _, rows = st.settings_table(st.load_invocations(folders), focus="suffix", peers=["suffix"])
    assert rows[0]["best_peer"] is None and rows[0]["beats_peers"] is None


def test_cli_writes_table_and_plot(folders, tmp_path, capsys):
    out, png = tmp_path / "t.md", tmp_path / "t.png"
    args = argparse.Namespace(results=folders, methods=None, focus="tokenswift",
                              peers=["ngram", "ngram-best", "suffix"], floor=0.97, out=str(out), png=str(png))
    assert run_table_cli(args) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == out.read_text().strip()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    args.results = [str(tmp_path / "missing")]
    assert run_table_cli(args) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text(json.dumps({"not": "a list"}))
    args.results = [str(bad)]
    assert run_table_cli(args) == 2


def test_cli_parser_registers_bench_table():
    from vllm_tokenswift.cli import build_parser

    a = build_parser().parse_args(["bench-table", "x", "y", "--methods", "tokenswift,suffix", "--floor", "1"])
    assert a.results == ["x", "y"] and a.methods == ["tokenswift", "suffix"] and a.floor == 1.0
    assert a.func is run_table_cli
