"""Config validation and bounds, front-end checks, config translation, CLI alias,
version pinning and the runner state-release hook (no engine)."""

import argparse
from types import SimpleNamespace

import pytest

from vllm_tokenswift import PROPOSER_CLASS_PATH, patches
from vllm_tokenswift.compat import patching
from vllm_tokenswift.compat import UnsupportedVLLMVersion, check_vllm_version, is_supported
from vllm_tokenswift.core.config import (MAX_NGRAM_TOPK, MAX_TREE_PATHS, MAX_TREE_WIDTH, TokenSwiftConfig,
                                    TokenSwiftConfigError)
from vllm_tokenswift.patches import outputs as patch_outputs
from vllm_tokenswift.patches import runner as patch_runner
from vllm_tokenswift.patches.engine_args import (add_tokenswift_cli_args, apply_tokenswift_cli_args,
                                                 translate_speculative_config)
from vllm_tokenswift.patches.runner import release_finished_states


@pytest.fixture(scope="module", autouse=True)
def _plugin_registered():
    # translate_speculative_config refuses to run unless the plugin's patches are
    # active in this process (fail closed), as they are in any vLLM process
    patches.register()


def test_defaults_match_the_documented_ones():
    cfg = TokenSwiftConfig.from_speculative_dict({"method": "tokenswift", "model": "/h"})
    assert (cfg.kv_budget, cfg.sink_tokens, cfg.ngram_n, cfg.ngram_topk) == (4096, 16, 4, 20)
    assert cfg.tree == [1, 3, 3, 3] and cfg.draft_kv == "dynamic" and cfg.use_heads is True
    assert cfg.heads == "/h" and cfg.num_speculative_tokens == 4
    t = cfg.policy_tuning
    assert (t.min_gain, t.draft_token_cost_prior, t.explore_every, t.explore_max,
            t.explore_beside_ngram, t.observe_past_cut, t.ngram_escape) == (0.05, 0.08, 48, 768, False, True, "sampled")


def test_policy_tuning_travels_to_the_worker_as_plain_json():
    """The plugin hands the settings to the workers as ``model_dump()`` in
    ``additional_config``; the nested tuning survives JSON and validates again."""
    import json

    cfg = TokenSwiftConfig.from_speculative_dict(
        {"method": "tokenswift", "model": "/h",
         "tokenswift": {"policy_tuning": {"explore_every": 0, "draft_token_cost_prior": 0.01,
                                          "observe_past_cut": False, "ngram_escape": False}}})
    again = TokenSwiftConfig.parse(json.loads(json.dumps(cfg.model_dump())))
    assert again == cfg and again.policy_tuning.explore_every == 0
    assert again.policy_tuning.observe_past_cut is False and again.policy_tuning.ngram_escape is False
    for esc in (True, "sampled"):
        cfg = TokenSwiftConfig.from_speculative_dict(
            {"method": "tokenswift", "model": "/h", "tokenswift": {"policy_tuning": {"ngram_escape": esc}}})
        assert TokenSwiftConfig.parse(json.loads(json.dumps(cfg.model_dump()))).policy_tuning.ngram_escape == esc
    assert again.policy_tuning.draft_token_cost_prior == 0.01 and again.policy_tuning.explore_max == 768


@pytest.mark.parametrize("bad, msg", [
    ({"kv_budget": 0}, "tokenswift.kv_budget"),
    ({"draft_kv": "half"}, "tokenswift.draft_kv"),
    ({"tree": [1, 3, 3]}, "tree has 3 entries"),
    ({"tree": [1, 0, 3, 3]}, "tree entries must be between 1 and 8"),
    ({"tree": [1, 9, 3, 3]}, "tree entries must be between 1 and 8"),
    ({"tree": [8, 8, 8, 8]}, "has 4096 paths; at most 256"),
    ({"ngram_topk": MAX_NGRAM_TOPK + 1}, "tokenswift.ngram_topk"),
    ({"ngram_n": 9}, "tokenswift.ngram_n"),
    ({"num_heads": 17, "tree": [1] * 18}, "tokenswift.num_heads"),
    ({"num_speculative_tokens": 65}, "tokenswift.num_speculative_tokens"),
    ({"ngram_n": 1}, "tokenswift.ngram_n"),
    ({"kv_bugdet": 10}, "tokenswift.kv_bugdet"),
    ({"use_heads": True, "heads": None}, "no heads checkpoint"),
    ({"policy_tuning": {"explore_evry": 4}}, "tokenswift.policy_tuning.explore_evry"),
    ({"policy_tuning": {"min_gain": -0.1}}, "tokenswift.policy_tuning.min_gain"),
    ({"policy_tuning": {"ngram_escape": "greedy"}}, "tokenswift.policy_tuning.ngram_escape"),
    ({"policy_tuning": {"explore_every": 100, "explore_max": 50}}, "explore_every=100 is larger than explore_max=50"),
])
def test_invalid_settings_name_the_field(bad, msg):
    spec = {"method": "tokenswift", "tokenswift": bad}
    if "heads" not in bad:
        spec["model"] = "/h"
    with pytest.raises(TokenSwiftConfigError, match=msg):
        TokenSwiftConfig.from_speculative_dict(spec)


