"""`vllm-tokenswift paths`: JSON by default, one bare path with --model/--heads."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_tokenswift.assets_cli import DEMO_HEADS, DEMO_MODEL


def _run(*args):
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.cli", "paths", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_paths_json_and_bare():
    d = json.loads(_run())
    assert d["model"] == str(DEMO_MODEL) and d["heads"] == str(DEMO_HEADS)
    assert _run("--model").strip() == str(DEMO_MODEL)
    assert _run("--heads").strip() == str(DEMO_HEADS)
    assert (DEMO_MODEL / "config.json").is_file()
