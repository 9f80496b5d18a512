"""Config validation, config translation, CLI alias and version pinning (no engine)."""

import argparse

import pytest

from vllm_tokenswift import PROPOSER_CLASS_PATH
from vllm_tokenswift.compat import UnsupportedVLLMVersion, check_vllm_version, is_supported
from vllm_tokenswift.config import TokenSwiftConfig, TokenSwiftConfigError
from vllm_tokenswift.plugin import (add_tokenswift_cli_args, apply_tokenswift_cli_args,
                                    translate_speculative_config)


def test_defaults_match_the_documented_ones():
    cfg = TokenSwiftConfig.from_speculative_dict({"method": "tokenswift", "model": "/h"})
    assert (cfg.kv_budget, cfg.sink_tokens, cfg.ngram_n, cfg.ngram_topk) == (4096, 16, 4, 20)
    assert cfg.tree == [1, 3, 3, 3] and cfg.draft_kv == "dynamic" and cfg.use_heads is True
    assert cfg.heads == "/h" and cfg.num_speculative_tokens == 4


@pytest.mark.parametrize("bad, msg", [
    ({"kv_budget": 0}, "tokenswift.kv_budget"),
    ({"draft_kv": "half"}, "tokenswift.draft_kv"),
    ({"tree": [1, 3, 3]}, "tree has 3 entries"),
    ({"tree": [1, 0, 3, 3]}, "tree entries must be >= 1"),
    ({"ngram_n": 1}, "tokenswift.ngram_n"),
    ({"kv_bugdet": 10}, "tokenswift.kv_bugdet"),
    ({"use_heads": True, "heads": None}, "no heads checkpoint"),
])
def test_invalid_settings_name_the_field(bad, msg):
    spec = {"method": "tokenswift", "tokenswift": bad}
    if "heads" not in bad:
        spec["model"] = "/h"
    with pytest.raises(TokenSwiftConfigError, match=msg):
        TokenSwiftConfig.from_speculative_dict(spec)


def test_budget_checked_against_block_size():
    cfg = TokenSwiftConfig.parse({"kv_budget": 64, "use_heads": False})
    cfg.check_block_size(16)
    with pytest.raises(TokenSwiftConfigError, match="too small for block_size=32"):
        cfg.check_block_size(32)


class _Args:
    def __init__(self, sc, pp=1):
        self.speculative_config = sc
        self.additional_config = {}
        self.pipeline_parallel_size = pp
        self.spec_method = self.spec_model = self.spec_tokens = None


def test_translation_to_custom_class():
    a = _Args({"method": "tokenswift", "model": "/heads", "num_speculative_tokens": 6,
               "tokenswift": {"kv_budget": 2048}})
    translate_speculative_config(a)
    assert a.speculative_config == {"method": "custom_class", "model": PROPOSER_CLASS_PATH,
                                    "num_speculative_tokens": 6}
    ts = a.additional_config["tokenswift"]
    assert ts["kv_budget"] == 2048 and ts["heads"] == "/heads" and ts["num_speculative_tokens"] == 6


def test_translation_of_short_flags_and_errors():
    a = _Args(None)
    a.spec_method, a.spec_model, a.spec_tokens = "tokenswift", "/heads", 5
    translate_speculative_config(a)
    assert a.speculative_config["model"] == PROPOSER_CLASS_PATH
    assert a.additional_config["tokenswift"]["num_speculative_tokens"] == 5
    assert a.spec_method is None
    with pytest.raises(TokenSwiftConfigError, match="pipeline_parallel_size"):
        translate_speculative_config(_Args({"method": "tokenswift", "model": "/h"}, pp=2))
    with pytest.raises(TokenSwiftConfigError, match="tokenswift.sink_tokens"):
        translate_speculative_config(_Args({"method": "tokenswift", "model": "/h",
                                            "tokenswift": {"sink_tokens": -1}}))
    other = _Args({"method": "ngram", "num_speculative_tokens": 4})
    translate_speculative_config(other)
    assert other.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}


def test_speculative_model_alias():
    p = argparse.ArgumentParser()
    p.add_argument("--spec-method", choices=["ngram", "eagle"])
    add_tokenswift_cli_args(p)
    add_tokenswift_cli_args(p)  # idempotent
    args = p.parse_args(["--speculative-model", "tokenswift", "--tokenswift-heads", "/h",
                         "--tokenswift-config", '{"kv_budget": 1024, "num_speculative_tokens": 6}'])
    ea = _Args(None)
    apply_tokenswift_cli_args(ea, args)
    assert ea.speculative_config == {"method": "tokenswift", "num_speculative_tokens": 6, "model": "/h",
                                     "tokenswift": {"kv_budget": 1024}}
    assert p.parse_args(["--spec-method", "tokenswift"]).spec_method == "tokenswift"
    assert "--speculative-model" in p.format_help()
    with pytest.raises(ValueError, match="need --speculative-model tokenswift"):
        apply_tokenswift_cli_args(_Args(None), p.parse_args(["--tokenswift-heads", "/h"]))


def test_vllm_serve_help_shows_the_alias():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    text = parser.format_help()
    assert "--speculative-model" in text and "--tokenswift-heads" in text
    args = parser.parse_args(["--model", "m", "--speculative-model", "tokenswift", "--tokenswift-heads", "/h"])
    ea = AsyncEngineArgs.from_cli_args(args)
    assert ea.speculative_config["method"] == "tokenswift" and ea.speculative_config["model"] == "/h"


def test_version_pin():
    assert is_supported("0.32.0") and is_supported("0.32.4+cpu")
    assert not is_supported("0.31.9") and not is_supported("0.33.0")
    with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM >=0.32.0,<0.33"):
        check_vllm_version("0.31.1")
    assert check_vllm_version().startswith("0.32")
