"""vLLM's own n-gram speculative decoding with the plugin's verification-attention kernel
(``additional_config={"tokenswift_verify_attention": true}``, issue 44): greedy output
equals plain decoding, and the kernel computed every verifying step's attention.

The demo model (6 layers), a 1,536-token prompt whose second half repeats its first (so
the n-gram proposer finds matches from the first step), 96 greedy tokens; plain decoding
against ``{"method": "ngram", "num_speculative_tokens": 4}`` with the opt-in. Engine-free
cases check who may opt in (:func:`vllm_tokenswift.kernels.cpu_attention.builder_settings`).

The same plain output is the reference for a TokenSwift engine that cannot get the kernel
(no compiler, an empty kernel cache, issue 57): it logs one WARNING saying why, vLLM's CPU
attention verifies, and greedy output is still plain decoding's.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_tokenswift.kernels import build as kb
from vllm_tokenswift.kernels import cpu_attention as ca
from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR
from vllm_tokenswift.bench import methods
from vllm_tokenswift.core.config import VERIFY_ATTENTION_OPT_IN_KEY

NEW = 96


def _builder(method: str | None, extra: dict | None):
    sc = None if method is None else SimpleNamespace(method=method, model=None, num_speculative_tokens=4)
    vc = SimpleNamespace(speculative_config=sc, additional_config=extra)
    return SimpleNamespace(vllm_config=vc, isa="vec", dtype=torch.float32, kv_cache_dtype="auto",
                           window_size=-1, is_cross_attention=False, is_encoder_only_attention=False,
                           head_dim=64, block_size=128)


def test_who_may_opt_in():
    on = {VERIFY_ATTENTION_OPT_IN_KEY: True}
    assert ca._decide(_builder("suffix", on)).max_query_len == 5          # kernel present in CI
    assert ca._decide(_builder("ngram", on)).enabled
    assert ca._decide(_builder("ngram", None)) == ca.BuilderSettings(False)
    assert ca._decide(_builder(None, None)) == ca.BuilderSettings(False)   # plain decoding
    # a plain engine that opts in routes its one-token decode rows (bench method ar-vk)
    assert ca._decide(_builder(None, on)) == ca.BuilderSettings(True, max_query_len=1)
    s = ca._decide(_builder("eagle", on))
    assert not s.enabled and "'eagle'" in s.reason
    assert VERIFY_ATTENTION_OPT_IN_KEY == "tokenswift_verify_attention"   # the documented key


@pytest.fixture
def no_kernel(monkeypatch, tmp_path):
    """This process as if the kernel had never been looked for, with no compiler and an empty
    kernel cache (restored after the test), and the kernel WARNING not yet logged. Returns
    the records the ``vllm_tokenswift`` logger emits at WARNING and above."""
    for name, value in (("_loaded", False), ("_kernel", None), ("_kernel_error", None), ("_status", None)):
        monkeypatch.setattr(kb, name, value)
    monkeypatch.setattr(ca, "_warned_missing", False)
    monkeypatch.setenv("CC", "/nonexistent-cc")
    monkeypatch.setenv("VLLM_TOKENSWIFT_CACHE", str(tmp_path / "cache"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("vllm_tokenswift")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


KERNEL_WARNING = "TokenSwift verification attention kernel unavailable"


def test_a_kernel_that_cannot_load_is_a_warning_once(no_kernel, caplog):
    """Where everything else allows the kernel but it cannot be built, the builder says so
    at WARNING (once per process, however many builders); reasons that keep the kernel off
    by design stay at INFO."""
    if kb.cpu_supports_kernel() is not None:
        pytest.skip(kb.cpu_supports_kernel())
    on = {VERIFY_ATTENTION_OPT_IN_KEY: True}
    caplog.set_level(logging.INFO, logger="vllm_tokenswift")
    first, second = _builder("ngram", on), _builder(None, on)
    s = ca.builder_settings(first)
    assert not s.enabled and s.kernel_missing and "no C compiler" in s.reason, s
    assert ca.builder_settings(second).kernel_missing
    warnings = [r.getMessage() for r in no_kernel]
    assert len(warnings) == 1 and KERNEL_WARNING in warnings[0], warnings
    assert "'/nonexistent-cc' was not found" in warnings[0] and "vLLM's CPU attention runs instead" in warnings[0]
    fp16 = _builder("ngram", on)
    fp16.dtype = torch.float16
    s = ca.builder_settings(fp16)                                   # off by design: INFO
    assert not s.enabled and not s.kernel_missing
    assert len(no_kernel) == 1
    assert any("model dtype torch.float16" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_a_cpu_without_avx2_is_info_not_a_warning(no_kernel, monkeypatch):
    monkeypatch.setattr(kb, "cpu_supports_kernel", lambda: "the CPU lacks avx2")
    s = ca.builder_settings(_builder("ngram", {VERIFY_ATTENTION_OPT_IN_KEY: True}))
    assert not s.enabled and not s.kernel_missing and s.reason == "the CPU lacks avx2"
    assert no_kernel == []


def test_bench_methods_carry_the_opt_in():
    cfg = methods.BenchConfig(engine_kwargs={"additional_config": {"x": 1}})
    assert methods.speculative_config("suffix-vk", cfg) == methods.speculative_config("suffix", cfg)
    assert methods.method_engine_args("suffix-vk", cfg) == {"additional_config": {"x": 1, VERIFY_ATTENTION_OPT_IN_KEY: True}}
    assert methods.method_engine_args("suffix", cfg) == {}
    assert methods.speculative_config("ar-vk", cfg) is None          # plain decoding on the kernel
    assert methods.method_engine_args("ar-vk", cfg) == {"additional_config": {"x": 1, VERIFY_ATTENTION_OPT_IN_KEY: True}}


def _plan(q_lens, seq_lens, max_query_len):
    """:func:`ca.plan_batch` on a batch of ``q_lens`` query tokens per request (real vLLM
    metadata type, 3 query heads on 1 KV head, head_dim 64, block 128)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    n = len(q_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    bt = torch.arange(n * 4, dtype=torch.int32).view(n, 4)
    md = CPUAttentionMetadata(num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), query_start_loc=qsl,
                              max_seq_len=max(seq_lens), seq_lens=seq, block_table=bt, slot_mapping=None,
                              scheduler_metadata=None, causal=True)
    b = SimpleNamespace(num_heads=3, num_kv_heads=1, head_dim=64, block_size=128, dtype=torch.float32,
                        window_size=-1, isa="vec", kv_cache_dtype="auto")
    common = SimpleNamespace(num_reqs=n, query_start_loc_cpu=qsl)
    return ca.plan_batch(b, ca.BuilderSettings(True, max_query_len=max_query_len), md, common), b


