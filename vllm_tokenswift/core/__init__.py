"""The engine-free algorithm of TokenSwift (paper Sec 3): settings, the n-gram table and
chains, the windowed penalty and draft distributions, the draft heads, the budgeted KV views,
the values one engine step passes between the proposer's steps, per-request state, counters,
and the drafting policies (:mod:`vllm_tokenswift.core.policy`). Nothing here imports vLLM at
module level; each module has unit tests of its own.
"""
