"""Patch of vLLM's OpenAI API server (``init_app_state``): the ``vllm_tokenswift:*``
counters on ``/metrics`` (``api-server-metrics``).
"""

from __future__ import annotations

import sys

from vllm_tokenswift.compat import patching
from vllm_tokenswift.compat.patching import Patch, Target
from vllm_tokenswift.patches.common import _ENTRY, _V32
from vllm_tokenswift.core.config import is_tokenswift_spec


def _api_server_absent() -> str | None:
    if _ENTRY not in sys.modules:
        return "no OpenAI API server in this process"
    return None


def ensure_api_server_metrics() -> None:
    """Apply ``api-server-metrics`` if the API server module was imported after
    :func:`register` ran (front end of a TokenSwift engine only)."""
    rec = patching.RECORDS.get("api-server-metrics")
    if rec is not None and rec.status == "not-needed" and _api_server_absent() is None:
        patching.apply(_API_METRICS)


def _patch_api_metrics(orig: dict) -> dict:
    orig_fn = orig[f"{_ENTRY}:init_app_state"]

    async def init_app_state(engine_client, state, args, supported_tasks=None):
        await orig_fn(engine_client, state, args, supported_tasks)
        vllm_config = getattr(engine_client, "vllm_config", None)
        if is_tokenswift_spec(getattr(vllm_config, "speculative_config", None)):
            from vllm_tokenswift.engine.prometheus import start_exporter

            state.tokenswift_metrics = start_exporter(engine_client)

    return {f"{_ENTRY}:init_app_state": init_app_state}


#: this subsystem's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
    Patch(
        name="api-server-metrics",
        targets=(Target(f"{_ENTRY}:init_app_state", "function",
                        "vllm.entrypoints.launchers.api_server.app_state.init_app_state",
                        ("engine_client", "state", "args", "supported_tasks")),),
        build=_patch_api_metrics,
        required=False,
        when=_api_server_absent,
        changes="after the API server's state is initialised, a TokenSwift engine's server starts a "
                "background task exporting TokenSwift's counters on /metrics (vllm_tokenswift:*)",
        why="the counters live in the worker; a Prometheus collector in the API server process "
            "fetches them with collective_rpc",
        upstream="vLLM's stat-logger plugins (vllm.stat_logger_plugins) get no engine client and no "
                 "worker data; no upstream issue filed from here",
        remove_when="vLLM lets proposers publish metrics through SchedulerStats or stat-logger plugins",
        versions={"0.32": _V32, "0.33": "same signature, entry.py still calls it by module name"},
    ),
)

_API_METRICS = PATCHES[0]
