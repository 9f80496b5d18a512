"""``examples/``: the short scripts a user copies.

Every example parses, says what it does in a module docstring that shows how to run it,
stays short, and answers ``--help`` without importing vLLM. ``train_heads.py`` trains two
steps on the bundled demo model and its output loads as heads; one engine on the demo
model runs ``offline_batch.py`` and ``read_metrics.py``'s report on it (the only engine
this file starts).
"""

from __future__ import annotations

import ast
import importlib.util
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))
#: longest an example may grow (lines, docstring included): examples are read, then copied
MAX_LINES = 100


def _load(name: str):
    """``examples/<name>.py`` imported as a module (``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_documented_examples_are_there():
    assert EXAMPLES == ["offline_batch.py", "openai_client.py", "read_metrics.py", "train_heads.py"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_is_short_documented_and_a_script(name):
    """A module docstring that shows its own command line, at most MAX_LINES lines, and a
    ``main`` run under ``if __name__ == "__main__"``."""
    src = (EXAMPLES_DIR / name).read_text(encoding="utf-8")
    tree = ast.parse(src, filename=name)
    doc = ast.get_docstring(tree)
    assert doc and f"python examples/{name}" in doc
    assert len(src.splitlines()) <= MAX_LINES
    funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "main" in funcs
    assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_answers_without_importing_vllm(name, monkeypatch, capsys):
    """``--help`` exits 0 with the script's usage, run as ``__main__``; vLLM (seconds to
    import) is imported only after the arguments are parsed: here any import of it fails."""
    monkeypatch.setitem(sys.modules, "vllm", None)          # `import vllm...` raises ImportError
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES_DIR / name), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLES_DIR / name), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert capsys.readouterr().out.startswith(f"usage: {name}")


def test_openai_client_keeps_the_speculative_decoding_samples():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.796e+09',
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
        'vllm_tokenswift:draft_steps_total{kind="ngram",engine="0",model_name="m"} 7.0',
        "# HELP vllm_tokenswift:draft_seconds_total Seconds spent in the proposer",
        'process_cpu_seconds_total 3.5'])
    assert _load("openai_client").spec_metric_lines(text) == [
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0',
        'vllm_tokenswift:draft_steps_total{kind="ngram",engine="0",model_name="m"} 7.0']


def test_train_heads_writes_heads_for_the_model(tmp_path, capsys):
    """Two steps on the bundled demo model and book openings (the example's defaults but
    shorter): the folder it prints loads as 3 heads of the model's hidden size, and the
    ``LLM(...)`` line it prints names the model and that folder."""
    from vllm_tokenswift.core.heads import load_heads

    res = _load("train_heads").main(["--out", str(tmp_path / "heads"), "--steps", "2", "--seq-len", "64",
                                     "--batch-size", "1"])
    out = capsys.readouterr().out
    assert res.completed and res.steps_done == 2 and res.heads_dir == tmp_path / "heads"
    heads = load_heads(res.heads_dir, hidden_size=384)      # the demo model's; raises if they differ
    assert heads.num_heads == 3
    assert f"heads: {res.heads_dir}" in out
    assert f'"method": "tokenswift", "model": "{res.heads_dir}"' in out and "demo-model" in out


@pytest.mark.engine
def test_offline_batch_then_read_metrics_on_the_demo_model(monkeypatch, capsys):
    """One TokenSwift engine on the demo model: both samplings generate every token, and the
    report reads the plugin's counters (every request-step booked by decision) and vLLM's
    spec-decode counters from the same engine."""
    from vllm_tokenswift.bench.harness import teardown_engine

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")       # GiB; vLLM's CPU default sizes it from RAM
    batch = _load("offline_batch")
    llm = batch.main(["--model", "tiny", "--max-tokens", "48", "--prompts", *map(str, batch.PROMPTS[:2])])
    try:
        stats = _load("read_metrics").print_metrics(llm)
    finally:
        teardown_engine(llm)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" in ")[0] for ln in lines if " tokens in " in ln] == [
        "greedy: 2 prompts, 96 tokens", "paper's sampling: 2 prompts, 96 tokens"]
    assert stats["num_speculative_tokens"] == 8
    # one request-step per generated token that was not accepted as a draft (the prefill's excluded)
    assert 0 < sum(stats["steps_by_kind"].values()) <= 2 * 2 * 48
    assert any(ln.startswith("TokenSwift: acceptance rate") for ln in lines)
    assert any(ln.startswith("  vllm:spec_decode_num_drafts = ") for ln in lines)
