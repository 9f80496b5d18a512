"""Where the bundled assets are: the demo model and heads, SmolLM2's heads, the prompts.

No imports from the rest of the package: :mod:`vllm_tokenswift.cli.models` (model fetching)
and :mod:`vllm_tokenswift.cli.assets` (``vllm-tokenswift paths`` / ``fetch-model``) both
read these locations.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEMO_MODEL = ASSETS / "demo-model"
DEMO_HEADS = ASSETS / "demo-heads"
#: the same folders under the name used on the command line (``--model tiny``)
TINY_MODEL = DEMO_MODEL
TINY_HEADS = DEMO_HEADS
#: TokenSwift heads trained for SmolLM2-135M-Instruct (the default target)
SMOLLM2_HEADS = ASSETS / "smollm2-heads"
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
