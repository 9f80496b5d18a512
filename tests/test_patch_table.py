"""The README's table of patches is the Patch records, not a second hand-kept copy: the text
between its markers must equal ``python -m vllm_tokenswift.patches --markdown``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_tokenswift import patches

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_patch_table_is_generated_from_the_records():
    text = README.read_text()
    assert text.count(patches.TABLE_BEGIN) == 1 and text.count(patches.TABLE_END) == 1
    block = text.split(patches.TABLE_BEGIN, 1)[1].split(patches.TABLE_END, 1)[0]
    assert block.strip("\n") == patches.markdown_table().strip("\n"), (
        "README's patch table differs from the records: paste the output of "
        "`python -m vllm_tokenswift.patches --markdown` between its markers")


def test_the_table_has_one_row_per_patch_with_its_flags():
    rows = patches.markdown_table().splitlines()[2:]
    assert [r.split(" | ")[0].removeprefix("| ").split(" ")[0].strip("`") for r in rows] == \
        [p.name for p in patches.PATCHES]
    by_name = dict(zip((p.name for p in patches.PATCHES), rows))
    assert "(optional, cpu only)" in by_name["cpu-verify-attention"]
    assert "(optional)" in by_name["draft-free-sampling"] and "optional" not in by_name["engine-args"].split(" | ")[0]
    assert "api-server-metrics" in by_name["engine-args"]           # the record says what its code does


def test_the_command_prints_the_table():
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.patches", "--markdown"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == patches.markdown_table()