def test_every_setting_that_sizes_per_step_work_is_bounded():
    # issue 12: settings whose size drives per-step work have upper bounds in the schema;
    # the budget and the sink are bounded by the engine (max_model_len, block size) in
    # the front-end check instead, and log_interval_s drives no per-step work
    engine_bounded = {"kv_budget", "sink_tokens"}
    no_step_work = {"log_interval_s"}
    props = TokenSwiftConfig.model_json_schema()["properties"]
    numeric = {k for k, v in props.items() if v.get("type") in ("integer", "number")}
    assert numeric >= {"kv_budget", "sink_tokens", "ngram_n", "ngram_topk", "num_speculative_tokens",
                       "num_heads", "ngram_min_conf", "log_interval_s"}
    unbounded = {k for k in numeric if "maximum" not in props[k]}
    assert unbounded == engine_bounded | no_step_work
    assert MAX_TREE_WIDTH ** 3 > MAX_TREE_PATHS  # the path bound is what limits wide trees


def test_budget_checked_against_block_size():
    cfg = TokenSwiftConfig.parse({"kv_budget": 64, "use_heads": False})
    cfg.check_block_size(16)
    with pytest.raises(TokenSwiftConfigError, match="too small for block_size=32"):
        cfg.check_block_size(32)
    # issue 12: the GPU-natural 256 on CPU (128-token blocks) names the smallest valid value
    cpu = TokenSwiftConfig.parse({"kv_budget": 256, "use_heads": False})
    with pytest.raises(TokenSwiftConfigError, match=r"The smallest valid kv_budget is 384 \(KV blocks"):
        cpu.check_block_size(128)
    assert cpu.min_kv_budget(128) == 384 and cpu.min_kv_budget(16) == 48
    TokenSwiftConfig.parse({"kv_budget": 384, "use_heads": False}).check_block_size(128)
    # the sink counts in whole blocks
    big_sink = TokenSwiftConfig.parse({"kv_budget": 384, "sink_tokens": 129, "use_heads": False})
    with pytest.raises(TokenSwiftConfigError, match=r"sink \(2 blocks\).*smallest valid kv_budget is 512"):
        big_sink.check_block_size(128)
    TokenSwiftConfig.parse({"kv_budget": 8, "draft_kv": "full", "use_heads": False}).check_block_size(128)


def test_budget_checked_against_max_model_len():
    cfg = TokenSwiftConfig.parse({"kv_budget": 4096, "use_heads": False})
    with pytest.raises(TokenSwiftConfigError, match="largest valid kv_budget is 2048"):
        cfg.check_max_model_len(2048)
    cfg.check_max_model_len(4096)
    small = TokenSwiftConfig.parse({"kv_budget": 256, "use_heads": False})
    with pytest.raises(TokenSwiftConfigError, match="no tokenswift.kv_budget fits max_model_len=256 with "
                                                    "block_size=128.*smallest valid budget is 384"):
        small.check_engine(block_size=128, max_model_len=256, hidden_size=64)
    small.check_engine(block_size=16, max_model_len=256, hidden_size=64)


def test_head_count_rule_is_the_same_in_front_end_and_worker(tmp_path):
    import torch

    from vllm_tokenswift.core.heads import DraftHeads, HeadsLoadError, inspect_heads, load_heads, save_heads

    for n in (2, 3, 4):
        save_heads(DraftHeads(32, n), tmp_path / f"h{n}")
    for n in (2, 3, 4):
        info = inspect_heads(tmp_path / f"h{n}")
        cfg = TokenSwiftConfig.parse({"heads": str(tmp_path / f"h{n}"), "num_heads": 3, "tree": [1, 3, 3, 3]})
        front_ok = worker_ok = True
        try:
            cfg.check_heads_info(info, 32)
        except TokenSwiftConfigError as e:
            front_ok = False
            assert f"hold {n} heads but tokenswift.num_heads=3: the largest valid num_heads is {n}" in str(e)
        try:
            load_heads(tmp_path / f"h{n}", hidden_size=32, num_heads=3, dtype=torch.float32)
        except HeadsLoadError:
            worker_ok = False
        assert front_ok == worker_ok == (n >= 3), n  # more heads: the first num_heads are used
    with pytest.raises(TokenSwiftConfigError, match="hidden size 32, the target model has 64"):
        TokenSwiftConfig.parse({"heads": str(tmp_path / "h3")}).check_heads_info(inspect_heads(tmp_path / "h3"), 64)


