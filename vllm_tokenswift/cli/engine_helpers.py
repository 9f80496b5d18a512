"""Helpers the user commands (``generate``, ``demo``) and the benchmarks share around a
vLLM engine: vLLM's output sent to a log file, an engine shut down before the next one
starts, and the plugin's counters around a run. No imports from ``bench/``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from typing import Any, Callable, Iterator, TextIO

from vllm_tokenswift.core import figures as counters

logger = logging.getLogger("vllm_tokenswift")


@contextlib.contextmanager
def engine_output_to(log_path: str | os.PathLike | None) -> Iterator[tuple[TextIO, TextIO]]:
    """Send everything written to file descriptors 1 and 2 to ``log_path``; yield
    ``(out, err)`` text streams that still reach the original stdout/stderr.

    vLLM logs through handlers bound to ``sys.stdout`` and its engine-core and worker
    processes inherit the file descriptors, so redirecting the descriptors (not only
    ``sys.stdout``) catches every start-up line, warning and child-process message. The
    command prints its own lines and progress bars to ``out``/``err``. Everything is
    restored on exit. ``log_path`` None: nothing is redirected and ``(sys.stdout,
    sys.stderr)`` are yielded (``--verbose``).

    Args:
        log_path: file to append to (its folder is created).
    """
    if log_path is None:
        yield sys.stdout, sys.stderr
        return
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = (os.dup(1), os.dup(2))
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
    err = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        yield out, err
    finally:
        for stream in (sys.stdout, sys.stderr, out, err):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in saved:
            os.close(f)
        out.close()
        err.close()


def teardown_engine(llm: Any) -> None:
    """Shut an engine down and free its memory before the next one starts."""
    if llm is None:
        return
    try:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:  # best effort
        logger.debug("engine_core.shutdown failed", exc_info=True)
    del llm
    gc.collect()
    try:
        from vllm.distributed import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()
    except Exception:
        logger.debug("cleanup_dist_env_and_memory unavailable/failed", exc_info=True)
    gc.collect()


def _plugin_fn(name: str) -> Callable | None:
    try:
        import vllm_tokenswift.engine.stats_rpc as m
        return getattr(m, name)
    except (ImportError, AttributeError):
        return None


def plugin_stats_before(llm: Any) -> tuple[bool, dict | None]:
    """Reset the plugin's counters if possible, else snapshot them.

    Returns ``(was_reset, snapshot_or_None)``.
    """
    reset = _plugin_fn("reset_engine_stats")
    if reset is not None:
        try:
            if reset(llm):
                return True, None
        except Exception:
            logger.debug("reset_engine_stats failed", exc_info=True)
    get = _plugin_fn("get_engine_stats")
    if get is None:
        return False, None
    try:
        return False, get(llm)
    except Exception:
        return False, None


def plugin_stats_after(llm: Any, was_reset: bool, before: dict | None, k: int
                       ) -> dict[str, Any]:
    """TokenSwift figures of the run just finished (all ``None`` without the plugin).

    Keys: ``ngram_acceptance`` (β), ``draft_time_share``, ``time_draft_s``,
    ``time_verify_s`` (engine-step time outside the proposer: verification forward,
    sampling and bookkeeping), ``steps_by_kind`` / ``accepted_by_kind`` (request-steps
    per drafting decision and the draft tokens accepted after each, this run only),
    ``draft_forward`` (which draft forward ran: ``native-bfloat16``, ``vllm: <why>``, ...),
    ``plugin_stats`` (raw dict).
    """
    res: dict[str, Any] = {"ngram_acceptance": None, "draft_time_share": None,
                           "time_draft_s": None, "time_verify_s": None, "plugin_stats": None,
                           "steps_by_kind": None, "accepted_by_kind": None, "draft_forward": None}
    get = _plugin_fn("get_engine_stats")
    if get is None:
        return res
    try:
        st = get(llm)
    except Exception:
        logger.debug("get_engine_stats failed", exc_info=True)
        return res
    if not isinstance(st, dict):
        return res
    if not was_reset and isinstance(before, dict):
        st = {**st, **counters.counter_delta(before, st)}
        chains = st.get("verified_drafts") or 0
        nst = st.get("num_speculative_tokens") or k
        st["ngram_acceptance"] = (st.get("accepted_ngram", 0) / (nst * chains)) if chains else None
        tot = st.get("time_total_s") or 0
        st["draft_time_share"] = (st.get("time_draft_s", 0) / tot) if tot else None
    res["plugin_stats"] = st
    res["steps_by_kind"] = st.get("steps_by_kind")
    res["accepted_by_kind"] = st.get("accepted_by_kind")
    res["draft_forward"] = st.get("draft_forward") if isinstance(st.get("draft_forward"), str) else None
    res["ngram_acceptance"] = st.get("ngram_acceptance")
    res["draft_time_share"] = st.get("draft_time_share")
    res["time_draft_s"] = st.get("time_draft_s")
    if st.get("time_verify_s") is not None:
        res["time_verify_s"] = st["time_verify_s"]
    elif st.get("time_total_s") is not None and st.get("time_draft_s") is not None:
        res["time_verify_s"] = max(0.0, st["time_total_s"] - st["time_draft_s"])
    return res
