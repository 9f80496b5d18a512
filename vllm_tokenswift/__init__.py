"""vllm-tokenswift: TokenSwift (Wu et al., ICML 2025) as a vLLM speculative-decoding proposer.

Turned on through vLLM's own speculative config once the package is installed
(the ``vllm.general_plugins`` entry point ``tokenswift`` loads
:func:`vllm_tokenswift.plugin.register` in every vLLM process)::

    LLM(model=M, speculative_config={"method": "tokenswift", "model": HEADS,
                                     "num_speculative_tokens": 4,
                                     "tokenswift": {"kv_budget": 4096}})

Modules (one concept each): ``config`` (settings), ``heads`` (draft heads),
``ngram`` (n-gram table), ``kv_view`` (budgeted draft KV view), ``chain``
(candidates to one draft chain), ``penalty`` (windowed repetition penalty and
min_p), ``proposer`` (the vLLM-facing proposer), ``plugin`` (patches into vLLM),
``metrics`` (TokenSwift counters), ``cli`` (the ``vllm-tokenswift`` command).
"""

__version__ = "0.1.0"

#: Class path vLLM's ``custom_class`` method imports (set by the plugin).
PROPOSER_CLASS_PATH = "vllm_tokenswift.proposer.TokenSwiftProposer"
