"""The /metrics exporter's parts without a server: exposition of the cached samples as
`vllm_tokenswift:*` counters and gauges, the multi-API-server (multiprocess) mode, the
exporter's refresh through a stand-in engine client (and its settling fetches on an idle
engine). The end-to-end check through a running
server is in test_openai_server.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm.v1.engine.exceptions import EngineDeadError  # a slow first import, done at collection

from vllm_tokenswift.core.stats import TokenSwiftStats
from vllm_tokenswift.engine.prometheus import (GAUGES, IDLE_SETTLE_REFRESHES, PREFIX, TokenSwiftCollector,
                                               TokenSwiftMetricsExporter, gauges_from_rpc, interval_from_env,
                                               samples_from_rpc)


def _stats() -> TokenSwiftStats:
    st = TokenSwiftStats()
    st.accepted_heads, st.accepted_ngram, st.accepted_fused = 5, 7, 2
    st.steps_by_kind = {"forward": 3, "fused": 1, "ngram": 4, "none": 2}
    st.view_selections, st.draft_steps, st.time_draft_s = 6, 3, 0.25
    return st


def test_collector_exposes_counters_with_vllm_labels():
    col = TokenSwiftCollector()
    reg = CollectorRegistry()
    reg.register(col)
    assert generate_latest(reg) == b""  # nothing before the first refresh
    col.update("demo", "0", _stats().prometheus_samples())
    text = generate_latest(reg).decode()
    assert "# TYPE vllm_tokenswift:accepted_tokens_total counter" in text
    assert 'vllm_tokenswift:accepted_tokens_total{engine="0",model_name="demo",source="ngram"} 7.0' in text
    assert 'vllm_tokenswift:accepted_tokens_total{engine="0",model_name="demo",source="heads"} 5.0' in text
    assert 'vllm_tokenswift:draft_steps_total{engine="0",kind="none",model_name="demo"} 2.0' in text
    assert 'vllm_tokenswift:view_selections_total{engine="0",model_name="demo"} 6.0' in text
    assert 'vllm_tokenswift:draft_seconds_total{engine="0",model_name="demo"} 0.25' in text
    # every sample metrics.py defines is exported, nothing else
    names = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert names == {PREFIX + s[0] for s in _stats().prometheus_samples()}


def _worker_dict(live=3, stale=0, rss=123_456_789, history=4096) -> dict:
    """What the worker's ``tokenswift_stats`` answers (engine/stats_rpc.py, proposer.py)."""
    return {"prometheus_samples": _stats().prometheus_samples(), "num_live_requests": live,
            "num_stale_states": stale, "memory": {"history_tokens": history, "rss_bytes": rss,
                                                  "ngram_entries": 10, "penalty_counts_bytes": 0}}


def test_gauges_from_the_worker_dict_exposed_as_gauges():
    g = gauges_from_rpc([None, _worker_dict()])
    assert [(n, v) for n, _, _, v in g] == [("live_requests", 3.0), ("stale_requests", 0.0),
                                             ("history_tokens", 4096.0), ("worker_rss_bytes", 123456789.0)]
    assert [n for n, *_ in g] == list(GAUGES)
    # a value the worker does not report (no /proc: rss None) is left out; no TokenSwift: None
    assert "worker_rss_bytes" not in [n for n, *_ in gauges_from_rpc([_worker_dict(rss=None)])]
    assert gauges_from_rpc([None]) is None
    col = TokenSwiftCollector()
    reg = CollectorRegistry()
    reg.register(col)
    col.update("demo", "0", _stats().prometheus_samples(), g)
    text = generate_latest(reg).decode()
    assert "# TYPE vllm_tokenswift:live_requests gauge" in text
    assert 'vllm_tokenswift:live_requests{engine="0",model_name="demo"} 3.0' in text
    assert 'vllm_tokenswift:worker_rss_bytes{engine="0",model_name="demo"} 1.23456789e+08' in text
    assert "# TYPE vllm_tokenswift:accepted_tokens_total counter" in text
    # a counters-only update keeps the last gauges
    col.update("demo", "0", _stats().prometheus_samples())
    assert 'vllm_tokenswift:live_requests{engine="0",model_name="demo"} 3.0' in generate_latest(reg).decode()


def test_samples_from_rpc_takes_the_first_tokenswift_worker():
    s = _stats().prometheus_samples()
    assert samples_from_rpc([None, {"prometheus_samples": s}, {"prometheus_samples": []}]) == s
    assert samples_from_rpc([None]) is None and samples_from_rpc(None) is None


def test_interval_from_env(monkeypatch):
    monkeypatch.delenv("VLLM_TOKENSWIFT_METRICS_INTERVAL_S", raising=False)
    assert interval_from_env() == 2.0
    monkeypatch.setenv("VLLM_TOKENSWIFT_METRICS_INTERVAL_S", "0.5")
    assert interval_from_env() == 0.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("VLLM_TOKENSWIFT_METRICS_INTERVAL_S", bad)
        with pytest.raises(ValueError, match="VLLM_TOKENSWIFT_METRICS_INTERVAL_S"):
            interval_from_env()


