"""vllm-tokenswift: TokenSwift (Wu et al., ICML 2025) as a vLLM speculative-decoding proposer.

Turned on through vLLM's own speculative config once the package is installed (the
``vllm.general_plugins`` entry point ``tokenswift`` loads :func:`vllm_tokenswift.plugin.register`
in every vLLM process)::

    LLM(model=M, speculative_config={"method": "tokenswift", "model": HEADS,
                                     "num_speculative_tokens": 4,
                                     "tokenswift": {"kv_budget": 4096}})

The package is one folder per layer; a module imports only its own layer and the ones above
it in this list (``tests/test_architecture.py`` checks it):

``core/``
    The engine-free algorithm: ``config`` (settings), ``ngram`` (n-gram table), ``chain``
    (candidates to one draft chain), ``penalty`` (windowed repetition penalty, min_p),
    ``draft_sampling`` (draft distributions and draws), ``heads`` (draft heads), ``kv_view``
    (budgeted KV views), ``step`` (the values one engine step passes between the proposer's
    steps), ``request_state``, ``stats`` (the proposer's counters), ``figures`` (Distinct-n,
    α and vLLM's counters), and ``policy/`` (the drafting strategies: ``adaptive``,
    ``paper``, ``cycle``, their ``decision`` and ``estimates``). No vLLM.
``compat/``
    The supported vLLM versions and ``patching``, the fail-closed monkey-patch helper.
``kernels/``
    The CPU attention kernel: its C source, ``build`` (compile and load), ``verify_attention``
    (binding, argument checks, reference) and ``cpu_attention`` (which rows of vLLM's CPU
    attention it computes).
``engine/``
    The proposer (``proposer``: the five-step pipeline) and its vLLM-facing parts:
    ``step_input`` (the runner's step as a typed value), ``target`` (hooks and the draft
    forward), ``drafter``, ``kv_cache`` (key layouts), ``tensor_parallel``, ``stats_rpc`` and
    ``prometheus`` (the counters across processes).
``patches/``
    Every change to vLLM, one module per subsystem, each ``Patch`` record beside its
    replacement functions, and the registry that applies them.
``cli/``, ``bench/``, ``training/``
    The ``vllm-tokenswift`` commands (``serve``, ``generate``, ``demo``, ``paths``,
    ``fetch-model``), the benchmarks and the cost probe, and head training.
"""

__version__ = "0.1.0"

#: Class path vLLM's ``custom_class`` method imports (set by the plugin).
PROPOSER_CLASS_PATH = "vllm_tokenswift.engine.proposer.TokenSwiftProposer"
