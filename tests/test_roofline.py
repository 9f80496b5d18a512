"""Roofline projection (docs/bench/roofline/roofline.py: research maths kept beside the docs, outside
the plugin): hand-computed cases, monotonicity, paper sanity ranges and the CLI."""

import argparse
import json
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parent.parent / "docs" / "bench" / "roofline"
sys.path.insert(0, str(_DIR))
import roofline as rl  # noqa: E402  (docs/bench/roofline/roofline.py: research maths outside the plugin)

# Toy model whose byte counts are easy to do by hand:
#   layer params: q 4*4 + k 4*2 + v 4*2 + o 4*4 = 48, MLP 3*4*8 = 96, norms 2*4 = 8 -> 152
#   read params = 152 (1 layer) + 4 (final norm) + 10*4 (LM head) = 196; 1 byte each
#   total params = 196 + 40 (embedding) = 236
#   KV bytes per token = 2 * 1 layer * 1 kv head * 2 head_dim * 1 byte = 4
TOY = rl.ModelSpec("toy", num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                   intermediate_size=8, vocab_size=10, dtype_bytes=1)
# 1 byte/s, compute never binds.
ONE_BPS = rl.GpuSpec("1B/s", bandwidth_tbs=1e-12, peak_tflops=1e9, efficiency=1.0)


def test_toy_counts_by_hand():
    assert TOY.params_per_layer == 152
    assert TOY.read_params == 196
    assert TOY.num_params == 236
    assert TOY.weight_bytes == 196
    assert TOY.kv_bytes_per_token == 4
    assert TOY.heads_bytes(3) == 3 * (16 + 8)


def test_toy_ar_exact():
    # prefix 10, gen 3: contexts 10, 11, 12 -> (196+40) + (196+44) + (196+48) = 720 bytes = 720 s
    p = rl.project("ar", TOY, ONE_BPS, prefix=10, gen=3)
    assert p.steps == 3
    assert p.bytes_first_step == 236
    assert p.wall_s == pytest.approx(720.0)
    assert p.bytes_per_token == pytest.approx(240.0)
    assert p.tokens_per_s == pytest.approx(3 / 720)
    assert rl.step_bytes("ar", TOY, 10) == 236


def test_toy_tokenswift_exact():
    # A = 2 tokens/step, gen 4 -> 2 steps at contexts 10 and 12; budget 8 caps the draft view.
    # step = draft (196 + heads 72 + 8*4) + verify (196 + c*4)
    spec = rl.SpecParams(k=4, accepted_length=2.0, kv_budget=8, num_heads=3)
    p = rl.project("tokenswift", TOY, ONE_BPS, prefix=10, gen=4, spec=spec)
    s0 = (196 + 72 + 32) + (196 + 40)
    s1 = (196 + 72 + 32) + (196 + 48)
    assert p.steps == 2
    assert p.bytes_first_step == s0
    assert p.wall_s == pytest.approx(s0 + s1)
    assert rl.step_bytes("tokenswift", TOY, 10, spec) == s0
    # budget larger than the context: the draft reads the whole (smaller) context
    spec_big = rl.SpecParams(k=4, accepted_length=2.0, kv_budget=1000, num_heads=3)
    assert rl.step_bytes("tokenswift", TOY, 10, spec_big) == (196 + 72 + 40) + (196 + 40)


def test_toy_ngram_and_overhead_exact():
    spec = rl.SpecParams(k=4, ngram_accepted_length=2.0, overhead_s=5.0)
    p = rl.project("ngram", TOY, ONE_BPS, prefix=10, gen=4, spec=spec)
    assert p.steps == 2
    assert p.wall_s == pytest.approx((196 + 40) + (196 + 48) + 2 * 5.0)
    # suffix defaults to the n-gram accepted length
    q = rl.project("suffix", TOY, ONE_BPS, prefix=10, gen=4, spec=spec)
    assert q.wall_s == pytest.approx(p.wall_s)


def test_compute_bound_takes_over():
    slow_compute = rl.GpuSpec("x", bandwidth_tbs=1e-12, peak_tflops=1e-12, efficiency=1.0)  # 1 FLOP/s
    p = rl.project("ar", TOY, slow_compute, prefix=0, gen=1)
    assert p.wall_s == pytest.approx(2 * 196)  # 2 * read_params FLOPs at context 0
    assert p.compute_bound_steps == 1


@pytest.mark.parametrize("method", rl.METHODS)
def test_longer_generation_takes_longer(method):
    m, g = rl.MODEL_PRESETS["qwen2.5-7b"], rl.GPU_PRESETS["a100"]
    t = [rl.project(method, m, g, 4096, n).wall_s for n in (10_000, 50_000, 100_000)]
    assert t[0] < t[1] < t[2]