class _Client:
    """Stand-in for vLLM's AsyncLLM: collective_rpc like a TP=2 engine."""

    def __init__(self, stats, dead_after=None):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(served_model_name=["m"]))
        self.engine_core = SimpleNamespace(engine_ranks_managed=[0])
        self.stats, self.calls, self.dead_after = stats, [], dead_after

    async def collective_rpc(self, method):
        self.calls.append(method)
        if self.dead_after is not None and len(self.calls) > self.dead_after:
            raise EngineDeadError()
        d = {"prometheus_samples": self.stats.prometheus_samples()}
        return [d, dict(d)]


def test_exporter_refreshes_until_the_engine_dies():
    st = _stats()
    col = TokenSwiftCollector()
    client = _Client(st, dead_after=3)
    exp = TokenSwiftMetricsExporter(client, interval_s=0.01, sink=col)
    assert (exp.model_name, exp.engine) == ("m", "0")

    async def go():
        exp.start()
        await asyncio.wait_for(exp.task, 120)  # returns once the engine is dead

    asyncio.run(go())
    assert client.calls == ["tokenswift_stats"] * 4 and exp.refreshes == 3
    reg = CollectorRegistry()
    reg.register(col)
    assert 'vllm_tokenswift:accepted_tokens_total{engine="0",model_name="m",source="fused"} 2.0' in \
        generate_latest(reg).decode()


def test_exporter_leaves_an_idle_engine_alone():
    """No request in flight: one refresh after the last request, then none until a
    request arrives (each fetch makes vLLM's idle worker busy-poll for a second)."""
    st = _stats()
    col = TokenSwiftCollector()
    client = _Client(st)
    client.unfinished = [1, 1, 0, 0, 0, 0, 0, 2, 0, 0]   # per loop turn; then idle
    client.get_num_unfinished_requests = lambda: client.unfinished.pop(0) if client.unfinished else 0
    exp = TokenSwiftMetricsExporter(client, interval_s=0.005, sink=col)

    async def until(cond, what):
        try:
            await asyncio.wait_for(_poll(cond), 30)
        except asyncio.TimeoutError:
            pytest.fail(f"the exporter never {what} (refreshes {exp.refreshes}, skipped {exp.skipped_idle})")

    async def go():
        exp.start()
        await until(lambda: not client.unfinished, "went through the scripted turns")
        drained = exp.skipped_idle
        await until(lambda: exp.skipped_idle >= drained + 10, "skipped ten idle turns")
        exp.task.cancel()

    asyncio.run(go())
    # busy, busy, first idle turn (refresh), idle x4 (skipped), busy (refresh), first
    # idle turn after it (refresh), then only skips: ten idle turns later no fetch was added
    assert exp.refreshes == 5 and len(client.calls) == 5


def test_idle_exporter_fetches_until_the_proposer_holds_no_request():
    """The finished requests' states are released by the runner's next step: an idle
    fetch that still sees live requests is followed by another, until live_requests is 0
    (then nothing more), at most IDLE_SETTLE_REFRESHES in a row when it never is."""
    for lives, want_fetches in (([2, 1, 0], 3), ([5] * 20, IDLE_SETTLE_REFRESHES)):
        col = TokenSwiftCollector()
        client = _Client(_stats())
        answers = list(lives)

        async def rpc(method, client=client, answers=answers):
            client.calls.append(method)
            return [_worker_dict(live=answers.pop(0) if len(answers) > 1 else answers[0])]

        client.collective_rpc = rpc
        client.get_num_unfinished_requests = lambda: 0
        exp = TokenSwiftMetricsExporter(client, interval_s=0.002, sink=col)

        async def go(exp=exp):
            exp.start()
            await asyncio.wait_for(_poll(lambda: exp.skipped_idle >= 20), 30)
            exp.task.cancel()

        asyncio.run(go())
        assert len(client.calls) == want_fetches, lives
        reg = CollectorRegistry()
        reg.register(col)
        assert f'vllm_tokenswift:live_requests{{engine="0",model_name="m"}} {float(lives[-1])}' in \
            generate_latest(reg).decode()


async def _poll(cond):
    while not cond():
        await asyncio.sleep(0.005)


def test_multiprocess_mode_writes_max_gauges(tmp_path):
    # vLLM's --api-server-count > 1 switches prometheus_client to multiprocess mode: every
    # API server writes the engine's values, merged with max (the freshest)
    code = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        from vllm_tokenswift.core.stats import TokenSwiftStats
        from vllm_tokenswift.engine.prometheus import _MultiprocessSink
        old, new = TokenSwiftStats(), TokenSwiftStats()
        old.accepted_ngram, new.accepted_ngram = 3, 9
        sink = _MultiprocessSink()
        sink.update("m", "0", new.prometheus_samples(), [("live_requests", "h", {}, 4.0)])
        sink.update("m", "1", old.prometheus_samples())
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        print(generate_latest(reg).decode())
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "# TYPE vllm_tokenswift:accepted_tokens_total gauge" in out.stdout
    assert 'vllm_tokenswift:accepted_tokens_total{engine="0",model_name="m",source="ngram"} 9.0' in out.stdout
    assert 'vllm_tokenswift:accepted_tokens_total{engine="1",model_name="m",source="ngram"} 3.0' in out.stdout
    assert 'vllm_tokenswift:live_requests{engine="0",model_name="m"} 4.0' in out.stdout