def test_attention_type_checked():
    cfg = TokenSwiftConfig.parse({"use_heads": False})
    cfg.check_attention(SimpleNamespace(layer_types=["full_attention"] * 2))
    with pytest.raises(TokenSwiftConfigError, match="full-attention decoder models only"):
        cfg.check_attention(SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(TokenSwiftConfigError, match="full-attention decoder models only"):
        cfg.check_attention(SimpleNamespace(use_sliding_window=True))


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
    for method in ("fly", "synthetic", "block"):  # only lossless 'standard' verification
        with pytest.raises(TokenSwiftConfigError, match=f"rejection_sample_method='{method}' cannot be used"):
            translate_speculative_config(_Args({"method": "tokenswift", "model": "/h",
                                                "rejection_sample_method": method}))
    std = _Args({"method": "tokenswift", "model": "/h", "rejection_sample_method": "standard"})
    translate_speculative_config(std)
    assert std.speculative_config["rejection_sample_method"] == "standard"


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
    assert is_supported("0.33.0") and is_supported("0.33.2")
    assert not is_supported("0.31.9") and not is_supported("0.34.0") and not is_supported("0.34.0rc1")
    with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM >=0.32.0,<0.34"):
        check_vllm_version("0.31.1")
    with pytest.raises(UnsupportedVLLMVersion, match="installed: 0.34.0"):
        check_vllm_version("0.34.0")
    assert check_vllm_version().startswith("0.32")


class _Drafter:
    def __init__(self, states):
        self.states = dict.fromkeys(states)

    def release_requests(self, ids):
        gone = [rid for rid in ids if rid in self.states]
        for rid in gone:
            del self.states[rid]
        return len(gone)


def _sched_out(finished=(), preempted=None, resumed=()):
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=preempted,
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def test_state_release_hook_frees_finished_preempted_resumed():
    ts_spec = SimpleNamespace(method="custom_class", model=PROPOSER_CLASS_PATH)
    drafter = _Drafter(["a", "b", "c", "d"])
    runner = SimpleNamespace(speculative_config=ts_spec, drafter=drafter)
    # a step that schedules nothing but flushes finished ids (no proposer call)
    assert release_finished_states(runner, _sched_out(finished={"a", "zz"})) == 1
    assert release_finished_states(runner, _sched_out(preempted={"b"}, resumed={"c"})) == 2
    assert set(drafter.states) == {"d"}
    assert release_finished_states(runner, _sched_out()) == 0
    # other engines and drafters without the method are untouched
    ngram = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", model=None), drafter=drafter)
    assert release_finished_states(ngram, _sched_out(finished={"d"})) == 0 and "d" in drafter.states
    assert release_finished_states(SimpleNamespace(speculative_config=ts_spec, drafter=object()),
                                   _sched_out(finished={"d"})) == 0


def test_draft_free_steps_take_the_plain_sampler():
    """``draft-free-sampling``: on TokenSwift engines a step with no draft tokens gives vLLM's
    ``_sample`` no spec-decode metadata (plain decoding's sampler); steps with drafts, and
    every step of other engines, keep the metadata (the rejection sampler)."""

    calls = []

    def orig(self, logits, spec_decode_metadata):
        calls.append(spec_decode_metadata)
        return "out"

    patch = next(p for p in patches.PATCHES if p.name == "draft-free-sampling")
    assert patching.RECORDS[patch.name].status == "applied"
    sample = patch_runner._patch_draft_free_sampling({patch.targets[0].path: orig})[patch.targets[0].path]
    ts = SimpleNamespace(speculative_config=SimpleNamespace(method="custom_class", model=PROPOSER_CLASS_PATH))
    other = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", model=None))
    none_ = SimpleNamespace(max_spec_len=0)
    some = SimpleNamespace(max_spec_len=3)
    assert sample(ts, "logits", none_) == "out"
    sample(ts, "logits", some)
    sample(other, "logits", none_)
    sample(ts, "logits", None)
    assert calls == [None, some, none_, None]


def test_draft_ids_travel_with_the_step_output():
    """``draft-ids-in-output``: a TokenSwift runner tags a copy of its output with the step's
    draft ids (request ids frozen); the scheduler keeps them and post_step hands them over
    without the executor RPC. Untagged outputs (other engines, async scheduling, empty
    steps) leave post_step to vLLM."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput


    patch = next(p for p in patches.PATCHES if p.name == "draft-ids-in-output")
    assert patching.RECORDS[patch.name].status == "applied"
    live_ids = ["a", "b"]
    calls = []
    out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
    empty = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    orig = {
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens": lambda self, g: self.out,
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output":
            lambda self, so, mro: calls.append(("update", so)) or {},
        "vllm.v1.engine.core:EngineCore.post_step": lambda self, ex: calls.append(("rpc", ex)),
    }
    fns = patch_outputs._patch_drafts_in_output(orig)
    sample = fns["vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"]
    update = fns["vllm.v1.core.sched.scheduler:Scheduler.update_from_output"]
    post = fns["vllm.v1.engine.core:EngineCore.post_step"]
    ts_spec = SimpleNamespace(method="custom_class", model=PROPOSER_CLASS_PATH)

    def runner(spec, o, async_=False):
        return SimpleNamespace(speculative_config=spec, use_async_scheduling=async_, out=o,
                               take_draft_token_ids=lambda: DraftTokenIds(live_ids, [[5, 6], []]))

    tagged = sample(runner(ts_spec, out), None)
    assert tagged is not out and not hasattr(out, patch_outputs._DRAFTS_ATTR)   # a copy is tagged
    drafts = getattr(tagged, patch_outputs._DRAFTS_ATTR)
    live_ids.append("c")                                                 # the runner's list moves on
    assert drafts.req_ids == ["a", "b"] and drafts.draft_token_ids == [[5, 6], []]
    ngram_spec = SimpleNamespace(method="ngram", model=None)
    assert sample(runner(ngram_spec, out), None) is out
    assert sample(runner(ts_spec, out, async_=True), None) is out
    assert sample(runner(ts_spec, empty), None) is empty

    got = []
    sched = SimpleNamespace(update_draft_token_ids=got.append)
    core = SimpleNamespace(scheduler=sched, check_for_draft_tokens=True, async_scheduling=False)
    update(sched, "so1", tagged)
    post(core, True)
    assert got == [drafts] and calls == [("update", "so1")]              # no RPC
    update(sched, "so2", out)                                            # untagged: vLLM's path
    post(core, True)
    assert got == [drafts] and calls[-1] == ("rpc", True)
    none_tag = sample(SimpleNamespace(speculative_config=ts_spec, use_async_scheduling=False, out=out,
                                      take_draft_token_ids=lambda: None), None)
    update(sched, "so3", none_tag)                                       # no drafts this step
    n = len(calls)
    post(core, True)
    assert got == [drafts] and len(calls) == n                          # and no RPC either


def _engine_config(ts: dict | None, *, pp=1, tp=1, block=16, mml=4096, method="standard", layer_types=None):
    hf = SimpleNamespace(hidden_size=64, layer_types=layer_types or ["full_attention"])
    return SimpleNamespace(
        additional_config={} if ts is None else {"tokenswift": ts},
        speculative_config=SimpleNamespace(rejection_sample_method=method),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        model_config=SimpleNamespace(hf_text_config=hf, max_model_len=mml),
        cache_config=SimpleNamespace(block_size=block))


def test_one_validation_for_front_end_and_worker():
    from vllm_tokenswift.core.config import validate

    ok = {"kv_budget": 256, "use_heads": False}
    cfg = validate(_engine_config(ok))
    assert isinstance(cfg, TokenSwiftConfig) and cfg.kv_budget == 256
    assert validate(_engine_config(cfg.model_dump())) == cfg          # the worker gets the dumped dict
    cases = [(_engine_config(None), 'additional_config\\["tokenswift"\\]'),
             (_engine_config(ok, method="fly"), "rejection_sample_method='fly' cannot be used"),
             (_engine_config(ok, pp=2), "pipeline_parallel_size > 1"),
             (_engine_config(ok, layer_types=["full_attention", "sliding_attention"]), "full-attention"),
             (_engine_config(ok, block=128), "The smallest valid kv_budget is 384"),
             (_engine_config({"kv_budget": 8192, "use_heads": False}), "largest valid kv_budget is 4096")]
    for vc, msg in cases:
        with pytest.raises(TokenSwiftConfigError, match=msg):
            validate(vc)
    with pytest.raises(TokenSwiftConfigError, match="logits gathered on every rank"):
        validate(_engine_config(ok, tp=2), logits_all_gathered=False)
    assert validate(_engine_config(ok, tp=2), logits_all_gathered=True).kv_budget == 256


def test_finished_request_ids_are_finished_preempted_and_resumed():
    from vllm_tokenswift.engine.step_input import finished_request_ids

    assert finished_request_ids(_sched_out(finished={"a"}, preempted={"b"}, resumed={"c"})) == {"a", "b", "c"}
    assert finished_request_ids(_sched_out()) == set()
    assert finished_request_ids(SimpleNamespace(finished_req_ids=None)) == set()   # older outputs
