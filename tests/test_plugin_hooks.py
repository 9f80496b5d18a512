"""The worker-side hooks on a real (front-end built) VllmConfig, without starting an
engine: logits processors per engine kind, vLLM's misleading min_p warning dropped on
TokenSwift engines only, the lookahead slot."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import build_random_heads, build_tiny_model

from vllm_tokenswift import patches
from vllm_tokenswift.core.config import is_tokenswift_spec


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    patches.register()
    d = tmp_path_factory.mktemp("hooks")
    model = str(build_tiny_model(d / "model", "llama", vocab_size=512, hidden_size=128, heads=4, kv_heads=2))
    heads = str(build_random_heads(d / "heads", 128))
    common = dict(model=model, dtype="float32", max_model_len=2048, block_size=32, skip_tokenizer_init=True)
    ts = EngineArgs(**common, speculative_config={"method": "tokenswift", "model": heads,
                                                  "num_speculative_tokens": 4,
                                                  "tokenswift": {"kv_budget": 256}}).create_engine_config()
    ngram = EngineArgs(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_max": 4}).create_engine_config()
    plain = EngineArgs(**common).create_engine_config()
    return {"ts": ts, "ngram": ngram, "plain": plain}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _build(cfg):
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    vlog = logging.getLogger("vllm.v1.sample.logits_processor")
    cap = _Capture()
    vlog.addHandler(cap)
    try:
        procs = gmr.build_logitsprocs(cfg, torch.device("cpu"), False, False)
    finally:
        vlog.removeHandler(cap)
    kinds = {type(p).__name__ for p in procs.all}
    warned = any("min_p and logit_bias parameters won't work" in m for m in cap.messages)
    return kinds, warned, any(isinstance(p, MinPLogitsProcessor) for p in procs.all)


def test_min_p_kept_and_warning_dropped_on_tokenswift_only(configs):
    kinds, warned, has_min_p = _build(configs["ts"])
    assert is_tokenswift_spec(configs["ts"].speculative_config)
    assert has_min_p and not warned and "PenaltyWindowState" in kinds
    # control: vLLM's own speculative method still gets vLLM's behaviour and warning
    kinds, warned, has_min_p = _build(configs["ngram"])
    assert warned and not has_min_p and "PenaltyWindowState" in kinds
    # the filter was removed after the TokenSwift call
    assert not logging.getLogger("vllm.v1.sample.logits_processor").filters
    kinds, warned, has_min_p = _build(configs["plain"])
    assert has_min_p and not warned and "PenaltyWindowState" in kinds


def test_lookahead_slot_only_for_tokenswift(configs):
    assert configs["ts"].num_lookahead_tokens == 4      # num_speculative_tokens: the chains write them
    assert configs["ngram"].num_lookahead_tokens == 0
    assert configs["plain"].num_lookahead_tokens == 0
