"""The plugin's CPU attention kernel: the C source (``verify_attention.c``), its build and
loading (:mod:`~vllm_tokenswift.kernels.build`), its Python binding with the argument checks
and the reference it is tested against (:mod:`~vllm_tokenswift.kernels.verify_attention`), and
the vLLM CPU-attention glue that decides which rows it computes
(:mod:`~vllm_tokenswift.kernels.cpu_attention`). ``python -m vllm_tokenswift.kernels`` builds
it ahead of time (``scripts/setup.sh``, the CPU Docker image) and prints its status.
"""
