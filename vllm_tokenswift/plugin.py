"""The ``vllm.general_plugins`` entry point (``tokenswift = vllm_tokenswift.plugin:register``).

vLLM calls :func:`register` once in every process (API server, offline front end, engine
core, workers) before configs are built; it applies the plugin's patches
(:mod:`vllm_tokenswift.patches`, where every change to vLLM is listed).
"""

from __future__ import annotations


def register() -> None:
    """Install the plugin's patches (idempotent; never raises): :func:`vllm_tokenswift.patches.register`."""
    from vllm_tokenswift.patches import register as _register

    _register()
