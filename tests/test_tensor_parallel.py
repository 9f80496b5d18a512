"""Tensor parallelism: every TP rank selects the same draft KV view, and TP=2 stays lossless.

Under tensor parallelism each rank's attention pre-hook captures only its own query
heads and its KV cache holds only its own KV heads, so block importance computed on
one rank ranks blocks by that rank's heads. The proposer sums the importances over
the TP group before the top-k (``kv_view.sum_over_ranks`` via the proposer's
``_tp_all_gather`` on vLLM's TP group), so all ranks draft over the same blocks,
the ones single-rank TokenSwift selects.

1. ``test_view_selection_is_rank_consistent`` (fast, always runs): two processes form
   a world-2 vLLM TP group (gloo + vLLM's CPU communicator). Each holds different
   local query/KV heads of the same requests (vLLM's contiguous head sharding) and
   runs the proposer's own view planning path (``kv_view.DraftViews.plan`` ->
   ``TargetAccess.importance`` -> ``sum_over_ranks`` -> ``ViewPlanner.select``). Both ranks must select exactly the block ids that a
   single process with all heads selects; a control shows that per-rank importance
   alone would select different blocks (so the test can fail). It also checks that
   the KV key layout detection agrees across ranks (one rank failing -> all fall back).
2. ``test_engine_tp2_lossless`` (engine, about 2.5 min with both ranks on one CPU core, most of it the three TP=2 engines starting): the bundled demo
   model with ``tensor_parallel_size=2``, TokenSwift vs plain decoding at TP=2, greedy,
   token-identical, drafts accepted; then a sampled run (temperature 1, min_p, windowed
   penalty) on the same engine; both ranks' TokenSwift counters must be identical (same
   decisions, chains, random draws, selections and acceptances on each rank). Twice: with
   ``policy="cycle"`` (the draft forward every fourth step, so budgeted views are selected)
   and with the default adaptive policy (decisions from rank 0's broadcast cost model).

CPU pinning: vLLM binds each TP rank's OpenMP threads with ``VLLM_CPU_OMP_THREADS_BIND``
(one entry per rank, separated by ``|``); ``"1|1"`` puts both ranks on core 1. When the
variable is unset or has a single entry, the engine test binds the ranks to two different
CPUs of those the test worker had before conftest pinned it (one, twice, where there is
only one; vLLM's "auto" binding wants one NUMA node per rank): vLLM's CPU all-reduce waits
by spinning, so ranks sharing a core hand over only when the scheduler preempts the spinner.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import traceback
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

# ---------------------------------------------------------------- rank consistency (isolated)
WORLD = 2
HQ, HKV, D, BS = 8, 4, 32, 16          # 8 query heads over 4 KV heads (GQA 2), head_dim 32
LAYERS = 3
NUM_BLOCKS = 128
BUDGET, SINK = 128, 16                  # 8 blocks: 1 sink + 6 selected + the newest block
POSITIONS = [700, 1000]                 # newest token of each request (> budget: must select)
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _case():
    """Full-head queries and KV caches (``split_last`` layout ``[blocks, H_kv, bs, 2D]``)
    where rank 0's KV heads (0, 1) favour one set of blocks and rank 1's (2, 3) another,
    so per-rank importance disagrees and the all-head ranking mixes both sets."""
    g = torch.Generator().manual_seed(1234)
    n = len(POSITIONS)
    perm = torch.randperm(NUM_BLOCKS, generator=g).numpy()
    bt = np.zeros((n, 80), dtype=np.int32)
    off = 0
    for r, p in enumerate(POSITIONS):
        nb = p // BS + 1
        bt[r, :nb] = perm[off: off + nb]
        off += nb
    q = {}
    kv = {}
    for li, name in enumerate(LAYER_NAMES):
        qf = torch.randn(n, HQ, D, generator=g)
        cache = torch.randn(NUM_BLOCKS, HKV, BS, 2 * D, generator=g) * 0.5
        for r, p in enumerate(POSITIONS):
            last = p // BS
            mids = torch.randperm(last - 1, generator=g)[:12].numpy() + 1  # logical blocks 1..last-1
            for h in range(HKV):
                favoured = mids[:6] if h < HKV // 2 else mids[6:]
                qg = qf[r, 2 * h: 2 * h + 2].sum(0)
                qg = qg / qg.norm()
                for b in favoured:
                    strength = 1.0 + torch.rand(1, generator=g).item() * 2.0
                    cache[int(bt[r, b]), h, :, :D] += strength * qg
        q[name] = qf.reshape(n, HQ * D)
        kv[name] = cache
    return bt, q, kv


def _fake_views(bt, q, kv, rank: int | None, tp_size: int):
    """The proposer's draft views (``kv_view.DraftViews``) over a target with just what
    planning reads; ``rank=None``: all heads."""
    from vllm_tokenswift.engine.target import TargetAccess, tp_all_gather
    from vllm_tokenswift.core.kv_view import DraftViews, ViewPlanner
    from vllm_tokenswift.core.stats import TokenSwiftStats
    from vllm_tokenswift.core.request_state import RequestState

    n = len(POSITIONS)
    hq = HQ // WORLD if rank is not None else HQ
    hkv = HKV // WORLD if rank is not None else HKV
    ctx = {}
    local_q = {}
    for name in LAYER_NAMES:
        qf = q[name].view(n, HQ, D)
        cache = kv[name]
        if rank is not None:  # vLLM shards heads contiguously: rank r owns heads [r*h, (r+1)*h)
            qf = qf[:, rank * hq:(rank + 1) * hq]
            cache = cache[:, rank * hkv:(rank + 1) * hkv]
        local_q[name] = qf.reshape(n, hq * D).contiguous()
        ctx[name] = SimpleNamespace(kv_cache=cache.contiguous())
    vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    access = TargetAccess(vllm_config, BS, 0, tp_size)
    access.layer_names = list(LAYER_NAMES)
    access.key_layout = "split_last"
    access._layout_checked = True
    access._q = local_q
    views = DraftViews(ViewPlanner(BUDGET, SINK, BS, "dynamic", LAYERS), access.importance,
                       tp_all_gather if tp_size > 1 else None, TokenSwiftStats())
    states = []
    for r in range(n):
        st = RequestState(ngrams=None)
        st.q_row, st.q_step = r, 1  # queries captured by the previous draft forward
        states.append(st)
    return views, access, states


def _select(bt, q, kv, rank: int | None, tp_size: int):
    """Run the proposer's view planning; returns per request, per layer, the view's logical blocks."""
    views, _, states = _fake_views(bt, q, kv, rank, tp_size)
    plans = views.plan(bt, list(range(len(POSITIONS))), [st.view for st in states], list(POSITIONS),
                       [st.q_row for st in states])
    assert views.stats.view_selections == len(POSITIONS)
    assert all(not pl.full and len(pl.blocks) == LAYERS for pl in plans)
    return [[b.tolist() for b in pl.blocks] for pl in plans]


def _importances(bt, q, kv, rank: int | None):
    views, access, states = _fake_views(bt, q, kv, rank, 1)
    s = views.planner.sink_blocks
    return [[a.tolist() for a in access.importance(bt[r, s: p // BS], st.q_row, LAYERS)]
            for r, (st, p) in enumerate(zip(states, POSITIONS))]


def _rank_main(rank: int, init_file: str, ident: str, out_dir: str) -> None:
    res: dict = {"rank": rank}
    try:
        os.environ["VLLM_DIST_IDENT"] = ident  # names vLLM's CPU shared-memory group
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import (get_tp_group, init_distributed_environment,
                                      initialize_model_parallel)

        from vllm_tokenswift.core.kv_view import sum_over_ranks
        from vllm_tokenswift.engine.target import tp_all_gather as _tp_all_gather

        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank,
                                         distributed_init_method=f"file://{init_file}", backend="gloo")
            initialize_model_parallel(tensor_model_parallel_size=WORLD)
        assert get_tp_group().world_size == WORLD
        bt, q, kv = _case()
        # the path under test: per-rank importance summed over the TP group, then top-k
        res["selected"] = _select(bt, q, kv, rank, WORLD)
        local = _importances(bt, q, kv, rank)
        summed = sum_over_ranks([[np.asarray(a, dtype=np.float32) for a in imp] for imp in local],
                                _tp_all_gather)
        res["summed_importance"] = [[a.tolist() for a in imp] for imp in summed]
        # control: what this rank would select from its own heads only
        res["local_only"] = _select(bt, q, kv, rank, 1)
        res["layout"] = _layout_consensus(kv, rank, fail_rank=None)
        res["layout_one_fails"] = _layout_consensus(kv, rank, fail_rank=1)
    except BaseException:  # report to the parent instead of dying silently
        res["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def _layout_consensus(kv, rank: int, fail_rank: int | None):
    """Run the proposer's key-layout detection on this rank's cache; ``fail_rank`` has no key."""
    from vllm_tokenswift.engine.target import TargetAccess

    hkv = HKV // WORLD
    name = LAYER_NAMES[0]
    cache = kv[name][:, rank * hkv:(rank + 1) * hkv].contiguous()
    access = TargetAccess(SimpleNamespace(compilation_config=SimpleNamespace(
        static_forward_context={name: SimpleNamespace(kv_cache=cache)})), BS, 0, WORLD)
    access.layer_names = [name]
    slot = 37 * BS + 5
    key = cache[37, :, 5, :D].reshape(1, hkv * D)
    access._probe_key = None if rank == fail_rank else key
    access._detect_layout(slot)
    return access.key_layout


@pytest.mark.engine  # two processes form a vLLM TP group
def test_view_selection_is_rank_consistent(tmp_path):
    ctx = mp.get_context("spawn")
    with _spread_over(_cpus()):   # the two ranks import torch and vLLM side by side
        res = _run_ranks(ctx, tmp_path)
    bt, q, kv = _case()
    reference = _select(bt, q, kv, None, 1)              # one process, all heads
    ref_imp = _importances(bt, q, kv, None)
    # every rank selects exactly the all-heads view
    assert res[0]["selected"] == reference
    assert res[1]["selected"] == reference
    # the summed scores are the all-heads scores, bitwise identical across ranks
    assert res[0]["summed_importance"] == res[1]["summed_importance"]
    for got, want in zip(res[0]["summed_importance"], ref_imp):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # control: from their own heads alone the ranks would draft over different blocks
    assert res[0]["local_only"] != res[1]["local_only"]
    assert res[0]["local_only"] != reference and res[1]["local_only"] != reference
    # sanity of the view shape: sink block, 6 selected, newest block last
    for blocks, p in zip(reference[0], [POSITIONS[0]] * LAYERS):
        assert blocks[0] == 0 and blocks[-1] == p // BS and len(blocks) == BUDGET // BS
    # key layout detection agrees across ranks
    assert res[0]["layout"] == res[1]["layout"] == "split_last"
    assert res[0]["layout_one_fails"] is None and res[1]["layout_one_fails"] is None


def _run_ranks(ctx, tmp_path) -> list[dict]:
    """Both ranks' results (``rank{r}.json``); fails if a rank hangs or raises."""
    init_file = tmp_path / "dist_init"
    ident = f"tstp-{uuid.uuid4().hex[:12]}"
    procs = [ctx.Process(target=_rank_main, args=(r, str(init_file), ident, str(tmp_path)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"rank processes {hung} did not finish (collective deadlock?)"
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in res:
        assert "error" not in r, f"rank {r['rank']} failed:\n{r['error']}"
    return res


def test_sum_over_ranks_single_rank_is_identity():
    from vllm_tokenswift.core.kv_view import sum_over_ranks

    imps = [[np.arange(3, dtype=np.float32)], None, [np.zeros(0), np.ones(2)]]
    assert sum_over_ranks(imps, None) is imps
    # a fake 2-rank gather: both ranks' rows added in order, structure kept
    out = sum_over_ranks(imps, lambda t: torch.stack([t, 2 * t]))
    assert out[1] is None
    np.testing.assert_array_equal(out[0][0], [0, 3, 6])
    assert out[2][0].shape == (0,)
    np.testing.assert_array_equal(out[2][1], [3, 3])
    with pytest.raises(ValueError):
        sum_over_ranks(imps, lambda t: t)


# ---------------------------------------------------------------- engine: TP=2 lossless
ASSETS = Path(__file__).resolve().parents[1] / "vllm_tokenswift" / "assets"
PROMPT_FILES = ["1342-2k.txt", "84-2k.txt"]
PROMPT_TOKENS = 600
GEN_TOKENS = 128
SAMPLED_TOKENS = 32


def _cpus() -> list[int]:
    """The CPUs this test may use: the ones the xdist worker had before conftest pinned it
    to one core, else this process's own."""
    env = os.environ.get("TOKENSWIFT_TEST_CPUS", "")
    return [int(c) for c in env.split(",")] if env else sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def _spread_over(cpus: list[int]):
    """Processes spawned from this thread (the TP ranks) may run on ``cpus`` while they
    import vLLM and torch; this thread's own affinity is restored afterwards."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _tp2_engine(spec: bool, policy: str = "cycle"):
    from vllm import LLM

    kw = dict(model=str(ASSETS / "demo-model"), tensor_parallel_size=2,
              distributed_executor_backend="mp", dtype="float32", enforce_eager=True,
              max_model_len=4096, block_size=32, kv_cache_memory_bytes=256 * 1024 * 1024,
              seed=0, disable_log_stats=False)
    if spec:
        kw["speculative_config"] = {"method": "tokenswift", "model": str(ASSETS / "demo-heads"),
                                    "num_speculative_tokens": 4, "tokenswift": {"kv_budget": 256, "policy": policy}}
    return LLM(**kw)


def _stable(stats: dict) -> dict:
    """Counters that must match across ranks (timings differ)."""
    out = {k: v for k, v in stats.items() if "time" not in k and "share" not in k
           and k not in ("prometheus_samples", "memory", "profile")}
    # the proposer's memory figures but each rank's own process size
    out["memory"] = {k: v for k, v in (stats.get("memory") or {}).items() if k != "rss_bytes"}
    # the exported counters too, except the ones in seconds
    out["prometheus_samples"] = [s for s in stats.get("prometheus_samples", []) if "seconds" not in s[0]]
    return out


@pytest.fixture
def omp_bind(monkeypatch):
    # the TP workers get 1 s to exit on shutdown before vLLM sends SIGTERM (default 5 s)
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    # TP=2 needs one entry per rank; a single-entry binding (e.g. "1", which conftest uses
    # to pin each test worker's engines) is replaced by two different cores where there are
    # two (why: the module docstring; on one core the test took 113 s alone, on two 60 s)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    cpus = _cpus()
    if "|" not in bind:
        ranks = cpus[:2] if len(cpus) >= 2 else cpus * 2
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, ranks)))
    with _spread_over(cpus):
        yield


@pytest.mark.engine  # starts TP=2 engines
def test_engine_tp2_lossless(omp_bind):
    from engine_utils import shutdown
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(str(ASSETS / "demo-model"))
    prompts = [TokensPrompt(prompt_token_ids=tok((ASSETS / "prompts" / f).read_text())["input_ids"]
                            [:PROMPT_TOKENS]) for f in PROMPT_FILES]
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)

    plain = _tp2_engine(spec=False)
    base = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    shutdown(plain)

    sampled = SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, max_tokens=SAMPLED_TOKENS,
                             ignore_eos=True, extra_args={"repetition_penalty_window": 256})
    # cycle: the draft forward every fourth step of each request, so the budgeted view is
    # exercised; adaptive (the default): decisions from measured costs and acceptances,
    # which must come out identical on both ranks (costs are measured on rank 0 and broadcast)
    runs = {policy: _tp2_run(policy, prompts, params, sampled) for policy in ("cycle", "adaptive")}

    assert [len(x) for x in base] == [GEN_TOKENS] * len(prompts)
    for policy, (out, sampled_out, per_rank, metrics) in runs.items():
        for i, (a, b) in enumerate(zip(base, out)):
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            assert a == b, f"{policy}, prompt {i}: TP=2 TokenSwift differs from TP=2 plain decoding at token {first}"
        assert [len(o.outputs[0].token_ids) for o in sampled_out] == [SAMPLED_TOKENS] * len(prompts)
        assert len(per_rank) == 2 and all(s is not None for s in per_rank)
        assert _stable(per_rank[0]) == _stable(per_rank[1]), f"{policy}: TP ranks took different drafting decisions"
        assert metrics.get("vllm:spec_decode_num_accepted_tokens", 0) > GEN_TOKENS // 2, (policy, metrics)
        # the policy's decisions were counted (and compared across ranks above)
        assert sum(per_rank[0]["steps_by_kind"].values()) > 0, per_rank[0]
    s = runs["cycle"][2][0]
    # the budgeted view was selected for every request (the cycle policy runs the draft
    # forward every fourth step of each request; the adaptive policy, which on the tiny
    # model runs almost none, would leave the budgeted view untested)
    assert s["view_selections"] >= len(prompts), s
    assert s["views_budgeted"] > 0 and s["key_layout"] is not None, s
    assert s["steps_by_kind"]["forward"] > 0, s
    # the adaptive policy chose more than one kind of step (the decisions being compared
    # across ranks are not all the same trivial one)
    kinds = runs["adaptive"][2][0]["steps_by_kind"]
    assert sum(1 for v in kinds.values() if v > 0) >= 2, kinds


def _tp2_run(policy: str, prompts, greedy, sampled):
    """One TP=2 TokenSwift engine: greedy outputs, sampled outputs, per-rank stats, metrics."""
    from engine_utils import shutdown, spec_metrics
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ts = _tp2_engine(spec=True, policy=policy)
    out = [list(o.outputs[0].token_ids) for o in ts.generate(prompts, greedy, use_tqdm=False)]
    # the paper's sampling: drafts drawn from q on every rank (same RNG stream), q handed
    # to each rank's rejection sampler; the ranks' counters must still agree
    sampled_out = ts.generate(prompts, sampled, use_tqdm=False)
    # finished requests reach the workers at the next step: run one more
    ts.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=2), use_tqdm=False)
    per_rank = ts.collective_rpc("tokenswift_stats")
    metrics = spec_metrics(ts)
    shutdown(ts)
    return out, sampled_out, per_rank, metrics