def test_plan_routes_every_decode_row_and_leaves_prefill_to_vllm():
    # decode rows without drafts (q=1) and verifying rows (q=3, q=5) are planned; a
    # 40-token prefill chunk and a 6-token one (more than k+1 = 5) are left to vLLM
    bp, b = _plan([1, 3, 40, 5, 1, 6], [300, 302, 40, 511, 9, 200], 5)
    assert bp.plan.q_start.tolist() == [0, 1, 44, 49]
    assert bp.plan.q_len.tolist() == [1, 3, 5, 1]
    assert bp.plan.seq_len.tolist() == [300, 302, 511, 9]
    assert bp.plan.bt_row.tolist() == [0, 1, 3, 4]
    assert bp.rest_tokens.tolist() == [*range(4, 44), *range(50, 56)]
    rest = bp.rest_metadata
    assert rest.query_start_loc.tolist() == [0, 40, 46] and rest.seq_lens.tolist() == [40, 200]
    assert rest.block_table.tolist() == [[8, 9, 10, 11], [20, 21, 22, 23]]
    assert (rest.num_actual_tokens, rest.max_query_len, rest.max_seq_len) == (46, 40, 200)
    c = ca.builder_counts(b)
    assert (c["steps"], c["requests"], c["tokens"], c["decode_requests"], c["mixed_steps"]) == (1, 4, 10, 2, 1)


