"""Locations of the bundled demo model, heads and prompts, and ``vllm-tokenswift paths``."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_MODEL = ASSETS / "demo-model"
DEMO_HEADS = ASSETS / "demo-heads"
PROMPTS_DIR = ASSETS / "prompts"


def bundled_prompts() -> list[Path]:
    """Bundled prompt files (public-domain book openings), sorted by name."""
    return sorted(PROMPTS_DIR.glob("*.txt"))


def default_prompt() -> Path:
    """The prompt the demo uses: the first ``*-2k.txt`` file, else the first prompt.

    Raises:
        FileNotFoundError: if the package ships no prompts.
    """
    files = bundled_prompts()
    if not files:
        raise FileNotFoundError(f"no bundled prompts in {PROMPTS_DIR}")
    two_k = [f for f in files if f.name.endswith("-2k.txt")]
    return (two_k or files)[0]


def paths() -> dict:
    """``{"model": ..., "heads": ..., "prompts": [...]}`` as absolute path strings."""
    return {"model": str(DEMO_MODEL), "heads": str(DEMO_HEADS),
            "prompts": [str(p) for p in bundled_prompts()]}


def add_parser(sub) -> None:
    p = sub.add_parser("paths", help="print the installed locations of the bundled model, heads and prompts "
                                     "(JSON, or one bare path with --model/--heads for shell use)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", action="store_true", help="print only the demo model folder")
    g.add_argument("--heads", action="store_true", help="print only the demo heads folder")
    p.set_defaults(func=_print_paths)


def _print_paths(args) -> int:
    d = paths()
    if args.model:
        print(d["model"])
    elif args.heads:
        print(d["heads"])
    else:
        print(json.dumps(d, indent=2))
    return 0
