"""TokenSwift's counters on the API server's Prometheus ``/metrics`` endpoint.

The counters live in the worker (:class:`~vllm_tokenswift.core.stats.TokenSwiftStats`).
In the API server process, :func:`start_exporter` (started by the plugin's
``api-server-metrics`` patch once the server state is initialised) runs a background
task that fetches them every ``VLLM_TOKENSWIFT_METRICS_INTERVAL_S`` seconds (default
2) with ``engine_client.collective_rpc("tokenswift_stats")`` while the engine has
requests (and once after its last one; an idle engine is left alone) and keeps the
latest :meth:`~vllm_tokenswift.core.stats.TokenSwiftStats.prometheus_samples`. A scrape
never waits for the engine: it reads the cached values.

Exported under the ``vllm_tokenswift:`` prefix with vLLM's own labels
(``model_name``, ``engine``) plus the counter's labels, e.g.::

    vllm_tokenswift:accepted_tokens_total{engine="0",model_name="demo",source="ngram"} 812.0

Besides the counters, four gauges from the same fetch (:func:`gauges_from_rpc`) show what
the proposer holds: ``live_requests`` (requests with per-request state: n-gram table,
view, sampling state), ``stale_requests`` (states of requests the runner no longer
knows; must stay 0), ``history_tokens`` (tokens the live n-gram tables index) and
``worker_rss_bytes`` (the worker process's resident set). Once the engine has drained,
``live_requests`` must read 0: while it does not, the exporter keeps fetching on an idle
engine (at most :data:`IDLE_SETTLE_REFRESHES` times), so the gauges show the state after
vLLM's last step released the finished requests.

* One API server (vLLM's default): a custom collector on vLLM's registry exports
  true Prometheus counters.
* Several API servers (``--api-server-count > 1``, vLLM's multiprocess Prometheus
  mode): every server writes the same engine values to a gauge in ``max`` mode, so
  the merged value is the freshest; the type is then ``gauge``.
* Data parallelism: ``collective_rpc`` reaches the first engine, so the counters are
  engine 0's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

logger = logging.getLogger("vllm_tokenswift")

PREFIX = "vllm_tokenswift:"
INTERVAL_ENV = "VLLM_TOKENSWIFT_METRICS_INTERVAL_S"
DEFAULT_INTERVAL_S = 2.0
BASE_LABELS = ("model_name", "engine")

Sample = tuple  # (name, help, labels: dict, value: float), see TokenSwiftStats.prometheus_samples
#: fetches on an idle engine while ``live_requests`` is not yet 0 (the finished requests'
#: states are released by the runner's next step, which may come after the first idle fetch)
IDLE_SETTLE_REFRESHES = 5

#: gauge name -> (help, how to read it from the worker's ``tokenswift_stats`` dict)
GAUGES = {
    "live_requests": ("Requests the proposer holds per-request state for (n-gram table, draft view, "
                      "sampling state); 0 once the engine has drained",
                      lambda d: d.get("num_live_requests")),
    "stale_requests": ("Proposer states of requests vLLM's runner no longer knows (finished, aborted "
                       "or preempted but not freed); must stay 0",
                       lambda d: d.get("num_stale_states")),
    "history_tokens": ("Tokens indexed by the live requests' n-gram tables",
                       lambda d: (d.get("memory") or {}).get("history_tokens")),
    "worker_rss_bytes": ("Resident set size of the worker process that runs the proposer, in bytes",
                         lambda d: (d.get("memory") or {}).get("rss_bytes")),
}


def interval_from_env() -> float:
    """Refresh interval in seconds (``VLLM_TOKENSWIFT_METRICS_INTERVAL_S``, default 2).

    Raises:
        ValueError: not a positive number.
    """
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or raw == "":
        return DEFAULT_INTERVAL_S
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={raw!r} is not a number (seconds)") from None
    if not v > 0:
        raise ValueError(f"{INTERVAL_ENV}={raw!r} must be > 0 seconds")
    return v


class TokenSwiftCollector:
    """A ``prometheus_client`` custom collector serving the latest cached samples: the
    counters as counters (``CounterMetricFamily``; ``_total`` names keep their suffix on
    samples), the :data:`GAUGES` as gauges."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[tuple[str, str], list[Sample]] = {}
        self._gauges: dict[tuple[str, str], list[Sample]] = {}

    def update(self, model_name: str, engine: str, samples: list[Sample],
               gauges: list[Sample] | None = None) -> None:
        """Replace the counter samples (and, when given, the gauge samples) of one engine."""
        with self._lock:
            self._samples[(model_name, engine)] = list(samples)
            if gauges is not None:
                self._gauges[(model_name, engine)] = list(gauges)

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self._gauges.clear()

    def describe(self):
        return []  # names are dynamic; do not collect at registration time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            kinds = ((CounterMetricFamily, sorted(self._samples.items())),
                     (GaugeMetricFamily, sorted(self._gauges.items())))
        for family_cls, items in kinds:
            families: dict[str, tuple] = {}
            for (model, engine), samples in items:
                for name, help_text, labels, value in samples:
                    keys = tuple(sorted(labels))
                    fam = families.get(name)
                    if fam is None:
                        fam = (family_cls(PREFIX + name, help_text, labels=[*BASE_LABELS, *keys]), keys)
                        families[name] = fam
                    fam[0].add_metric([model, engine, *(str(labels[k]) for k in fam[1])], float(value))
            for fam, _ in families.values():
                yield fam