def test_plan_of_a_plain_engine_takes_only_one_token_rows():
    bp, _ = _plan([1, 1, 2], [700, 129, 64], 1)      # max_query_len 1: the plain-engine opt-in
    assert bp.plan.q_len.tolist() == [1, 1] and bp.rest_tokens.tolist() == [2, 3]
    assert _plan([7, 2], [7, 64], 1)[0] is None          # prefill only: no plan, vLLM's path untouched


def _counts(worker):
    return ca.verify_attention_counts(worker.model_runner)


#: the engines' settings (besides tests/engine_utils.ENGINE_KW)
ENGINE = dict(max_model_len=2048, block_size=128, skip_tokenizer_init=False)


@pytest.fixture(scope="module")
def plain():
    """The prompt, the sampling parameters and plain decoding's greedy tokens (one engine
    for the module's engine tests)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from engine_utils import make_llm, shutdown

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    text = "\n\n".join(p.read_text() for p in sorted(PROMPTS_DIR.glob("*.txt")))
    half = tok(text, add_special_tokens=False)["input_ids"][:768]
    prompt = [{"prompt_token_ids": half + half}]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm = make_llm(str(DEMO_MODEL), **ENGINE)
    want = list(llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    shutdown(llm)
    return prompt, sp, want


@pytest.mark.engine
def test_tokenswift_without_a_compiler_falls_back_to_vllms_attention(plain, no_kernel):
    """No compiler and an empty kernel cache: the kernel cannot load, so the engine logs one
    WARNING naming why, every attention layer runs vLLM's kernel (the counters show no
    kernel call and no plan), and greedy TokenSwift still equals plain decoding.

    Before the n-gram engine on purpose: vLLM's n-gram proposer imports numba, and once
    llvmlite is imported a later engine start in the same process fails in vLLM's Triton
    kernel registry (``vllm/triton_utils/dispatcher.py`` reads ``vars()`` of llvmlite's
    ``ffi.lib``, whose ``__getattr__`` answers for ``__dict__``)."""
    from engine_utils import make_llm, shutdown

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    if kb.cpu_supports_kernel() is not None:
        pytest.skip(kb.cpu_supports_kernel())
    prompt, sp, want = plain
    spec = {"method": "tokenswift", "model": str(DEMO_HEADS), "num_speculative_tokens": 4,
            "tokenswift": {"kv_budget": 1024}}
    ts = make_llm(str(DEMO_MODEL), spec, **ENGINE)
    got = list(ts.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    stats = get_engine_stats(ts)
    shutdown(ts)
    warnings = [r.getMessage() for r in no_kernel if KERNEL_WARNING in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in no_kernel]
    assert "no C compiler: '/nonexistent-cc' was not found" in warnings[0]
    assert kb.kernel_status().state == kb.FAILED
    assert stats["verify_attention"] == {}, stats["verify_attention"]   # nothing planned, no kernel call
    assert stats["accepted_tokens"] > 0, stats                           # it did speculate
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert len(got) == NEW and first is None, f"TokenSwift without the kernel differs at token {first}"


@pytest.mark.engine
def test_ngram_with_the_kernel_equals_plain_decoding(plain):
    from engine_utils import make_llm, shutdown

    prompt, sp, want = plain
    kw = ENGINE
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    ng = make_llm(str(DEMO_MODEL), spec, additional_config={VERIFY_ATTENTION_OPT_IN_KEY: True}, **kw)
    got = list(ng.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    counts = ng.collective_rpc(_counts)[0]
    shutdown(ng)
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert len(got) == NEW and first is None, f"ngram + kernel differs from plain decoding at token {first}"
    # every decode step (verifying, and one-token steps where no n-gram matched) ran the
    # kernel in all 6 layers, without a fallback: NEW tokens took at most NEW decode steps
    assert counts.get("steps", 0) > 5 and counts["layer_calls"] == 6 * counts["steps"], counts
    assert counts["requests"] == counts["steps"] and counts["tokens"] >= NEW - 1, counts
    assert counts.get("fallbacks", 0) == 0