@pytest.mark.parametrize("method", rl.METHODS)
def test_more_bandwidth_is_faster(method):
    m = rl.MODEL_PRESETS["llama3.1-8b"]
    t = [rl.project(method, m, rl.GPU_PRESETS[g], 4096, 20_000).wall_s for g in ("a100", "h100", "h200")]
    assert t[0] > t[1] > t[2]
    slow = rl.resolve_gpu(bandwidth_tbs=1.0)
    assert rl.project(method, m, slow, 4096, 20_000).wall_s > t[0]


def test_tokenswift_without_acceptance_or_budget_is_slower_than_ar():
    m, g = rl.MODEL_PRESETS["qwen2.5-7b"], rl.GPU_PRESETS["h100"]
    spec = rl.SpecParams(accepted_length=1.0, kv_budget=None)
    ar = rl.project("ar", m, g, 4096, 20_000, spec)
    ts = rl.project("tokenswift", m, g, 4096, 20_000, spec)
    assert ts.wall_s > 1.9 * ar.wall_s  # two full forwards per emitted token
    spec_budget = rl.SpecParams(accepted_length=1.0, kv_budget=200_000)  # budget >= context
    assert rl.project("tokenswift", m, g, 4096, 20_000, spec_budget).wall_s == pytest.approx(ts.wall_s)


def test_tokenswift_with_paper_acceptance_beats_ar():
    m, g = rl.MODEL_PRESETS["qwen2.5-14b"], rl.GPU_PRESETS["a100"]
    spec = rl.SpecParams(accepted_length=4.3, kv_budget=4096)
    ar = rl.project("ar", m, g, 4096, 100_000, spec)
    ts = rl.project("tokenswift", m, g, 4096, 100_000, spec)
    assert 2.0 < ar.wall_s / ts.wall_s < 4.3


def test_qwen7b_a100_100k_ar_in_range():
    # 14.1 GB of weights + a 57 KB/token KV cache growing 4K -> 104K at 1.6 TB/s: ~18 min.
    p = rl.project("ar", rl.MODEL_PRESETS["qwen2.5-7b"], rl.GPU_PRESETS["a100"], 4096, 100_000)
    assert 8.0 < p.wall_min < 25.0
    assert p.compute_bound_steps == 0


def test_preset_parameter_counts_match_published_sizes():
    expected = {"llama3.1-8b": 8.03e9, "qwen2.5-7b": 7.62e9, "qwen2.5-14b": 14.77e9,
                "qwen2.5-1.5b": 1.54e9}
    for key, n in expected.items():
        assert rl.MODEL_PRESETS[key].num_params == pytest.approx(n, rel=0.01), key


def test_paper_comparison_shows_gap():
    rows = rl.paper_comparison()
    by = {r["key"]: r for r in rows}
    assert set(by) == set(rl.PAPER_100K_A100)
    for key in ("qwen2.5-7b", "qwen2.5-14b", "llama3.1-8b"):
        assert 5 < by[key]["ratio_ar"] < 30  # the paper's decoder ran ~10-20x below the roofline
    assert by["qwen2.5-7b"]["paper_ar_min"] == 244.2


def test_hf_config_reading(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
           "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
           "vocab_size": 152064, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = rl.resolve_model(str(tmp_path))
    ref = rl.MODEL_PRESETS["qwen2.5-7b"]
    assert (m.num_params, m.kv_bytes_per_token, m.weight_bytes) == (
        ref.num_params, ref.kv_bytes_per_token, ref.weight_bytes)
    with pytest.raises(ValueError):
        rl.resolve_model("no-such-model")


def test_invalid_inputs():
    with pytest.raises(ValueError):
        rl.project("bogus", TOY, ONE_BPS, 10, 3)
    with pytest.raises(ValueError):
        rl.project("tokenswift", TOY, ONE_BPS, 10, 3, rl.SpecParams(k=4, accepted_length=6.0))
    with pytest.raises(ValueError):
        rl.resolve_gpu("a100", efficiency=0.0)


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    import roofline_cli

    roofline_cli.add_parser(sub)
    out = tmp_path / "p.json"
    args = parser.parse_args(["project", "--model", "qwen2.5-7b", "--gpu", "h100", "--gen", "20000",
                              "--accepted-length", "3.5", "--overhead-ms", "0.1",
                              "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "tokenswift" in text and "Paper vs roofline" in text
    data = json.loads(out.read_text())
    assert {p["method"] for p in data["projections"]} == set(rl.METHODS)
    assert len(data["paper_comparison"]) == 4
    bad = parser.parse_args(["project", "--model", "nope"])
    assert bad.func(bad) == 2
