"""The cost probe's and the long-run report's engine-free parts: the step breakdown
arithmetic, the worker profile, the probe policy's directive and chains, per-segment
figures and their pairing with AR, the proposer's per-step work benchmark, the
attention micro-benchmark, and the decode-phase speedup of ``generate``."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from vllm_tokenswift.bench import probe, segments
from vllm_tokenswift.core.chain import SOURCE_HEADS, SOURCE_NGRAM, Chain
from vllm_tokenswift.bench.profiler import StepProfile, StepProfiler, install


def test_step_breakdown_splits_a_step_into_its_parts():
    prof = {"seconds": {"forward": 2.0, "attention": 1.5, "sample": 0.1, "propose": 0.4,
                        "draft_forward": 0.3, "draft_attention": 0.05},
            "counts": {"steps": 100, "draft_forwards": 10}}
    b = probe.step_breakdown(prof, wall_s=3.0, steps=100)
    assert b["step"] == pytest.approx(30.0)
    assert b["attention"] == pytest.approx(15.0) and b["forward_rest"] == pytest.approx(5.0)
    assert b["sample"] == pytest.approx(1.0) and b["propose"] == pytest.approx(4.0)
    assert b["other"] == pytest.approx(30.0 - 20.0 - 1.0 - 4.0)
    assert b["draft_forwards"] == 10 and b["draft_forward"] == pytest.approx(30.0)
    assert b["draft_attention"] == pytest.approx(5.0)
    none = probe.step_breakdown({"seconds": {"forward": 1.0}, "counts": {}}, 0.5, 10)
    assert none["other"] == 0.0 and none["draft_forward"] is None   # never negative
    with pytest.raises(ValueError):
        probe.step_breakdown(prof, 1.0, 0)


def test_profile_delta_subtracts_the_snapshot_before():
    before = {"seconds": {"forward": 1.0, "sample": 0.5}, "counts": {"steps": 4}}
    after = {"seconds": {"forward": 3.0, "sample": 0.5, "propose": 0.2}, "counts": {"steps": 10}}
    d = probe.profile_delta(before, after)
    assert d == {"seconds": {"forward": 2.0, "sample": 0.0, "propose": 0.2}, "counts": {"steps": 6}}
    assert probe.profile_delta(None, after)["counts"] == {"steps": 10}


def test_decode_steps_cancels_the_first_prefill_step():
    # both requests start with the same 200 ms tail prefill; only the long one's extra
    # 30 steps of 25 ms remain
    short = {"wall_s": 0.2 + 5 * 0.025, "steps": 6,
             "profile": {"seconds": {"attention": 0.15 + 5 * 0.01}, "counts": {"steps": 6}}}
    long = {"wall_s": 0.2 + 35 * 0.025, "steps": 36,
            "profile": {"seconds": {"attention": 0.15 + 35 * 0.01}, "counts": {"steps": 36}}}
    d = probe.decode_steps(short, long)
    assert d["steps"] == 30 and d["wall_s"] == pytest.approx(30 * 0.025)
    assert d["profile"]["seconds"]["attention"] == pytest.approx(0.3)
    assert d["profile"]["counts"]["steps"] == 30
    b = probe.step_breakdown(d["profile"], d["wall_s"], d["steps"])
    assert b["step"] == pytest.approx(25.0) and b["attention"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="more steps"):
        probe.decode_steps(long, short)


def test_probe_rejects_too_few_tokens_before_any_engine():
    with pytest.raises(SystemExit, match="--tokens must exceed 32"):
        probe.main(["--model", "tiny", "--tokens", "20", "--no-micro"])


def test_step_profile_sums_parts_and_counts():
    prof = StepProfile()
    with prof.timed("x"):
        sum(range(1000))
    prof.count("steps", 3)
    snap = prof.snapshot()
    assert snap["seconds"]["x"] > 0 and snap["counts"] == {"steps": 3}
    prof.reset()
    assert prof.snapshot() == {"seconds": {}, "counts": {}}


class _Impl:
    def __init__(self):
        self.calls = 0

    def forward(self, *a):
        self.calls += 1
        return "out"


class _Runner:
    """Just what :func:`profiler.install` wraps: a model, attention layers, ``_sample`` and
    a drafter with its target."""

    def __init__(self, with_drafter=True):
        from types import SimpleNamespace

        self.model = torch.nn.Linear(4, 4)
        self.layer = SimpleNamespace(impl=_Impl())
        self.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(
            static_forward_context={"model.layers.0.attn": self.layer}))
        target = SimpleNamespace(draft_forward=self._draft_forward)
        self.drafter = SimpleNamespace(propose_step=lambda step: "proposal", target_access=target) \
            if with_drafter else None

    def _sample(self, logits, meta):
        return "sampled"

    def _draft_forward(self, *a):
        self.layer.impl.forward()          # attention inside the draft forward
        return self.model(torch.zeros(1, 4))


def test_profiler_installs_timers_on_one_runner_only():
    """The probe's worker extension wraps this runner's own objects: the model's forward,
    every attention layer's impl, ``_sample`` (one step each) and the proposer with its draft
    forward, whose model and attention calls are booked apart; nothing at class level."""
    r = _Runner()
    prof = StepProfile()
    assert install(r, prof) == ["forward", "attention", "sample", "propose", "draft_forward"]
    r.model(torch.zeros(1, 4))
    r.layer.impl.forward()
    assert r._sample(None, None) == "sampled" and r._sample(None, None) == "sampled"
    assert r.drafter.propose_step(None) == "proposal"
    r.drafter.target_access.draft_forward()
    snap = prof.snapshot()
    assert set(snap["seconds"]) == {"forward", "attention", "sample", "propose", "draft_forward", "draft_model",
                                    "draft_attention"}
    assert snap["counts"] == {"steps": 2, "draft_forwards": 1}
    assert r.layer.impl.calls == 2
    assert "forward" not in vars(r.model) and _Impl().forward.__func__ is _Impl.forward   # classes untouched
    plain = _Runner(with_drafter=False)
    assert install(plain, StepProfile()) == ["forward", "attention", "sample"]


def test_worker_extension_installs_once_and_reports():
    w = StepProfiler()
    assert w.tokenswift_profile() == {"seconds": {}, "counts": {}}
    w.model_runner = _Runner()
    parts = w.tokenswift_profile_install()
    assert parts == w.tokenswift_profile_install()        # idempotent: wrapped once
    w.model_runner._sample(None, None)
    assert w.tokenswift_profile()["counts"] == {"steps": 1}


def test_probe_directive_and_chain_length():
    from types import SimpleNamespace

    from vllm_tokenswift.bench.probe_policy import ProbePolicy, probe_directive
    from vllm_tokenswift.core.config import TokenSwiftConfig
    from vllm_tokenswift.core.request_state import RequestState
    from vllm_tokenswift.core.step import FORWARD, NGRAM, Row

    assert probe_directive(None) == ("ngram", 0)
    assert probe_directive({"tokenswift_probe": {"kind": "forward", "drafts": 4}}) == ("forward", 4)
    for bad in ({"kind": "fused", "drafts": 1}, {"kind": "ngram", "drafts": -1}):
        with pytest.raises(ValueError, match="tokenswift_probe"):
            probe_directive({"tokenswift_probe": bad})
    cfg = TokenSwiftConfig.parse({"use_heads": False, "policy": "vllm_tokenswift.bench.probe_policy:ProbePolicy"})
    pol = ProbePolicy(cfg, 8)
    st = RequestState(ngrams=None)
    pol.on_new_request(st, SimpleNamespace(extra_args={"tokenswift_probe": {"kind": "ngram", "drafts": 5}}))
    other = RequestState(ngrams=None)
    pol.on_new_request(other, SimpleNamespace(extra_args={"tokenswift_probe": {"kind": "forward", "drafts": 2}}))
    row = Row(0, "r", st, pos=10, room=8, context=[7, 8, 9])
    plan = pol.plan([row, Row(1, "o", other, pos=3, room=8, context=[1])], 1, False)
    assert plan.kinds == [NGRAM, FORWARD] and plan.threshold < 0 and not plan.any_forced
    ch = pol.cut(plan, 0, Chain([1, 2], [SOURCE_NGRAM, SOURCE_NGRAM], 0.0, [0.9, 0.8])).chain
    assert ch.tokens == [1, 2, 9, 9, 9] and ch.sources == [SOURCE_NGRAM] * 5
    assert ch.confs == [0.9, 0.8, 0.0, 0.0, 0.0]
    long = pol.cut(plan, 0, Chain(list(range(8)), [SOURCE_HEADS] * 8, 0.0)).chain   # confs empty (paper chains)
    assert long.tokens == [0, 1, 2, 3, 4] and len(long.confs) == 5
    row.room = 3
    assert pol.cut(plan, 0, Chain([], [], 0.0)).chain.tokens == [9, 9, 9]            # capped by the room


def test_probe_chain_directive_plans_exact_chain_forwards():
    from types import SimpleNamespace

    from vllm_tokenswift.bench.probe_policy import ProbePolicy, probe_directive
    from vllm_tokenswift.core.chain import SOURCE_CHAIN
    from vllm_tokenswift.core.config import TokenSwiftConfig
    from vllm_tokenswift.core.request_state import RequestState
    from vllm_tokenswift.core.step import CHAIN, NGRAM, Row

    assert probe_directive({"tokenswift_probe": {"kind": "chain", "drafts": 2}}) == ("chain", 2)
    with pytest.raises(ValueError, match="tokenswift_probe"):
        probe_directive({"tokenswift_probe": {"kind": "chain", "drafts": 0}})
    cfg = TokenSwiftConfig.parse({"use_heads": False, "policy": "vllm_tokenswift.bench.probe_policy:ProbePolicy"})
    pol = ProbePolicy(cfg, 8)
    states = []
    for _ in range(2):
        st = RequestState(ngrams=None)
        pol.on_new_request(st, SimpleNamespace(extra_args={"tokenswift_probe": {"kind": "chain", "drafts": 3}}))
        states.append(st)
    rows = [Row(0, "a", states[0], pos=10, room=8, context=[7, 8, 9], chain_room=8),
            Row(1, "b", states[1], pos=4, room=8, context=[5], chain_room=0)]   # no lookahead slot
    plan = pol.plan(rows, 1, False)
    assert plan.kinds == [CHAIN, NGRAM]
    assert [plan.chain_forwards(j) for j in range(2)] == [3, 0]
    ch = pol.cut(plan, 0, Chain([4, 5, 6], [SOURCE_CHAIN] * 3, 0.0, [0.5, 0.4, 0.3])).chain
    assert ch.tokens == [4, 5, 6] and ch.sources == [SOURCE_CHAIN] * 3
    # the row without a slot verifies the same number of (padding) tokens
    assert pol.cut(plan, 1, Chain([], [], 0.0)).chain.tokens == [5, 5, 5]


def test_probe_chain_rows_note_their_draft_forwards():
    r = {"context": 16384, "shape": "chain 2", "kernel": "plugin", "step": 30.0, "steps": 10,
         "draft_forwards": 20, "draft_forward": 6.5, "draft_attention": 0.5}
    r.update({p: 1.0 for p in probe.PARTS})
    plain = dict(r, shape="plain", step=20.0, draft_forward=None, draft_forwards=0)
    md = probe.markdown([plain, r], [])
    assert "| 16,384 | chain 2 | plugin | 30.0 | 1.50x |" in md
    assert "- 16,384, chain 2: 2.00 draft forwards per step, 6.5 ms each (0.5 ms attention)" in md


def test_probe_rejects_chains_longer_than_the_engines_k():
    with pytest.raises(SystemExit, match="--chains takes 1 to 8"):
        probe.main(["--model", "tiny", "--chains", "1,9", "--no-micro"])


def _snap(t, tokens, steps, drafts, accepted, ts=None):
    spec = {"num_drafts": drafts, "num_draft_tokens": 4 * drafts, "num_accepted_tokens": accepted,
            "accepted_per_pos": []}
    return {"t": t, "tokens": tokens, "steps": steps, "spec": spec, "plugin": ts}


def test_segments_from_snapshots():
    ts = lambda acc_ng, chains, fwd, none, tdraft, hist: {  # noqa: E731
        "verified_drafts": chains, "accepted_ngram": acc_ng, "num_speculative_tokens": 4,
        "steps_by_kind": {"forward": fwd, "fused": 0, "ngram": 0, "none": none}, "time_draft_s": tdraft,
        "memory": {"history_tokens": hist, "ngram_entries": 3 * hist, "rss_bytes": 2**30}}
    snaps = [_snap(0.0, 1, 1, 0, 0, ts(0, 0, 0, 1, 0.0, 1)),
             _snap(2.0, 100, 51, 40, 30, ts(20, 40, 10, 41, 0.05, 100)),
             _snap(5.0, 200, 131, 100, 50, ts(24, 100, 10, 121, 0.13, 200))]
    ids = list(range(50)) * 4
    rows = segments.segments_from_snapshots(snaps, ids, 4)
    assert [(r["start"], r["end"], r["tokens"], r["steps"]) for r in rows] == [(1, 100, 99, 50), (100, 200, 100, 80)]
    assert rows[0]["tokens_per_s"] == pytest.approx(49.5) and rows[1]["tokens_per_step"] == pytest.approx(1.25)
    assert rows[0]["acceptance_rate"] == pytest.approx(30 / (4 * 40))
    assert rows[1]["ngram_acceptance"] == pytest.approx(4 / (4 * 60))
    assert rows[1]["steps_by_kind"] == {"forward": 0, "fused": 0, "ngram": 0, "none": 80}
    assert rows[0]["proposer_ms_per_step"] == pytest.approx(1.0)
    assert rows[1]["history_tokens"] == 200 and rows[1]["ngram_entries"] == 600
    assert rows[1]["distinct_1"] == pytest.approx(50 / 100)         # tokens 100..199: 50 distinct
    # a final snapshot taken after the request's state was freed reads 0; the memory read
    # a step before the finish stands in for it
    snaps[-1]["plugin"]["memory"] = {"history_tokens": 0, "ngram_entries": 0, "rss_bytes": 2**30}
    snaps[-1]["memory_before_finish"] = {"history_tokens": 196, "ngram_entries": 588, "rss_bytes": 2**30}
    last = segments.segments_from_snapshots(snaps, ids, 4)[-1]
    assert last["history_tokens"] == 196 and last["ngram_entries"] == 588


def test_paired_segments_pair_by_index_and_round():
    def rec(method, rep, tps):
        return {"method": method, "status": "ok", "gen_len": 16, "batch_size": 1, "sampling": "greedy",
                "repeat": rep, "segments": [{"start": i, "end": i + 8, "tokens_per_s": v} for i, v in enumerate(tps)]}
    recs = [rec("ar", 0, [10.0, 8.0]), rec("ar", 1, [20.0, 16.0]), rec("tokenswift", 0, [20.0, 24.0]),
            rec("tokenswift", 1, [20.0, 32.0])]
    recs[2]["segments"][1]["end"] = 19                                   # a speculative bound past AR's
    segments.paired_segments(recs)
    assert [s["speedup_vs_ar"] for s in recs[2]["segments"]] == [2.0, 3.0]
    assert [s["speedup_vs_ar"] for s in recs[3]["segments"]] == [1.0, 2.0]
    assert [s["speedup_vs_ar"] for s in recs[0]["segments"]] == [1.0, 1.0]
    md = segments.markdown(recs)
    assert "### ar, greedy (2 runs" in md and "### tokenswift, greedy (2 runs" in md
    assert "| 0-8 | 20.0 | 1.50 |" in md                                 # medians of the two rounds


def test_step_work_is_measured_per_history_length():
    toks = [int(x) for x in np.random.default_rng(0).integers(3, 200, size=2600)]
    toks = toks[:1300] + toks[:1300]                                      # repeats: n-gram chains exist
    rows = probe.step_work_bench(histories=(500, 2000), steps=50, tokens=toks)
    assert [r["history"] for r in rows] == [500, 2000]
    for r in rows:
        parts = r["ngram_update_us"] + r["ngram_chain_us"] + r["penalty_us"] + r["policy_us"]
        assert r["total_us"] == pytest.approx(parts) and r["total_us"] > 0
    assert rows[1]["ngram_entries"] > rows[0]["ngram_entries"] > 0 and rows[1]["table_mb"] > 0
    assert "| 2,000 |" in probe.step_work_markdown(rows)


def test_attention_microbench_rows():
    rows = probe.attention_microbench([512], hq=6, hkv=2, d=64, q_lens=(1, 5), reps=2)
    assert [(r["context"], r["q"]) for r in rows] == [(512, 1), (512, 5)]
    assert all(r["vllm_ms"] > 0 and r["plugin_ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in rows)
    md = probe.markdown([], rows)
    assert "| 512 | 5 |" in md and "cache-warm" in md
    cold = probe.attention_microbench([256], hq=6, hkv=2, d=64, q_lens=(3,), reps=1, layers=3)
    assert [(r["q"], r["layers"]) for r in cold] == [(3, 3)] and cold[0]["max_abs_diff"] < 1e-4
    assert "3 layers' caches attended in turn, cold" in probe.markdown([], cold)
    with pytest.raises(ValueError, match="layers"):
        probe.attention_microbench([256], hq=6, hkv=2, d=64, layers=0)


def test_ngram_table_entries_grow_with_distinct_text():
    from vllm_tokenswift.core.ngram import NGramTable

    t = NGramTable(4)
    t.extend([1, 2, 3, 4] * 50)
    looped = t.num_entries()
    u = NGramTable(4)
    u.extend(list(range(200)))
    assert u.num_entries() > looped > 200          # every token is indexed, distinct text holds more


def test_generate_report_prints_the_decode_phase_speedup():
    from vllm_tokenswift.cli.generate import print_report

    res = {"prompt_tokens": 10, "num_tokens": 100, "ar_tokens_per_s": 10.0, "tokens_per_s": 12.0,
           "ar_wall_s": 10.0, "wall_s": 8.3, "ar_decode_tokens_per_s": 11.0, "decode_tokens_per_s": 16.5,
           "speedup": 1.2, "decode_speedup": 1.5, "acceptance_rate": 0.2, "mean_accepted_length": 1.5}
    buf = io.StringIO()
    print_report(res, buf)
    text = buf.getvalue()
    assert "decode tokens/s" in text and "16.50" in text
    assert "speedup: 1.20x (whole run, prefill included)   decode-phase speedup: 1.50x" in text


def _plugin_snapshot(stats, k, hist):
    """The shape of the worker's ``tokenswift_stats`` (proposer.tokenswift_stats) after a
    pickle round trip: records as lists, strings, nested dicts."""
    d = stats.summary(k)
    d.update(key_layout="nhd", num_live_requests=1, policy="adaptive",
             prometheus_samples=[list(x) for x in stats.prometheus_samples()],
             cost_model={"plain": 0.01, "verify_per_token": 0.002},
             verify_attention={"calls": 3},
             memory={"history_tokens": hist, "ngram_entries": 2 * hist, "penalty_counts_bytes": 0,
                     "rss_bytes": 2**30})
    return d


def test_segments_from_real_plugin_snapshots():
    """The per-segment rows from snapshots shaped like the worker's real ``tokenswift_stats``
    (the 32K length sweep of 2026-12-03 lost its TokenSwift run to a TypeError on the
    ``prometheus_samples`` records)."""
    from vllm_tokenswift.core.stats import TokenSwiftStats

    stats = TokenSwiftStats()
    snaps = [_snap(0.0, 1, 1, 0, 0, _plugin_snapshot(stats, 4, 1))]
    for _ in range(10):
        stats.record_chain([SOURCE_HEADS] * 4, "ngram")
        stats.record_verification([SOURCE_HEADS] * 4, 4, 2, kind="ngram")
    stats.steps_by_kind["ngram"] = 10
    snaps.append(_snap(1.0, 31, 11, 10, 20, _plugin_snapshot(stats, 4, 31)))
    rows = segments.segments_from_snapshots(snaps, list(range(31)), 4)
    assert [(r["start"], r["end"], r["tokens"], r["steps"]) for r in rows] == [(1, 31, 30, 10)]
    assert rows[0]["steps_by_kind"] == {"forward": 0, "chain": 0, "fused": 0, "ngram": 10, "none": 0}
    assert rows[0]["history_tokens"] == 31 and rows[0]["ngram_entries"] == 62
    assert rows[0]["acceptance_rate"] == pytest.approx(20 / (4 * 10))


def test_probe_requests_carry_the_sampling_and_the_directive():
    """``probe --sampling paper``: every timed request has the paper's sampling (penalty
    window in ``extra_args``) beside the probe policy's directive; greedy by default."""
    import argparse

    from vllm_tokenswift.bench.methods import sampling_kwargs

    class FakeLLM:
        def __init__(self):
            self.params = []

        def collective_rpc(self, name):
            assert name == "tokenswift_profile"
            return [{"seconds": {}, "counts": {"steps": 3}}]

        def generate(self, prompts, sp, use_tqdm=False):
            self.params.append(sp)

    llm = FakeLLM()
    paper, _ = sampling_kwargs("tokenswift", "paper", {"method": "tokenswift"})
    probe._run_shape(llm, [1, 2, 3], {"kind": "ngram", "drafts": 2}, 5, paper)
    probe._run_shape(llm, [1, 2, 3], {"kind": "forward", "drafts": 8}, 5)
    sp, greedy = llm.params
    assert (sp.temperature, sp.min_p, sp.repetition_penalty, sp.max_tokens) == (1.0, 0.1, 1.2, 5)
    assert sp.extra_args == {"repetition_penalty_window": 1024, "tokenswift_probe": {"kind": "ngram", "drafts": 2}}
    assert paper["extra_args"] == {"repetition_penalty_window": 1024}          # the preset is not changed
    assert greedy.temperature == 0.0 and greedy.extra_args == {"tokenswift_probe": {"kind": "forward", "drafts": 8}}
    sub = argparse.ArgumentParser().add_subparsers()
    p = probe.add_parser(sub)
    assert p.parse_args([]).sampling == "greedy" and p.parse_args(["--sampling", "paper"]).sampling == "paper"
    with pytest.raises(SystemExit):
        p.parse_args(["--sampling", "beam"])


