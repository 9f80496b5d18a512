"""Bad TokenSwift configurations fail at engine start, in the front end, with one clear
message, before any engine-core or worker process exists: missing heads, heads for a
different model, a budget larger than max_model_len, num_speculative_tokens 0. The same
holds for `vllm serve`: the server process exits non-zero and prints the message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from engine_utils import make_llm
from tiny_models import build_random_heads, build_tiny_model, build_tiny_tokenizer

from vllm_tokenswift.config import TokenSwiftConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    model = build_tiny_model(d / "model", "llama", vocab_size=512, hidden_size=128, heads=4, kv_heads=2)
    build_tiny_tokenizer(d / "model", vocab_size=512)
    heads = build_random_heads(d / "heads", 128)
    other = build_random_heads(d / "heads-256", 256)
    return {"dir": d, "model": str(model), "heads": str(heads), "other": str(other)}


def _spec(heads, **ts):
    k = ts.pop("k", 4)
    return {"method": "tokenswift", "model": heads, "num_speculative_tokens": k, "tokenswift": ts}


@pytest.mark.parametrize("case, match", [
    ("missing_heads", r"heads checkpoint .*does-not-exist.* is not a folder"),
    ("other_model", r"hidden size 256, the target model has 128: the heads were trained for another model"),
    ("budget", r"kv_budget=8192 is larger than max_model_len=2048"),
    ("k0", r"tokenswift.num_speculative_tokens: Input should be greater than or equal to 1"),
    ("no_heads", r"use_heads is true but no heads checkpoint was given"),
])
def test_bad_config_fails_at_engine_start(tiny, case, match):
    spec = {
        "missing_heads": _spec(str(tiny["dir"] / "does-not-exist"), kv_budget=256),
        "other_model": _spec(tiny["other"], kv_budget=256),
        "budget": _spec(tiny["heads"], kv_budget=8192),
        "k0": _spec(tiny["heads"], kv_budget=256, k=0),
        "no_heads": {"method": "tokenswift", "num_speculative_tokens": 4, "tokenswift": {}},
    }[case]
    with pytest.raises(TokenSwiftConfigError, match=match) as ei:
        make_llm(tiny["model"], spec, max_model_len=2048)
    # one message, not a chain of engine-core tracebacks
    assert ei.value.__cause__ is None or isinstance(ei.value.__cause__, TokenSwiftConfigError)


def test_vllm_serve_exits_with_the_message(tiny):
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny["model"],
           "--port", "0", "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048",
           "--enforce-eager", "--speculative-model", "tokenswift",
           "--tokenswift-heads", tiny["other"], "--tokenswift-config", '{"kv_budget": 256}']
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "the heads were trained for another model" in out, out[-3000:]
    # failed in the front end: no engine core was started
    assert "EngineCore" not in out, out[-3000:]
