"""Benchmarking for vllm-tokenswift (the ``bench``, ``bench-report``, ``bench-table`` and
``probe`` commands).

* :mod:`~vllm_tokenswift.bench.harness` -- runs vLLM offline per method and setting and
  collects timing and speculative-decoding counters (``vllm-tokenswift bench``);
  :mod:`~vllm_tokenswift.bench.methods` the methods and settings,
  :mod:`~vllm_tokenswift.bench.prompts` the prompts, :mod:`~vllm_tokenswift.bench.segments`
  the per-segment rows of long requests.
* :mod:`~vllm_tokenswift.bench.report`, :mod:`~vllm_tokenswift.bench.settings_table` --
  pure functions turning result records into JSON, CSV, PNG plots and Markdown.
* :mod:`~vllm_tokenswift.bench.probe` -- the cost probe (``vllm-tokenswift probe``), with its
  own drafting policy (:mod:`~vllm_tokenswift.bench.probe_policy`), step profiler (a vLLM
  worker extension, :mod:`~vllm_tokenswift.bench.profiler`) and the attention-op
  micro-benchmark (:mod:`~vllm_tokenswift.bench.attention_op`). The library carries none of
  them: the probe installs them in its own engines.

Importing this package does not import vLLM or torch.
"""
