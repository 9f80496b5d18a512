"""Patches of vLLM's engine configuration (``vllm.engine.arg_utils``, ``vllm.config``):
``engine-args`` translates ``method="tokenswift"`` into ``custom_class`` plus validated
settings, adds the CLI flags and checks the finished ``VllmConfig`` in the front end;
``lookahead-slot`` gives TokenSwift engines ``num_speculative_tokens`` lookahead KV slots,
the slots the draft forward and the self-speculative chains write.
"""

from __future__ import annotations

import json

from vllm_tokenswift import PROPOSER_CLASS_PATH
from vllm_tokenswift.compat.patching import Patch, Target, require_declared
from vllm_tokenswift.patches.api_metrics import ensure_api_server_metrics
from vllm_tokenswift.patches.common import _ARGS, _V32
from vllm_tokenswift.core.config import is_tokenswift_spec


def translate_speculative_config(engine_args, model_config=None) -> None:
    """Rewrite a ``method="tokenswift"`` speculative config in ``engine_args`` in place.

    Runs in the front end (``EngineArgs.create_speculative_config``), before vLLM builds
    its ``SpeculativeConfig``. The block-size and model-structure checks follow in
    :func:`check_engine_config` once the ``VllmConfig`` is complete, still before any
    engine-core or worker process exists.

    Args:
        engine_args: vLLM ``EngineArgs`` (modified in place).
        model_config: the target's ``ModelConfig`` when known: then the settings are
            also checked against the model (heads, ``max_model_len``).

    Raises:
        TokenSwiftConfigError: invalid settings (names the field), pipeline parallelism,
            a lossy ``rejection_sample_method``, missing or mismatched heads, a budget
            beyond ``max_model_len``.
        UnsupportedVLLMVersion: vLLM outside the supported range.
        TokenSwiftPatchError: a patch TokenSwift relies on is not active.
    """
    from vllm_tokenswift.compat import check_vllm_version
    from vllm_tokenswift.core.config import (ADDITIONAL_CONFIG_KEY, TokenSwiftConfig,
                                        check_pipeline_parallel, check_rejection_method)

    if getattr(engine_args, "spec_method", None) == "tokenswift":
        sc = dict(engine_args.speculative_config or {})
        for attr, key in (("spec_method", "method"), ("spec_model", "model"),
                          ("spec_tokens", "num_speculative_tokens")):
            val = getattr(engine_args, attr, None)
            if val is not None:
                if key in sc and sc[key] != val:
                    raise ValueError(f"--{attr.replace('_', '-')} and --speculative-config['{key}'] "
                                     "are mutually exclusive")
                sc[key] = val
                setattr(engine_args, attr, None)
        engine_args.speculative_config = sc
    sc = engine_args.speculative_config
    if not (isinstance(sc, dict) and sc.get("method") == "tokenswift"):
        return
    check_vllm_version()
    require_declared()
    cfg = TokenSwiftConfig.from_speculative_dict(sc)
    # the checks validate() makes on the finished VllmConfig, made here too so that they fail
    # before vLLM builds it (the same functions)
    check_rejection_method(sc.get("rejection_sample_method"))
    check_pipeline_parallel(getattr(engine_args, "pipeline_parallel_size", 1))
    if model_config is not None:
        cfg.check_model(hidden_size=int(model_config.hf_text_config.hidden_size),
                        max_model_len=int(model_config.max_model_len))
    new = {k: v for k, v in sc.items() if k not in ("tokenswift", "model", "method")}
    new.update(method="custom_class", model=PROPOSER_CLASS_PATH,
               num_speculative_tokens=cfg.num_speculative_tokens)
    engine_args.speculative_config = new
    engine_args.additional_config = {**(engine_args.additional_config or {}),
                                     ADDITIONAL_CONFIG_KEY: cfg.model_dump()}


