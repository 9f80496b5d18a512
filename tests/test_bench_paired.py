"""Paired per-round ratios against a baseline (``vllm_tokenswift.bench.paired``)."""

from __future__ import annotations

import json

import pytest

from vllm_tokenswift.bench import paired


def _rec(method, repeat, tok_s, sampling="paper"):
    return {"method": method, "repeat": repeat, "sampling": sampling, "gen_len": 1024, "batch_size": 1,
            "decode_tokens_per_s": tok_s}


def test_ratios_pair_each_round_with_its_own_baseline():
    recs = [_rec("ar-vk", 0, 10.0), _rec("ts", 0, 15.0), _rec("ar-vk", 1, 20.0), _rec("ts", 1, 24.0),
            _rec("ar-vk", 0, 5.0, "greedy"), _rec("ts", 0, 20.0, "greedy"), _rec("orphan", 2, 9.0)]
    r = paired.paired_ratios(recs, "ar-vk")
    assert r[("paper", "ts")] == [1.5, 1.2]
    assert r[("paper", "ar-vk")] == [1.0, 1.0]
    assert r[("greedy", "ts")] == [4.0]
    assert ("paper", "orphan") not in r        # no baseline in its round
    md = paired.table(r, "ar-vk")
    assert "| paper | ts | 1.500, 1.200 | 1.35 |" in md


def test_no_baseline_is_an_error():
    with pytest.raises(ValueError, match="baseline method 'ar-vk'"):
        paired.paired_ratios([_rec("ts", 0, 1.0)], "ar-vk")


def test_main_prints_and_draws(tmp_path, capsys):
    f = tmp_path / "results.json"
    f.write_text(json.dumps([_rec("ar-vk", 0, 10.0), _rec("ts", 0, 13.0)]))
    png = tmp_path / "r.png"
    assert paired.main([str(f), "--png", str(png)]) == 0
    assert "| paper | ts | 1.300 | 1.30 |" in capsys.readouterr().out
    assert png.stat().st_size > 1000
