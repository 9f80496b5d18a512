"""The proposer's counters across processes: the worker methods ``tokenswift_stats`` /
``tokenswift_reset_stats`` (installed on ``WorkerBase`` by the ``worker-stats-rpc`` patch)
and their offline callers through ``LLM.collective_rpc``.

The counters themselves are :class:`vllm_tokenswift.core.stats.TokenSwiftStats`, kept by
the proposer in the worker; ``/metrics`` reaches the same worker methods
(:mod:`vllm_tokenswift.engine.prometheus`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_tokenswift")


def worker_stats(worker) -> dict | None:
    """Installed by the plugin as ``WorkerBase.tokenswift_stats`` (reachable by name
    through ``collective_rpc``)."""
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    fn = getattr(drafter, "tokenswift_stats", None)
    if fn is None:
        return None
    d = fn()
    # per-request proposer state vLLM's runner no longer knows of (must stay 0: state of
    # finished, aborted and preempted requests is freed)
    known = getattr(runner, "requests", None)
    states = getattr(drafter, "states", None)
    if known is not None and states is not None:
        d["num_stale_states"] = sum(1 for rid in states if rid not in known)
    return d


def worker_reset(worker) -> bool:
    """Installed by the plugin as ``WorkerBase.tokenswift_reset_stats``."""
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    fn = getattr(drafter, "reset_tokenswift_stats", None)
    if fn is None:
        return False
    fn()
    return True


def get_engine_stats(llm) -> dict | None:
    """TokenSwift counters of an offline ``vllm.LLM`` (first worker), or None if the
    engine does not run TokenSwift. See :meth:`TokenSwiftStats.summary` for the keys."""
    try:
        res = llm.collective_rpc("tokenswift_stats")
    except Exception:  # engine without the plugin's worker method
        logger.debug("collective_rpc failed", exc_info=True)
        return None
    return res[0] if res else None


def reset_engine_stats(llm) -> bool:
    """Zero the TokenSwift counters of an offline engine (between benchmark runs)."""
    try:
        res = llm.collective_rpc("tokenswift_reset_stats")
    except Exception:
        logger.debug("collective_rpc failed", exc_info=True)
        return False
    return bool(res and res[0])
