"""`vllm-tokenswift paths` (JSON by default, one bare path with --model/--heads) and the
model names (``--model smollm2`` / ``--model tiny``) of generate, demo and bench."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from vllm_tokenswift.cli import models
from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR, SMOLLM2_HEADS, TINY_HEADS, TINY_MODEL


def _run(*args):
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.cli", "paths", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_paths_json_and_bare():
    smollm2 = str(models.model_dir())
    d = json.loads(_run())
    assert set(d) == {"model", "heads", "tiny_model", "tiny_heads", "prompts"}
    assert d["model"] == smollm2 and d["heads"] == str(SMOLLM2_HEADS)
    assert d["tiny_model"] == str(DEMO_MODEL) and d["tiny_heads"] == str(DEMO_HEADS)
    assert d["prompts"] == sorted(str(p) for p in PROMPTS_DIR.glob("*.txt")) and len(d["prompts"]) == 18
    # `paths` made sure the model is there (fetching it if needed)
    assert models.check_model_folder(smollm2) is None
    assert _run("--model") == smollm2 + "\n"
    assert _run("--heads") == str(SMOLLM2_HEADS) + "\n"
    assert (DEMO_MODEL / "config.json").is_file() and (DEMO_HEADS / "tokenswift_heads.json").is_file()
    assert SMOLLM2_HEADS.parent == DEMO_HEADS.parent and SMOLLM2_HEADS.name == "smollm2-heads"


def test_paths_no_fetch_prints_the_location(tmp_path):
    import os

    env = dict(os.environ, VLLM_TOKENSWIFT_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.cli", "paths", "--model", "--no-fetch"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{tmp_path}/models/SmolLM2-135M-Instruct\n"
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_model_names_resolve_to_folders_and_their_heads():
    assert TINY_MODEL == DEMO_MODEL and TINY_HEADS == DEMO_HEADS
    assert models.resolve_target("tiny") == (str(DEMO_MODEL), str(DEMO_HEADS))
    assert models.resolve_target("TINY", "/my/heads") == (str(DEMO_MODEL), "/my/heads")
    smollm2 = str(models.model_dir())
    assert models.resolve_target("smollm2", fetch=False) == (smollm2, str(SMOLLM2_HEADS))
    # a folder: the heads follow it when they are known, else none
    assert models.resolve_target(str(DEMO_MODEL)) == (str(DEMO_MODEL), str(DEMO_HEADS))
    assert models.resolve_target(smollm2, fetch=False) == (smollm2, str(SMOLLM2_HEADS))
    assert models.resolve_target("/some/other/model") == ("/some/other/model", None)
    assert models.resolve_target("Qwen/Qwen2.5-7B", "/h") == ("Qwen/Qwen2.5-7B", "/h")


def _parse(*argv):
    from vllm_tokenswift.cli import build_parser

    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_generate_and_demo_default_to_smollm2(command):
    from vllm_tokenswift.cli.generate import _resolve

    args = _parse(command)
    assert args.model == "smollm2" and args.heads is None
    assert (args.num_spec_tokens, args.kv_budget) == (8, 1024)
    args = _parse(command, "--model", "tiny")
    _resolve(args, sys.stdout, sys.stderr)
    assert (args.model, args.heads) == (str(DEMO_MODEL), str(DEMO_HEADS))


def test_generate_refuses_missing_heads_and_small_windows(tmp_path):
    from vllm_tokenswift.cli.generate import _resolve, _window

    args = _parse("generate", "--model", "tiny", "--heads", str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="holds no heads"):
        _resolve(args, sys.stdout, sys.stderr)
    args = _parse("generate", "--model", "tiny", "--heads", str(tmp_path / "none"),
                  "--tokenswift-config", '{"use_heads": false}')
    _resolve(args, sys.stdout, sys.stderr)  # no heads needed
    args = _parse("generate", "--model", str(tmp_path / "no-such-model"))
    with pytest.raises(SystemExit, match="does not exist"):
        _resolve(args, sys.stdout, sys.stderr)
    # the tiny model's window is 20,480 tokens
    args = _parse("generate", "--model", "tiny")
    _resolve(args, sys.stdout, sys.stderr)
    assert _window(args, 20480) == (20480, None)
    # max_model_len is raised to the draft KV budget (the plugin refuses a budget above it)
    assert _window(args, 300) == (1024, None)
    args.ts_cfg = {"kv_budget": 512}
    assert _window(args, 300) == (512, None)
    args.ts_cfg = {"draft_kv": "full"}
    assert _window(args, 300) == (300, None)
    args.ts_cfg = {}
    with pytest.raises(SystemExit, match=r"window of 20480 tokens.*at least --yarn 2"):
        _window(args, 20481)
    args = _parse("generate", "--model", "tiny", "--yarn", "2")
    _resolve(args, sys.stdout, sys.stderr)
    mml, ov = _window(args, 30000)
    assert mml == 30000 and ov["max_position_embeddings"] == 40960
    assert ov["rope_parameters"]["rope_type"] == "yarn" and ov["rope_parameters"]["factor"] == 2.0
    with pytest.raises(SystemExit, match=r"\(with --yarn 2\).*at least --yarn 3"):
        _window(args, 50000)
    # a window smaller than the draft KV budget
    small = tmp_path / "small-model"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    args = _parse("generate", "--model", str(small), "--tokenswift-config", '{"use_heads": false}')
    _resolve(args, sys.stdout, sys.stderr)
    with pytest.raises(SystemExit, match=r"draft KV budget \(1024 tokens\) exceeds the model's window \(512"):
        _window(args, 300)


def test_bench_defaults_to_smollm2_and_its_heads(monkeypatch):
    from vllm_tokenswift.bench import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench"])
    assert args.model == "smollm2" and args.heads is None
    cfg = cli.config_from_args(args, fetch=False)
    assert cfg.model == str(models.model_dir()) and cfg.heads == str(SMOLLM2_HEADS)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = cli.config_from_args(parser.parse_args(["bench"]))  # reads the window: needs the model
    assert cfg.gen_lens == [2048, 4096, 6144]
    cfg = cli.config_from_args(parser.parse_args(["bench", "--yarn", "2"]))
    assert cfg.gen_lens == [2048, 4096, 8192, 14336] and cfg.yarn == 2.0
