"""Benchmarking for vllm-tokenswift.

* :mod:`vllm_tokenswift.bench.roofline` -- pure-Python GPU roofline projection of
  AR / TokenSwift / n-gram / suffix decoding wall time (``vllm-tokenswift project``).
* :mod:`vllm_tokenswift.bench.harness` -- runs vLLM offline per method and setting
  and collects timing and speculative-decoding counters (``vllm-tokenswift bench``).
* :mod:`vllm_tokenswift.bench.report` -- pure functions turning result records into
  JSON, CSV, PNG plots and a markdown summary.

Importing this package does not import vLLM or torch.
"""
