"""``vllm-tokenswift`` command line: one sub-command per job.

Each sub-command lives in its own module exposing ``add_parser(subparsers)``;
this file only dispatches, so the modules stay independent.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: sub-command name -> module with ``add_parser(subparsers)`` that sets ``func``.
SUBCOMMANDS = {
    "paths": "vllm_tokenswift.cli.assets",
    "fetch-model": "vllm_tokenswift.cli.assets",
    "serve": "vllm_tokenswift.cli.serve",
    "bench-serve": "vllm_tokenswift.cli.bench_serve",
    "generate": "vllm_tokenswift.cli.generate",
    "demo": "vllm_tokenswift.cli.generate",
    "train-heads": "vllm_tokenswift.training.cli",
    "eval-heads": "vllm_tokenswift.training.cli",
    "bench": "vllm_tokenswift.bench.cli",
    "bench-report": "vllm_tokenswift.bench.cli",
    "bench-table": "vllm_tokenswift.bench.cli",
    "probe": "vllm_tokenswift.bench.probe",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-tokenswift",
                                     description="TokenSwift speculative decoding for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    seen = set()
    for mod_name in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("vllm_tokenswift"):
                continue  # sub-command not built into this version
            raise
        mod.add_parser(sub)
        seen.add(mod_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
