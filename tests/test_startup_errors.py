"""Bad TokenSwift configurations fail at engine start, in the front end, with one clear
message, before any engine-core or worker process exists: missing heads, heads for a
different model or with another head count, a budget larger than max_model_len or too
small for the KV block size (CPU blocks are 128 tokens), num_speculative_tokens 0, a
lossy verification method, a missing plugin patch. The same holds for
`vllm-tokenswift serve`: it exits non-zero with the message on stderr."""

from __future__ import annotations

import subprocess

import pytest
from engine_utils import make_llm
from server_utils import multiprocess_env, serve_command
from tiny_models import build_random_heads, build_tiny_model, build_tiny_tokenizer

from vllm_tokenswift.compat import patching
from vllm_tokenswift.core.config import TokenSwiftConfigError
from vllm_tokenswift.compat.patching import PatchRecord, TokenSwiftPatchError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vllm_tokenswift.core.heads import DraftHeads, save_heads

    d = tmp_path_factory.mktemp("startup")
    model = build_tiny_model(d / "model", "llama", vocab_size=512, hidden_size=128, heads=4, kv_heads=2)
    build_tiny_tokenizer(d / "model", vocab_size=512)
    heads = build_random_heads(d / "heads", 128)
    other = build_random_heads(d / "heads-256", 256)
    four = save_heads(DraftHeads(128, 4), d / "heads-4")
    two = save_heads(DraftHeads(128, 2), d / "heads-2")
    return {"dir": d, "model": str(model), "heads": str(heads), "other": str(other), "four": str(four),
            "two": str(two)}


def _spec(heads, **ts):
    k = ts.pop("k", 4)
    extra = ts.pop("extra", {})
    return {"method": "tokenswift", "model": heads, "num_speculative_tokens": k, "tokenswift": ts, **extra}


@pytest.mark.parametrize("case, match", [
    ("missing_heads", r"heads checkpoint .*does-not-exist.* is not a folder"),
    ("other_model", r"hidden size 256, the target model has 128: the heads were trained for another model"),
    ("budget", r"kv_budget=8192 is larger than max_model_len=2048.*largest valid kv_budget is 2048"),
    ("k0", r"tokenswift.num_speculative_tokens: Input should be greater than or equal to 1"),
    ("no_heads", r"use_heads is true but no heads checkpoint was given"),
    # issue 12: a GPU-sized budget on CPU, where vLLM's default block is 128 tokens
    ("cpu_block", r"kv_budget=256 is too small for block_size=128.*smallest valid kv_budget is 384"),
    ("fewer_heads", r"hold 2 heads but tokenswift.num_heads=3: the largest valid num_heads is 2"),
    ("fly", r"rejection_sample_method=.fly. cannot be used with TokenSwift"),
])
def test_bad_config_fails_at_engine_start(tiny, case, match):
    kw = {}
    spec = {
        "missing_heads": lambda: _spec(str(tiny["dir"] / "does-not-exist"), kv_budget=256),
        "other_model": lambda: _spec(tiny["other"], kv_budget=256),
        "budget": lambda: _spec(tiny["heads"], kv_budget=8192),
        "k0": lambda: _spec(tiny["heads"], kv_budget=256, k=0),
        "no_heads": lambda: {"method": "tokenswift", "num_speculative_tokens": 4, "tokenswift": {}},
        "cpu_block": lambda: _spec(tiny["heads"], kv_budget=256),
        "fewer_heads": lambda: _spec(tiny["two"], kv_budget=256),
        "fly": lambda: _spec(tiny["heads"], kv_budget=256, extra={"rejection_sample_method": "fly"}),
    }[case]()
    if case == "cpu_block":
        kw["block_size"] = None  # the platform's default: 128 on CPU
    with pytest.raises(TokenSwiftConfigError, match=match) as ei:
        make_llm(tiny["model"], spec, max_model_len=2048, **kw)
    # one message, not a chain of engine-core tracebacks
    assert ei.value.__cause__ is None or isinstance(ei.value.__cause__, TokenSwiftConfigError)


@pytest.mark.engine  # starts vLLM engines
def test_more_heads_than_num_heads_start_and_generate(tiny):
    # issue 12: a checkpoint with more heads than num_heads passed the front end and then
    # crashed the worker; front end and worker now share the rule (the first num_heads
    # heads are used), so the engine starts and matches plain decoding
    from engine_utils import random_prompts, shutdown, token_ids
    from vllm import SamplingParams

    prompts = random_prompts([40, 70], 512)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm = make_llm(tiny["model"], _spec(tiny["four"], kv_budget=128), max_model_len=2048)
    try:
        got = token_ids(llm.generate(prompts, params, use_tqdm=False))
    finally:
        shutdown(llm)
    plain = make_llm(tiny["model"], None, max_model_len=2048)
    try:
        want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    finally:
        shutdown(plain)
    assert got == want and all(len(t) == 48 for t in got)


@pytest.fixture
def broken_patch():
    """Pretend one required patch failed to apply in this (front-end) process."""
    saved = patching.RECORDS.get("min-p-verification")
    patching.RECORDS["min-p-verification"] = PatchRecord(
        "min-p-verification", "failed", "simulated: apply_sampling_constraints changed", True)
    try:
        yield
    finally:
        patching.RECORDS["min-p-verification"] = saved


def test_missing_patch_refuses_tokenswift_only(tiny, broken_patch):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(TokenSwiftPatchError, match=r"min-p-verification: simulated") as ei:
        make_llm(tiny["model"], _spec(tiny["heads"], kv_budget=256), max_model_len=2048)
    assert "Outputs would silently differ" in str(ei.value)
    # engines without TokenSwift are unaffected (vLLM's original stays in place)
    cfg = EngineArgs(model=tiny["model"], dtype="float32", max_model_len=2048, skip_tokenizer_init=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_max": 4}).create_engine_config()
    assert cfg.speculative_config.method == "ngram"


def _serve(tiny, *flags, timeout=300):
    cmd = [*serve_command(), tiny["model"], "--port", "0", "--host", "127.0.0.1", "--dtype", "float32",
           "--max-model-len", "2048", "--enforce-eager", "--speculative-model", "tokenswift", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=multiprocess_env(VLLM_LOGGING_LEVEL="WARNING"))


@pytest.mark.engine  # runs `vllm-tokenswift serve` in a subprocess
@pytest.mark.parametrize("flags, message", [
    (["--tokenswift-heads", "OTHER", "--tokenswift-config", '{"kv_budget": 256, "sink_tokens": 0}',
      "--block-size", "32"], "the heads were trained for another model"),
    (["--tokenswift-heads", "HEADS", "--tokenswift-config", '{"kv_budget": 256}'],
     "The smallest valid kv_budget is 384"),
])
def test_serve_exits_with_the_message(tiny, flags, message):
    flags = [{"OTHER": tiny["other"], "HEADS": tiny["heads"]}.get(f, f) for f in flags]
    r = _serve(tiny, *flags)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    err_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(err_lines) == 1 and message in r.stderr, r.stderr[-3000:]
    # failed in the front end: no engine core was started
    out = r.stdout + r.stderr
    assert "EngineCore" not in out, out[-3000:]
