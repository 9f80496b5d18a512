"""A TokenSwift server under faults: clients that disconnect, bursts, preemption.

The load is driven over HTTP against a running ``vllm-tokenswift serve`` (vLLM's OpenAI
server with ``--speculative-model tokenswift``), greedy, every request ``ignore_eos``
with its prompt given as token ids, in three phases:

1. ``streams``: ``max_num_seqs`` streaming clients at once (the server's highest
   concurrency); every fifth closes its connection after ``disconnect_after_tokens``
   tokens (vLLM aborts the request);
2. ``burst``: ``2 × max_num_seqs`` requests sent at the same instant (half of them wait in
   vLLM's queue);
3. ``long``: long prompts and outputs that together need more KV blocks than the cache
   has (``kv_cache_tokens``), so vLLM preempts and later recomputes requests.

A warm-up pass runs the load's phases first (``warmup_phases``; in ``ci`` the streams
and the long phase, whose shapes the burst repeats), on other prompts and without
disconnects; the worker's resident set after it is the baseline, and the server under
test runs with :data:`SERVER_ENV`, so that its resident set follows what the worker
holds. Without them the check measured two things that are not request state. glibc keeps
freed memory (the demo-model worker's RSS moved by up to 4% between identical passes, and
``malloc_trim`` gave back about 100 MiB). And vLLM's CPU GEMMs are oneDNN primitives,
cached one per shape up to ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (1,024 by default):
TokenSwift's steps have many more distinct token counts than plain decoding's, so its
worker kept growing pass after pass (in one offline engine, after ``malloc_trim``: plain
decoding flat at 967 MiB over six passes of the ``ci`` load, TokenSwift 991 to 1,020 MiB;
with glibc's thresholds fixed, 1,036 to 1,130 MiB; with the cache off, flat at 1,018 MiB).
That growth is bounded by the cache's capacity, not by the requests served, and is not
the proposer's: the proposer's own state is checked exactly by the
``vllm_tokenswift:live_requests`` / ``stale_requests`` / ``history_tokens`` gauges.

Throughout, a thread polls ``/health``. Afterwards the report carries every request's
HTTP status, output token ids and finish reason, vLLM's counters from ``/metrics``
(``vllm:num_preemptions_total``, ``vllm:request_success_total`` by finish reason) and the
plugin's gauges (``vllm_tokenswift:live_requests``, ``stale_requests``,
``worker_rss_bytes``, :mod:`vllm_tokenswift.engine.prometheus`) before and after the
load. :func:`problems` lists what went wrong against a plain-decoding reference of the
same requests (greedy: token-identical).

Used by ``tests/test_serve_faults.py`` (size ``ci``) and by ``scripts/bench-serve.sh
faults`` (size ``full``, ``python -m vllm_tokenswift.bench.serving_faults``). vLLM is not
imported here: only HTTP (``http.client``) and the model's tokenizer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence
from urllib.parse import urlsplit


@dataclass(frozen=True)
class FaultLoad:
    """Sizes of one fault run (tokens unless named otherwise).

    Attributes:
        max_num_seqs: the server's ``--max-num-seqs``: the streams' concurrency; the burst
            sends twice as many.
        kv_cache_tokens: KV cache size in tokens (``--kv-cache-memory-bytes`` =
            this × the model's KV bytes per token, :func:`kv_bytes_per_token`); the long
            phase needs more than this.
        max_model_len: the server's ``--max-model-len``.
        stream_prompt_tokens, stream_tokens: prompt and output of each streaming client.
        disconnect_after_tokens: tokens a disconnecting client reads before it closes.
        burst_prompt_tokens, burst_tokens: prompt and output of each burst request.
        long_requests, long_prompt_tokens, long_tokens: the preemption phase.
        warmup_phases: the phases the warm-up pass runs (:data:`PHASES` or some of them).
        block_size: the server's ``--block-size``.
        kv_budget, num_speculative_tokens: TokenSwift's draft KV budget and k.
    """

    max_num_seqs: int
    kv_cache_tokens: int
    max_model_len: int
    stream_prompt_tokens: int
    stream_tokens: int
    disconnect_after_tokens: int
    burst_prompt_tokens: int
    burst_tokens: int
    long_requests: int
    long_prompt_tokens: int
    long_tokens: int
    warmup_phases: tuple = ("streams", "burst", "long")
    block_size: int = 32
    kv_budget: int = 512
    num_speculative_tokens: int = 4

    @property
    def disconnects(self) -> int:
        """Streaming clients that disconnect: a fifth of them (at least one)."""
        return max(1, self.max_num_seqs // 5)

    def long_phase_tokens(self) -> int:
        """KV tokens the long phase would hold at its end without preemption."""
        return self.long_requests * (self.long_prompt_tokens + self.long_tokens)


#: Environment of the TokenSwift server under test: glibc's mmap and trim thresholds fixed
#: at their defaults (so freed buffers of 128 KiB and more go back to the system at once)
#: and oneDNN's primitive cache off, so the worker's resident set follows what it holds
#: (see the module doc).
SERVER_ENV: dict[str, str] = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
                              "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}

#: ``ci``: tests/test_serve_faults.py on a 2-core CPU (the demo model); ``full``: the
#: ``faults`` block of scripts/bench-serve.sh.
SIZES: dict[str, FaultLoad] = {
    "ci": FaultLoad(max_num_seqs=10, kv_cache_tokens=2560, max_model_len=2048,
                    stream_prompt_tokens=160, stream_tokens=96, disconnect_after_tokens=12,
                    burst_prompt_tokens=120, burst_tokens=32,
                    long_requests=4, long_prompt_tokens=500, long_tokens=300, warmup_phases=("streams", "long")),
    "full": FaultLoad(max_num_seqs=32, kv_cache_tokens=16384, max_model_len=4096,
                      stream_prompt_tokens=1024, stream_tokens=512, disconnect_after_tokens=64,
                      burst_prompt_tokens=512, burst_tokens=256,
                      long_requests=12, long_prompt_tokens=1536, long_tokens=1536, kv_budget=1024),
}


#: the loaded phases, in the order they run
PHASES = ("streams", "burst", "long")


@dataclass
class Job:
    """One request of ``phase`` (:data:`PHASES`), in the warm-up pass if ``warmup``:
    ``prompt`` (token ids), ``max_tokens``, streamed or not, and for a disconnecting
    client the tokens it reads before closing."""

    name: str
    phase: str
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    disconnect_after: int | None = None
    warmup: bool = False


@dataclass
class Result:
    """What the client saw: HTTP ``status`` (None: no response), the output ``token_ids``,
    vLLM's ``finish_reason`` and ``completion_tokens`` (usage), whether the client
    disconnected on purpose (``cancelled``), and an ``error`` text."""

    name: str
    phase: str
    status: int | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    cancelled: bool = False
    error: str | None = None
    seconds: float = 0.0


# --------------------------------------------------------------------------- server side
def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 4) -> int:
    """KV cache bytes per token of a Llama/Qwen2-style model (its config.json: layers ×
    2 × KV heads × head dim × ``dtype_bytes``, fp32 by default).

    Raises:
        OSError: no config.json in ``model_dir``.
    """
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return int(c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", heads) * head_dim * dtype_bytes)


def server_args(load: FaultLoad, model_dir: str, served_name: str, heads: str | None = None,
                kv_cache_tokens: int | None = None) -> list[str]:
    """``vllm-tokenswift serve MODEL`` flags of the run (without the model, host, port):
    fp32, eager, ``--max-num-seqs``, a KV cache of ``kv_cache_tokens`` (default the load's)
    tokens, and with ``heads`` TokenSwift (``kv_budget``, ``num_speculative_tokens``)."""
    tokens = load.kv_cache_tokens if kv_cache_tokens is None else kv_cache_tokens
    args = ["--served-model-name", served_name, "--dtype", "float32",
            "--max-model-len", str(load.max_model_len), "--block-size", str(load.block_size),
            "--enforce-eager", "--max-num-seqs", str(load.max_num_seqs),
            "--kv-cache-memory-bytes", str(tokens * kv_bytes_per_token(model_dir)), "--seed", "0"]
    if heads:
        args += ["--speculative-model", "tokenswift", "--tokenswift-heads", str(heads),
                 "--tokenswift-config", json.dumps({"kv_budget": load.kv_budget,
                                                    "num_speculative_tokens": load.num_speculative_tokens})]
    return args


# --------------------------------------------------------------------------- the requests
def prompt_streams(model_dir: str, files: Sequence[str] | None = None) -> list[list[int]]:
    """Token ids of the bundled prompt texts (whole book openings; ``files`` overrides
    them), tokenized with the model's tokenizer (``transformers.AutoTokenizer``)."""
    from transformers import AutoTokenizer

    from vllm_tokenswift.cli.locations import PROMPTS_DIR

    paths = list(files) if files else sorted(str(p) for p in PROMPTS_DIR.glob("*.txt")
                                             if "-" not in p.stem)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(open(p, encoding="utf-8").read(), add_special_tokens=False)["input_ids"] for p in paths]


def plan_jobs(load: FaultLoad, streams: Sequence[Sequence[int]]) -> list[Job]:
    """The run's requests, phase by phase; every prompt differs from every other (windows
    at different offsets of the ``streams``, wrapping around).

    Raises:
        ValueError: no token streams, or a request that does not fit ``max_model_len``.
    """
    if not streams or not any(streams):
        raise ValueError("no prompt tokens")
    pos = [0]

    def prompt(n: int) -> list[int]:
        i = pos[0]
        pos[0] += 1
        s = streams[i % len(streams)]
        off = (i // len(streams)) * 97 % max(1, len(s))
        out: list[int] = []
        while len(out) < n:
            out.extend(s[off:off + n - len(out)])
            off = 0
        return list(out[:n])

    jobs = []
    for warm in (True, False):
        pre = "warmup-" if warm else ""
        phases = load.warmup_phases if warm else PHASES
        if "streams" in phases:
            for i in range(load.max_num_seqs):
                cut = load.disconnect_after_tokens if not warm and (
                    i % 5 == 4 or (load.max_num_seqs < 5 and i == 0)) else None
                jobs.append(Job(f"{pre}stream-{i}", "streams", prompt(load.stream_prompt_tokens),
                                load.stream_tokens, stream=True, disconnect_after=cut, warmup=warm))
        if "burst" in phases:
            jobs += [Job(f"{pre}burst-{i}", "burst", prompt(load.burst_prompt_tokens), load.burst_tokens,
                         warmup=warm) for i in range(2 * load.max_num_seqs)]
        if "long" in phases:
            jobs += [Job(f"{pre}long-{i}", "long", prompt(load.long_prompt_tokens), load.long_tokens,
                         warmup=warm) for i in range(load.long_requests)]
    for j in jobs:
        if len(j.prompt) + j.max_tokens > load.max_model_len:
            raise ValueError(f"{j.name}: {len(j.prompt)} + {j.max_tokens} tokens exceed max_model_len "
                             f"{load.max_model_len}")
    return jobs


# --------------------------------------------------------------------------- HTTP
def _conn(base: str, timeout: float) -> http.client.HTTPConnection:
    u = urlsplit(base)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def _body(job: Job, model: str) -> dict:
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    if job.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def send(base: str, model: str, job: Job, timeout: float = 600.0) -> Result:
    """Send one completion request (``/v1/completions``) and read its answer; a streaming
    job with ``disconnect_after`` closes the connection once it has that many tokens."""
    res = Result(job.name, job.phase)
    t0 = time.perf_counter()
    conn = _conn(base, timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(_body(job, model)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read().decode(errors="replace")[:500]
        elif not job.stream:
            d = json.loads(resp.read())
            ch = d["choices"][0]
            res.token_ids = list(ch.get("token_ids") or [])
            res.finish_reason = ch.get("finish_reason")
            res.completion_tokens = (d.get("usage") or {}).get("completion_tokens")
        else:
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                d = json.loads(data)
                for ch in d.get("choices") or ():
                    res.token_ids.extend(ch.get("token_ids") or ())
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                if d.get("usage"):
                    res.completion_tokens = d["usage"].get("completion_tokens")
                if job.disconnect_after is not None and len(res.token_ids) >= job.disconnect_after:
                    res.cancelled = True
                    break
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()   # mid-stream: the server sees the client go away and aborts the request
        res.seconds = time.perf_counter() - t0
    return res


def run_phase(base: str, model: str, jobs: Sequence[Job], concurrency: int | None = None,
              timeout: float = 600.0) -> list[Result]:
    """Send ``jobs`` from ``concurrency`` threads (default: all at once, released together
    by a barrier); results in the order of ``jobs``."""
    n = max(1, concurrency or len(jobs))
    barrier = threading.Barrier(min(n, len(jobs))) if jobs else None

    def one(job):
        if barrier is not None and concurrency is None:
            barrier.wait()
        return send(base, model, job, timeout)

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, jobs))


class HealthPoller:
    """Polls ``GET /health`` every ``every_s`` seconds in a thread until :meth:`stop`;
    ``statuses`` counts the answers by status code (``"error"``: no answer within
    ``timeout_s``), ``failures`` keeps the first ten non-200 answers."""

    def __init__(self, base: str, every_s: float = 0.25, timeout_s: float = 10.0) -> None:
        self.base, self.every_s, self.timeout_s = base, every_s, timeout_s
        self.statuses: dict[str, int] = {}
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            conn = _conn(self.base, self.timeout_s)
            try:
                conn.request("GET", "/health")
                resp = conn.getresponse()
                detail = resp.read().decode(errors="replace")
                key = str(resp.status)
            except (OSError, http.client.HTTPException) as e:
                key, detail = "error", f"{type(e).__name__}: {e}"
            finally:
                conn.close()
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if key != "200" and len(self.failures) < 10:
                self.failures.append(f"{time.strftime('%H:%M:%S')} {key} {detail}"[:200])
            self._stop.wait(self.every_s)

    def start(self) -> "HealthPoller":
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop polling; returns ``{"polls", "statuses", "failures"}``."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)
        return {"polls": sum(self.statuses.values()), "statuses": dict(self.statuses),
                "failures": list(self.failures)}


def read_metrics(base: str, timeout: float = 30.0) -> list[tuple[str, dict[str, str], float]]:
    """``/metrics`` as ``(sample name, labels, value)`` samples, parsed by
    ``prometheus_client.parser`` (counters' samples keep their ``_total`` suffix)."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = _conn(base, timeout)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric(m: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of sample ``name`` over the samples whose labels include ``labels``."""
    return sum(v for n, lab, v in m if n == name and all(lab.get(k) == val for k, val in labels.items()))


def proposer_gauges(base: str) -> dict[str, float | None]:
    """The plugin's gauges on ``/metrics`` (:data:`vllm_tokenswift.engine.prometheus.GAUGES`,
    ``vllm_tokenswift:<name>``; None where absent)."""
    from vllm_tokenswift.engine.prometheus import GAUGES, PREFIX

    m = read_metrics(base)
    out: dict[str, float | None] = {}
    for g in GAUGES:
        hits = [v for n, _lab, v in m if n == PREFIX + g]
        out[g] = hits[0] if hits else None
    return out


def settled_gauges(base: str, interval_s: float, timeout_s: float = 60.0) -> dict[str, float | None]:
    """The gauges once the engine is idle and the exporter has fetched after the last
    request (it fetches every ``interval_s``, and again on an idle engine while
    ``live_requests`` is not 0): waits 4 intervals, then until ``live_requests`` is 0 or
    ``timeout_s`` passes; returns the last reading."""
    time.sleep(max(1.0, 4 * interval_s))
    deadline = time.time() + timeout_s
    while True:
        g = proposer_gauges(base)
        if g.get("live_requests") == 0 or time.time() > deadline:
            return g
        time.sleep(interval_s)


# --------------------------------------------------------------------------- the run
def run_faults(base: str, model: str, load: FaultLoad, jobs: Sequence[Job], *, interval_s: float = 2.0,
               log: Callable[[str], None] = print) -> dict:
    """Run the warm-up pass and the three phases against the TokenSwift server at
    ``base`` (served name ``model``); ``interval_s`` is its
    ``VLLM_TOKENSWIFT_METRICS_INTERVAL_S``.

    Returns:
        the report: ``results`` (:class:`Result` dicts, in ``jobs`` order), ``health``
        (:meth:`HealthPoller.stop`), ``gauges_before`` / ``gauges_after`` (after the
        warm-up / after the load, settled), ``metrics_delta`` (vLLM counters over the
        three loaded phases: preemptions, finished requests by reason, per phase where it
        matters), ``seconds`` per phase.
    """
    results: dict[str, Result] = {}
    seconds: dict[str, float] = {}
    marks = {}
    health = HealthPoller(base).start()
    try:
        for warm in (True, False):
            if not warm:
                before = settled_gauges(base, interval_s)
                log(f"proposer before the load: {_fmt_gauges(before)}")
                m0 = read_metrics(base)
            for phase in PHASES:
                batch = [j for j in jobs if j.phase == phase and j.warmup == warm]
                t = time.perf_counter()
                for r in run_phase(base, model, batch):
                    results[r.name] = r
                key = f"warmup-{phase}" if warm else phase
                seconds[key] = time.perf_counter() - t
                if not warm:
                    marks[phase] = read_metrics(base)
                log(f"{key}: {len(batch)} requests in {seconds[key]:.1f} s")
        after = settled_gauges(base, interval_s)
        m_end = read_metrics(base)
        log(f"proposer after the load: {_fmt_gauges(after)}")
    finally:
        h = health.stop()
    log(f"/health: {h['polls']} polls, {h['statuses']}")

    def delta(a, b, name, **labels):
        return metric(b, name, **labels) - metric(a, name, **labels)

    md = {
        "num_preemptions": delta(m0, m_end, "vllm:num_preemptions_total"),
        "num_preemptions_long_phase": delta(marks["burst"], marks["long"], "vllm:num_preemptions_total"),
        "finished": {reason: delta(m0, m_end, "vllm:request_success_total", finished_reason=reason)
                     for reason in ("stop", "length", "abort", "error", "repetition")},
        # vLLM 0.32 counts a request the client aborted under no finish reason: the
        # disconnects show as requests missing from "length" while the engine ends empty
        "running_after": metric(m_end, "vllm:num_requests_running"),
        "waiting_after": metric(m_end, "vllm:num_requests_waiting"),
        "spec_decode_num_drafts": delta(m0, m_end, "vllm:spec_decode_num_drafts_total"),
        "spec_decode_num_accepted_tokens": delta(m0, m_end, "vllm:spec_decode_num_accepted_tokens_total"),
    }
    return {"load": asdict(load), "results": [asdict(results[j.name]) for j in jobs],
            "health": h, "gauges_before": before, "gauges_after": after, "metrics_delta": md,
            "seconds": seconds}


def _fmt_gauges(g: dict) -> str:
    rss = g.get("worker_rss_bytes")
    return (f"live requests {g.get('live_requests')}, stale {g.get('stale_requests')}, "
            f"history tokens {g.get('history_tokens')}, worker RSS "
            f"{'n/a' if rss is None else f'{rss / 2**20:.1f} MiB'}")


def reference_over_http(base: str, model: str, jobs: Sequence[Job], concurrency: int) -> dict[str, list[int]]:
    """Plain decoding's output token ids of ``jobs`` (streamed ones sent whole, none
    cancelled), from the server at ``base``, ``concurrency`` at a time.

    Raises:
        RuntimeError: a reference request failed.
    """
    plain = [Job(j.name, j.phase, j.prompt, j.max_tokens) for j in jobs]
    out = {}
    for r in run_phase(base, model, plain, concurrency):
        if r.status != 200 or r.error:
            raise RuntimeError(f"reference request {r.name} failed: {r.status} {r.error}")
        out[r.name] = r.token_ids
    return out


RSS_TOLERANCE = 0.05


def problems(report: dict, jobs: Sequence[Job], reference: dict[str, list[int]]) -> list[str]:
    """Everything that went wrong, one line each (empty: the run passed):
    a /health poll that was not 200; an HTTP status >= 500 or any non-200; a request not
    cancelled (warm-up included) that did not finish with ``finish_reason="length"`` and
    exactly ``max_tokens`` tokens; a disconnecting client that got no tokens or the whole
    output;
    vLLM's finished-request counts (``length`` = requests not cancelled in the loaded
    phases, ``abort`` = disconnects); no preemption in the long phase; a greedy output
    that differs from ``reference`` (token ids by job name); the proposer still holding
    request state (``live_requests``, ``stale_requests`` not 0); the worker's RSS more
    than :data:`RSS_TOLERANCE` above or below its level after the warm-up."""
    out = []
    h = report["health"]
    if h["polls"] == 0 or set(h["statuses"]) != {"200"}:
        out.append(f"/health not always 200: {h['statuses']} {h['failures'][:3]}")
    res = {r["name"]: r for r in report["results"]}
    loaded = 0
    cancelled = 0
    for j in jobs:
        r = res[j.name]
        if r["status"] is None or r["status"] >= 500 or r["status"] != 200:
            out.append(f"{j.name}: HTTP {r['status']} {r['error']}")
            continue
        if j.disconnect_after is not None:
            cancelled += 1
            if not r["cancelled"] or not (0 < len(r["token_ids"]) < j.max_tokens):
                out.append(f"{j.name}: disconnecting client read {len(r['token_ids'])} tokens "
                           f"(cancelled={r['cancelled']})")
            continue
        if not j.warmup:
            loaded += 1
        if r["error"] or r["finish_reason"] != "length" or len(r["token_ids"]) != j.max_tokens \
                or r["completion_tokens"] != j.max_tokens:
            out.append(f"{j.name}: finish {r['finish_reason']}, {len(r['token_ids'])} tokens "
                       f"(usage {r['completion_tokens']}) of {j.max_tokens}; {r['error']}")
        elif j.name in reference and r["token_ids"] != reference[j.name]:
            first = next(i for i, (a, b) in enumerate(zip(r["token_ids"], reference[j.name])) if a != b)
            out.append(f"{j.name}: output differs from plain decoding from token {first}")
        elif j.name not in reference and not j.warmup:
            out.append(f"{j.name}: no reference output")
    md = report["metrics_delta"]
    # vLLM counts finished requests by reason, but not those the client aborted
    if md["finished"]["length"] != loaded:
        out.append(f"vLLM finished {md['finished']['length']:.0f} requests by length, expected {loaded} "
                   f"(the requests not cancelled)")
    for reason in ("stop", "abort", "error", "repetition"):
        if md["finished"][reason]:
            out.append(f"vLLM finished {md['finished'][reason]:.0f} requests with reason {reason}")
    if md["running_after"] or md["waiting_after"]:
        out.append(f"vLLM still has {md['running_after']:.0f} running and {md['waiting_after']:.0f} waiting "
                   f"requests after the load (the {cancelled} disconnected ones not aborted?)")
    if md["num_preemptions_long_phase"] <= 0:
        out.append("no preemption in the long phase (KV cache too large for the load?)")
    after, before = report["gauges_after"], report["gauges_before"]
    for g in ("live_requests", "stale_requests", "history_tokens"):
        if after.get(g) != 0:
            out.append(f"proposer still holds state after the load: {g} = {after.get(g)}")
    rb, ra = before.get("worker_rss_bytes"), after.get("worker_rss_bytes")
    if not rb or ra is None:
        out.append("worker RSS not reported")
    elif abs(ra - rb) > RSS_TOLERANCE * rb:
        out.append(f"worker RSS {ra / 2**20:.1f} MiB after the load vs {rb / 2**20:.1f} MiB before "
                   f"({(ra - rb) / rb:+.1%}, tolerance ±{RSS_TOLERANCE:.0%})")
    return out


# --------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_tokenswift.bench.serving_faults``: print the servers' flags
    (``--print-server-args tokenswift|plain``) or the environment of the server under test
    (``--print-server-env``), or run the load against running servers
    and write ``faults-report.json`` under ``--out``. Exit status 1 when
    :func:`problems` finds any."""
    ap = argparse.ArgumentParser(prog="python -m vllm_tokenswift.bench.serving_faults",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--model-dir", required=True, help="the served model's folder (tokenizer, config.json)")
    ap.add_argument("--served-model-name", default="model")
    ap.add_argument("--heads", default=None, help="TokenSwift heads (for --print-server-args tokenswift)")
    ap.add_argument("--print-server-args", choices=("tokenswift", "plain"), default=None)
    ap.add_argument("--print-server-env", action="store_true",
                    help="print SERVER_ENV (KEY=VALUE lines) for the TokenSwift server under test")
    ap.add_argument("--tokenswift", help="base URL of the TokenSwift server under test")
    ap.add_argument("--plain", help="base URL of the plain-decoding server (the greedy reference)")
    ap.add_argument("--metrics-interval", type=float, default=2.0,
                    help="the TokenSwift server's VLLM_TOKENSWIFT_METRICS_INTERVAL_S")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    load = SIZES[a.size]
    if a.print_server_env:
        print("\n".join(f"{k}={v}" for k, v in SERVER_ENV.items()))
        return 0
    if a.print_server_args:
        heads = a.heads if a.print_server_args == "tokenswift" else None
        # the reference server never preempts: 4x the KV cache
        kv = None if heads else 4 * load.kv_cache_tokens
        print(" ".join(_quote(x) for x in server_args(load, a.model_dir, a.served_model_name, heads, kv)))
        return 0
    if not (a.tokenswift and a.plain):
        ap.error("--tokenswift URL and --plain URL are required to run the load")
    jobs = plan_jobs(load, prompt_streams(a.model_dir))
    report = run_faults(a.tokenswift, a.served_model_name, load, jobs, interval_s=a.metrics_interval)
    t = time.perf_counter()
    ref = reference_over_http(a.plain, a.served_model_name,
                              [j for j in jobs if j.disconnect_after is None and not j.warmup], load.max_num_seqs)
    report["seconds"]["reference"] = time.perf_counter() - t
    found = problems(report, jobs, ref)
    report["problems"] = found
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "faults-report.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f)
    print(f"faults ({a.size}): {len(jobs)} requests, {sum(1 for j in jobs if j.disconnect_after)} "
          f"disconnects, preemptions {report['metrics_delta']['num_preemptions']:.0f}; "
          f"{'PASS' if not found else 'FAIL'}; report: {path}")
    for p in found:
        print("  " + p)
    return 1 if found else 0


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


if __name__ == "__main__":
    raise SystemExit(main())