def check_engine_config(vllm_config) -> None:
    """Check a finished TokenSwift ``VllmConfig`` in the front end, before any worker starts.

    Everything the worker would otherwise find out at start-up is checked here: the
    patches, then :func:`vllm_tokenswift.core.config.validate` (the same validation the
    proposer runs in the worker: settings, verification method, pipeline and tensor
    parallelism, full attention, the budget against the resolved KV block size, the sink
    and ``max_model_len``, the heads), the drafting policy (a class path is imported and
    checked here, :func:`vllm_tokenswift.core.policy.policy_class`), then ``VLLM_PLUGINS``.
    Last, in an API server process, ``api-server-metrics`` is applied if it was not yet
    (:func:`~vllm_tokenswift.patches.api_metrics.ensure_api_server_metrics`).

    Raises:
        TokenSwiftConfigError: one message naming the setting and the smallest (or
            largest) valid value, or a drafting policy that does not resolve.
        TokenSwiftPatchError: a patch TokenSwift relies on is not active.
    """
    from vllm_tokenswift.core.config import TokenSwiftConfigError, validate
    from vllm_tokenswift.core.policy import check_policy

    require_declared()
    cfg = validate(vllm_config)
    check_policy(cfg)
    import vllm.envs as envs

    allowed = envs.VLLM_PLUGINS
    if allowed is not None and "tokenswift" not in allowed:
        raise TokenSwiftConfigError(
            f"VLLM_PLUGINS={','.join(allowed)!r} does not include 'tokenswift': the engine core and "
            "workers would run without the plugin's patches. Add tokenswift to VLLM_PLUGINS or unset it")
    ensure_api_server_metrics()


def _patch_engine_args(orig: dict) -> dict:
    orig_create = orig[f"{_ARGS}:EngineArgs.create_speculative_config"]
    orig_add = orig[f"{_ARGS}:EngineArgs.add_cli_args"]
    orig_from = orig[f"{_ARGS}:EngineArgs.from_cli_args"]
    orig_engine = orig[f"{_ARGS}:EngineArgs.create_engine_config"]

    def create_speculative_config(self, target_model_config, target_parallel_config):
        translate_speculative_config(self, target_model_config)
        return orig_create(self, target_model_config, target_parallel_config)

    def add_cli_args(parser):
        parser = orig_add(parser)
        add_tokenswift_cli_args(parser)
        return parser

    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        apply_tokenswift_cli_args(engine_args, args)
        return engine_args

    def create_engine_config(self, usage_context=None, headless=False):
        config = orig_engine(self, usage_context, headless)
        if is_tokenswift_spec(config.speculative_config):
            check_engine_config(config)
        return config

    return {f"{_ARGS}:EngineArgs.create_speculative_config": create_speculative_config,
            f"{_ARGS}:EngineArgs.add_cli_args": add_cli_args,
            f"{_ARGS}:EngineArgs.from_cli_args": from_cli_args,
            f"{_ARGS}:EngineArgs.create_engine_config": create_engine_config}


def add_tokenswift_cli_args(parser) -> None:
    """Add ``--speculative-model``, ``--tokenswift-heads``, ``--tokenswift-config`` and let
    ``--spec-method`` accept ``tokenswift`` (idempotent)."""
    opts = {s for a in parser._actions for s in a.option_strings}
    for a in parser._actions:
        if "--spec-method" in a.option_strings and a.choices is not None and "tokenswift" not in a.choices:
            a.choices = list(a.choices) + ["tokenswift"]
    if "--speculative-model" in opts:
        return
    group = parser.add_argument_group("TokenSwift", "TokenSwift speculative decoding (vllm-tokenswift)")
    group.add_argument("--speculative-model", default=None, choices=["tokenswift"],
                       help="Shortcut: 'tokenswift' turns on TokenSwift speculative decoding "
                            "(expands to --speculative-config '{\"method\": \"tokenswift\", ...}').")
    group.add_argument("--tokenswift-heads", default=None,
                       help="Draft heads folder for --speculative-model tokenswift "
                            "(vllm-tokenswift heads or a published TokenSwift checkpoint).")
    group.add_argument("--tokenswift-config", default=None, type=json.loads,
                       help="JSON object of TokenSwift settings, e.g. "
                            "'{\"kv_budget\": 4096, \"num_speculative_tokens\": 4}'.")


def apply_tokenswift_cli_args(engine_args, args) -> None:
    """Expand ``--speculative-model tokenswift`` into ``engine_args.speculative_config``.

    Raises:
        ValueError: TokenSwift flags without ``--speculative-model tokenswift``, both
            ``--speculative-model`` and ``--speculative-config``, or a non-object
            ``--tokenswift-config``.
    """
    if getattr(args, "speculative_model", None) != "tokenswift":
        if getattr(args, "tokenswift_heads", None) or getattr(args, "tokenswift_config", None):
            raise ValueError("--tokenswift-heads/--tokenswift-config need --speculative-model tokenswift")
        return
    if engine_args.speculative_config:
        raise ValueError("--speculative-model tokenswift and --speculative-config are mutually exclusive")
    ts = getattr(args, "tokenswift_config", None) or {}
    if not isinstance(ts, dict):
        raise ValueError("--tokenswift-config must be a JSON object")
    ts = dict(ts)
    sc = {"method": "tokenswift", "num_speculative_tokens": ts.pop("num_speculative_tokens", 4)}
    if args.tokenswift_heads:
        sc["model"] = args.tokenswift_heads
    sc["tokenswift"] = ts
    engine_args.speculative_config = sc