class _MultiprocessSink:
    """Gauges in multiprocess mode (vLLM's multi-API-server Prometheus mode): the counters
    merged with ``max`` (the freshest), the :data:`GAUGES` with ``mostrecent``."""

    def __init__(self) -> None:
        self._gauges: dict[str, object] = {}

    def _set(self, samples: list[Sample], model_name: str, engine: str, mode: str) -> None:
        from prometheus_client import Gauge

        for name, help_text, labels, value in samples:
            keys = tuple(sorted(labels))
            g = self._gauges.get(name)
            if g is None:
                g = Gauge(PREFIX + name, help_text, labelnames=[*BASE_LABELS, *keys],
                          multiprocess_mode=mode, registry=None)
                self._gauges[name] = g
            g.labels(model_name, engine, *(str(labels[k]) for k in keys)).set(float(value))

    def update(self, model_name: str, engine: str, samples: list[Sample],
               gauges: list[Sample] | None = None) -> None:
        self._set(samples, model_name, engine, "max")
        self._set(gauges or [], model_name, engine, "mostrecent")


_collector: TokenSwiftCollector | None = None
_collector_lock = threading.Lock()


def collector() -> TokenSwiftCollector:
    """The process-wide collector, registered once on vLLM's Prometheus registry."""
    global _collector
    with _collector_lock:
        if _collector is None:
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            _collector = TokenSwiftCollector()
            get_prometheus_registry().register(_collector)
        return _collector


def _first_worker(results) -> dict | None:
    for r in results or ():
        if isinstance(r, dict) and r.get("prometheus_samples") is not None:
            return r
    return None


def samples_from_rpc(results) -> list[Sample] | None:
    """The samples of the first worker that answered ``tokenswift_stats`` (tensor-parallel
    ranks hold identical counters), or None if no worker runs TokenSwift."""
    r = _first_worker(results)
    return None if r is None else [tuple(s) for s in r["prometheus_samples"]]


def gauges_from_rpc(results) -> list[Sample] | None:
    """The :data:`GAUGES` of the first worker that answered ``tokenswift_stats``, as
    ``(name, help, {}, value)`` samples (a gauge the worker does not report, e.g. the RSS
    where ``/proc`` is missing, is left out), or None if no worker runs TokenSwift.
    Values: request counts, tokens, bytes."""
    r = _first_worker(results)
    if r is None:
        return None
    out = []
    for name, (help_text, read) in GAUGES.items():
        v = read(r)
        if v is not None:
            out.append((name, help_text, {}, float(v)))
    return out


def _settled(gauges: list[Sample] | None) -> bool:
    """Whether the fetched gauges show no live request (or carry no such gauge)."""
    for name, _, _, value in gauges or ():
        if name == "live_requests":
            return value == 0
    return True


