"""The proposer (:mod:`~vllm_tokenswift.engine.proposer`) and its vLLM-facing parts: the
runner's step as a typed value (:mod:`~vllm_tokenswift.engine.step_input`), the target's
hooks and draft forward (:mod:`~vllm_tokenswift.engine.target`), the drafter
(:mod:`~vllm_tokenswift.engine.drafter`), KV key layouts
(:mod:`~vllm_tokenswift.engine.kv_cache`), tensor parallelism
(:mod:`~vllm_tokenswift.engine.tensor_parallel`) and the counters across processes
(:mod:`~vllm_tokenswift.engine.stats_rpc`, :mod:`~vllm_tokenswift.engine.prometheus`).
"""