def test_probe_table_divides_by_the_plain_vllm_step():
    def row(shape, kernel, step, parts=True):
        r = {"context": 16384, "shape": shape, "kernel": kernel, "step": step, "draft_forward": None}
        r.update({p: (1.0 if parts else None) for p in probe.PARTS})
        return r

    rows = [row("plain", "ar", 20.0, parts=False), row("plain", "plugin", 25.0), row("verify 2", "plugin", 30.0)]
    lines = probe.markdown(rows, []).splitlines()
    assert lines[2] == "| 16,384 | plain | ar | 20.0 | 0.80x | 1.00x | - | - | - | - | - |"
    assert lines[4].startswith("| 16,384 | verify 2 | plugin | 30.0 | 1.20x | 1.50x | 1.0 |")
    without_ar = probe.markdown(rows[1:], []).splitlines()
    assert without_ar[3].startswith("| 16,384 | verify 2 | plugin | 30.0 | 1.20x | - | 1.0 |")


def test_probe_rejects_unknown_engine_arms():
    with pytest.raises(SystemExit, match="--kernels"):
        probe.main(["--model", "tiny", "--kernels", "ar,triton", "--no-micro"])
    with pytest.raises(SystemExit, match="--kernels"):
        probe.main(["--model", "tiny", "--kernels", "ar", "--no-micro"])


def test_probe_checks_every_context_against_the_window_before_any_engine(tmp_path):
    # demo model: 20,480 positions without rope scaling, 40,960 with YaRN x2. 8K fits, 40,960
    # does not (plus 96 steps of up to 9 tokens: the default drafts go to 8): the whole invocation stops before the first
    # engine (it used to fail only when it reached that context, after the earlier ones ran)
    assert probe.probe_max_model_len(8192, 96, [0, 1, 2, 4]) == 8192 + 96 * 5 + 256
    from vllm_tokenswift.cli.models import resolve_target

    probe.check_windows(str(resolve_target("tiny", None)[0]), [8192, 16384], 2.0, 96, [0, 1, 2, 4])
    with pytest.raises(SystemExit, match=r"context 40960 .* needs 42080 positions, over the model's window 40960 \(YaRN x2\)"):
        probe.main(["--model", "tiny", "--contexts", "8192,40960", "--yarn", "2", "--no-micro",
                    "--out", str(tmp_path)])
    assert not (tmp_path / "probe.json").exists()