# ------------------------------------------------------------------ lookahead-slot
def _patch_lookahead(orig: dict) -> dict:
    fget = orig["vllm.config.vllm:VllmConfig.num_lookahead_tokens"]

    def num_lookahead_tokens(self):
        if is_tokenswift_spec(self.speculative_config):
            return int(self.speculative_config.num_speculative_tokens)
        return fget(self)

    return {"vllm.config.vllm:VllmConfig.num_lookahead_tokens": num_lookahead_tokens}


#: this subsystem's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
    Patch(
        name="engine-args",
        targets=(
            Target(f"{_ARGS}:EngineArgs.create_speculative_config", "method",
                   f"{_ARGS}.EngineArgs.create_speculative_config",
                   ("self", "target_model_config", "target_parallel_config")),
            Target(f"{_ARGS}:EngineArgs.add_cli_args", "staticmethod",
                   f"{_ARGS}.EngineArgs.add_cli_args", ("parser",)),
            Target(f"{_ARGS}:EngineArgs.from_cli_args", "classmethod",
                   f"{_ARGS}.EngineArgs.from_cli_args", ("cls", "args")),
            Target(f"{_ARGS}:EngineArgs.create_engine_config", "method",
                   f"{_ARGS}.EngineArgs.create_engine_config", ("self", "usage_context", "headless")),
        ),
        build=_patch_engine_args,
        changes='rewrites speculative_config {"method": "tokenswift", ...} (also --spec-method tokenswift, '
                "--speculative-model tokenswift) into method='custom_class' with the proposer's class path "
                'and the validated settings in additional_config["tokenswift"]; adds the CLI flags; checks '
                "the finished VllmConfig (block size, max_model_len, heads, attention type, drafting policy, "
                "patches) before any engine-core or worker process starts; and, in an API server process "
                "whose server module was imported after the plugin loaded, applies api-server-metrics there "
                "(whether it is needed is known only once the engine is created)",
        why="SpeculativeConfig.method is a closed Literal and the config forbids extra keys, so the "
            "method must be translated before vLLM builds it; the KV block size is final only once "
            "VllmConfig exists, and errors found later surface in a worker log",
        upstream="vLLM has no registration API for speculative methods with their own settings "
                 "(custom_class takes only a class path); no upstream issue filed from here",
        remove_when="vLLM lets a plugin register a speculative method, its config schema and a "
                    "front-end validation hook",
        versions={"0.32": _V32,
                  "0.33": "create_speculative_config, from_cli_args: identical. create_engine_config: "
                          "same signature, new unrelated options (monokernel, watchdog_config). "
                          "add_cli_args: same signature, new flags only; --spec-method still takes its "
                          "choices from the method Literal (0.33 drops medusa and mlp_speculator, keeps "
                          "custom_class). New rejection_sample_method 'fly' (lossy) is refused for "
                          "TokenSwift"},
    ),
    Patch(
        name="lookahead-slot",
        targets=(Target("vllm.config.vllm:VllmConfig.num_lookahead_tokens", "property",
                        "vllm.config.vllm.VllmConfig.num_lookahead_tokens", ("self",)),),
        build=_patch_lookahead,
        changes="VllmConfig.num_lookahead_tokens is num_speculative_tokens for TokenSwift engines (0 for "
                "custom_class otherwise), as vLLM sets it for EAGLE",
        why="the draft forward writes the newest token's K/V into its real slot and a self-speculative "
            "chain's forward j the K/V of position pos + j, which the scheduler allocates only with "
            "lookahead tokens (without any ~3% of steps had no slot for the newest token)",
        upstream="custom_class proposers cannot declare a lookahead; no upstream issue filed from here",
        remove_when="custom_class proposers can declare their lookahead (e.g. a class attribute read by "
                    "num_lookahead_tokens)",
        versions={"0.32": _V32, "0.33": "identical"},
    ),
)