class TokenSwiftMetricsExporter:
    """Fetches the counters from the engine and hands them to the Prometheus sink.

    Args:
        engine_client: vLLM's ``EngineClient`` (``AsyncLLM``) of the API server.
        interval_s: seconds between fetches.
        sink: where samples go (default: :func:`collector`, or gauges in multiprocess mode).
    """

    def __init__(self, engine_client, interval_s: float | None = None, sink=None) -> None:
        self.engine_client = engine_client
        self.interval_s = interval_from_env() if interval_s is None else float(interval_s)
        if sink is None:
            sink = _MultiprocessSink() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else collector()
        self.sink = sink
        vc = getattr(engine_client, "vllm_config", None)
        name = getattr(getattr(vc, "model_config", None), "served_model_name", None) or ""
        self.model_name = name[0] if isinstance(name, (list, tuple)) else str(name)
        ranks = getattr(getattr(engine_client, "engine_core", None), "engine_ranks_managed", None) or [0]
        self.engine = str(ranks[0])
        self.task: asyncio.Task | None = None
        self.refreshes = 0
        self.skipped_idle = 0
        #: whether the last fetch showed no live request (see :data:`IDLE_SETTLE_REFRESHES`)
        self.settled = True

    async def refresh(self) -> bool:
        """Fetch once; returns whether samples were received."""
        res = await self.engine_client.collective_rpc("tokenswift_stats")
        samples = samples_from_rpc(res)
        if samples is None:
            return False
        gauges = gauges_from_rpc(res)
        self.sink.update(self.model_name, self.engine, samples, gauges)
        self.settled = _settled(gauges)
        self.refreshes += 1
        return True

    def _busy(self) -> bool | None:
        """Whether the engine has unfinished requests (None: the client cannot tell)."""
        fn = getattr(self.engine_client, "get_num_unfinished_requests", None)
        if fn is None:
            return None
        try:
            return int(fn()) > 0
        except Exception:  # noqa: BLE001 - unknown client state: refresh as before
            return None

    async def run(self) -> None:
        """Refresh until the engine dies or the task is cancelled (server shutdown).

        While the engine has no unfinished request, the counters cannot change after the
        one refresh that follows its last request, so the loop stops asking the worker
        (``skipped_idle`` counts the skipped refreshes): every ``collective_rpc`` wakes
        vLLM's shared-memory queues, whose readers then busy-poll for a second, so a
        fetch every 2 s kept an idle server's worker and engine core spinning about half
        the time (on a 2-vCPU machine, a second idle server slowed the busy one ~7x).
        The one exception: while an idle fetch still shows live requests (the runner
        releases the last finished requests' states in the step after they finish), the
        loop fetches again, at most :data:`IDLE_SETTLE_REFRESHES` times in a row."""
        from vllm.v1.engine.exceptions import EngineDeadError

        warned = False
        fetched_idle = False
        idle_fetches = 0
        while True:
            busy = self._busy()
            if busy is False and fetched_idle:
                self.skipped_idle += 1
                await asyncio.sleep(self.interval_s)
                continue
            try:
                await self.refresh()
                idle_fetches = idle_fetches + 1 if busy is False else 0
                fetched_idle = busy is False and (self.settled or idle_fetches >= IDLE_SETTLE_REFRESHES)
            except asyncio.CancelledError:
                raise
            except EngineDeadError:
                logger.debug("TokenSwift metrics exporter stops: engine is dead")
                return
            except Exception:  # noqa: BLE001 - keep serving; the next refresh may work
                if not warned:
                    logger.warning("TokenSwift metrics: fetching the counters failed", exc_info=True)
                    warned = True
            await asyncio.sleep(self.interval_s)

    def start(self) -> "TokenSwiftMetricsExporter":
        """Start :meth:`run` as a task on the running event loop."""
        self.task = asyncio.get_running_loop().create_task(self.run(), name="tokenswift-metrics")
        return self


def start_exporter(engine_client) -> TokenSwiftMetricsExporter:
    """Start exporting a TokenSwift engine's counters on this process's ``/metrics``.

    Must run on the API server's event loop (the plugin calls it from
    ``init_app_state``). Returns the exporter (keep a reference: it owns the task).
    """
    exp = TokenSwiftMetricsExporter(engine_client).start()
    logger.info("TokenSwift metrics exported on /metrics as %s* (every %.1f s)", PREFIX, exp.interval_s)
    return exp
