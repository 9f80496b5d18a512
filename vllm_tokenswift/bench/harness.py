"""Offline vLLM benchmark of AR, TokenSwift (and ablations), n-gram and suffix decoding.

One ``vllm.LLM`` engine is built per method (``engine_scope="method"``, default:
the engine serves every gen_len / batch size / sampling of that method, with
``max_model_len`` sized for the longest run) or per (method, setting)
(``engine_scope="setting"``), warmed up with a short generate, timed over
``repeats`` runs, then torn down before the next one. With
``engine_scope="interleave"`` every method's engine is started first and kept,
and the timed runs go round by round (each setting and repeat: every method once,
in turn), so that drift of a shared machine hits all methods of a round alike;
speedups are then paired with the AR run of the same round.

``engines`` > 1 repeats all of that with fresh engine instances: two instances of
the same engine differ in the speed of their forward by 1-8% (memory placement,
measured in ``matrix/b8-paper-engines``), which repeats on one instance do not
average out. Each record carries its ``engine`` (instance index) and a ``repeat``
numbered across instances, so that an interleaved run is still paired with the AR
run of its own round.

Per timed run the harness records wall time, generated tokens, vLLM's
speculative-decoding Prometheus counters (deltas of ``llm.get_metrics()`` taken
before and after the run: the counters are cumulative), the TokenSwift plugin's
own counters when available (:func:`vllm_tokenswift.engine.stats_rpc.get_engine_stats`),
Distinct-n of the outputs and, for greedy runs, whether the token ids equal the
AR run's. :mod:`vllm_tokenswift.bench.report` turns the records into files.

vLLM is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Callable, Sequence, TextIO

from vllm_tokenswift.bench import report
# re-exported: the benchmarks' names for them since before they moved
from vllm_tokenswift.cli.engine_helpers import (engine_output_to, plugin_stats_after,  # noqa: F401
                                             plugin_stats_before, teardown_engine)
# re-exported: the benchmark's methods, settings and prompts moved to methods.py / prompts.py
from vllm_tokenswift.bench.methods import (_PKG_DIR, ARCTIC_INSTALL_NOTE, CPU_GEN_LENS,  # noqa: F401
                                           DEFAULT_BOOKS, DEFAULT_K, DEFAULT_KV_BUDGET, DEFAULT_MODEL,
                                           DEFAULT_PROMPT_GLOB, GPU_GEN_LENS, KNOWN_METHODS, NGRAM_CONFIGS,
                                           NGRAM_SWEEP_NOTES, SAMPLING_PRESETS, SUFFIX_CONFIG, TINY_HEADS,
                                           TINY_MODEL, TOKENSWIFT_VARIANTS, BenchConfig, default_gen_lens,
                                           effective_prefix_len, method_engine_args, method_unavailable,
                                           model_max_len, sampling_kwargs, speculative_config)
from vllm_tokenswift.bench.prompts import (BOOK_SKIP_TOKENS, _read_token_file, book_prompts,  # noqa: F401
                                           book_streams, build_prompts, load_prompt_tokens)

logger = logging.getLogger("vllm_tokenswift.bench")


def build_engine(cfg: BenchConfig, spec: dict[str, Any] | None, max_model_len: int,
                 engine_args: dict[str, Any] | None = None):
    """Create a ``vllm.LLM`` for the benchmark (CPU-friendly defaults), with
    ``cfg.engine_kwargs`` and then ``engine_args`` (one method's, see
    :func:`method_engine_args`) applied last."""
    from vllm import LLM
    kw: dict[str, Any] = dict(
        model=cfg.model, tokenizer=cfg.tokenizer or cfg.model, dtype=cfg.dtype,
        max_model_len=max_model_len, enable_prefix_caching=False, seed=cfg.seed,
        disable_log_stats=False, enforce_eager=cfg.enforce_eager,
        max_num_seqs=max(max(cfg.batch_sizes), 1),
    )
    if cfg.kv_cache_gb:
        kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
    if spec:
        kw["speculative_config"] = spec
    if cfg.yarn:
        from vllm_tokenswift.cli.models import yarn_overrides

        kw["hf_overrides"] = yarn_overrides(cfg.model, cfg.yarn)
    kw.update(cfg.engine_kwargs)
    kw.update(engine_args or {})
    return LLM(**kw)


def empty_proposer(worker: Any) -> bool:
    """Diagnostics, run in a worker through ``llm.collective_rpc(empty_proposer)``: make
    its TokenSwift proposer return no drafts at once, leaving vLLM's speculative path
    (spec-decode scheduling, the plugin's hooks) in place without the proposer's work.
    The ``ts-empty`` mode of docs/research/step_cost_ab.py and step_trace.py compares such an
    engine with plain decoding.

    Returns True (collective_rpc's per-worker result). Raises AttributeError when the
    worker's model runner has no drafter (not a speculative engine)."""
    from vllm_tokenswift.core.step import StepProposal

    drafter = worker.model_runner.drafter
    drafter.propose_step = lambda step: StepProposal([[] for _ in range(step.num_rows)])
    return True


def _spec_counters(llm: Any, collectors: list | None = None) -> dict[str, Any]:
    try:
        if collectors is not None:
            return report.spec_counters_from_collectors(collectors)
        return report.spec_counters_from_metrics(llm.get_metrics())
    except Exception:
        logger.debug("get_metrics failed", exc_info=True)
        return report.spec_counters_from_metrics([])


def snapshot(llm: Any, tokens: int, steps: int, is_ts: bool, collectors: list | None = None) -> dict:
    """The counters of a running engine after ``tokens`` output tokens and ``steps`` steps."""
    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    snap = {"t": time.perf_counter(), "tokens": int(tokens), "steps": int(steps),
            "spec": _spec_counters(llm, collectors), "plugin": None}
    if is_ts:
        try:
            snap["plugin"] = get_engine_stats(llm)
        except Exception:  # noqa: BLE001 - figures, not the run
            snap["plugin"] = None
    return snap


def spec_metric_collectors() -> list:
    """The Prometheus collectors of vLLM's speculative-decoding counters now in this
    process's registry: those of the engine built last (vLLM unregisters an earlier
    engine's metrics when it builds the next one; the earlier engine keeps updating its
    own collectors). Empty when none are registered or the registry has no index."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return []
    names = getattr(REGISTRY, "_collector_to_names", None) or {}
    return [c for c, ns in list(names.items()) if any(str(n).startswith("vllm:spec_decode") for n in ns)]


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------

def timed_run(llm: Any, prompts: list[list[int]], sp_kwargs: dict[str, Any], gen_len: int,
              k: int | None, plugin_stats: bool = False, collectors: list | None = None
              ) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed ``generate`` of ``prompts``; returns ``(record fields, output ids)``.

    ``plugin_stats``: also collect the TokenSwift plugin's counters (TokenSwift engines).
    ``collectors``: read vLLM's speculative-decoding counters from these Prometheus
    collectors (:func:`spec_metric_collectors` right after this engine was built) instead
    of ``llm.get_metrics()``, which reads the registry of the engine built last.
    """
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=gen_len, ignore_eos=True, **sp_kwargs)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    before = _spec_counters(llm, collectors)
    was_reset, pbefore = plugin_stats_before(llm) if plugin_stats else (False, None)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _spec_counters(llm, collectors)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    ntok = sum(len(x) for x in ids)
    rec: dict[str, Any] = {"num_tokens": ntok, "wall_s": wall}
    rec.update(report.throughput(ntok, wall, len(prompts)))
    ttft = [getattr(getattr(o, "metrics", None), "first_token_latency", None) for o in outs]
    ttft = [t for t in ttft if isinstance(t, (int, float)) and t > 0]
    if ttft and wall > max(ttft) and ntok > len(prompts):
        rec["ttft_s"] = max(ttft)
        rec["decode_tokens_per_s"] = (ntok - len(prompts)) / (wall - max(ttft))
    delta = report.counter_delta(before, after)
    acc = report.acceptance_from_counters(delta, k)
    rec.update({kk: acc[kk] for kk in ("acceptance_rate", "mean_accepted_length", "num_drafts",
                                        "num_draft_tokens", "num_accepted_tokens",
                                        "draft_token_acceptance", "acceptance_per_pos")})
    if plugin_stats:
        rec.update(plugin_stats_after(llm, was_reset, pbefore, k or 0))
    else:
        rec.update({"ngram_acceptance": None, "draft_time_share": None,
                    "time_draft_s": None, "time_verify_s": None, "steps_by_kind": None,
                    "accepted_by_kind": None, "draft_forward": None})
    rec.update(report.distinct_scores(ids))
    return rec, ids


def timed_run_segments(llm: Any, prompt: list[int], sp_kwargs: dict[str, Any], gen_len: int,
                       k: int | None, segment_tokens: int, plugin_stats: bool = False,
                       collectors: list | None = None) -> tuple[dict[str, Any], list[list[int]]]:
    """:func:`timed_run` for one request, stepping the engine itself: a snapshot of the
    counters at the first token and every ``segment_tokens`` output tokens after it (and
    at the end), turned into ``segments`` rows (:mod:`vllm_tokenswift.bench.segments`).
    The snapshots read counters between steps: their cost (an RPC to the worker, less
    than a step) falls outside the segments' wall times only in part. The proposer's
    memory for the last segment is read once more when the request is within one step of
    its end (``memory_before_finish`` of the last snapshot): the final snapshot comes
    after its state was freed."""
    from vllm import SamplingParams

    from vllm_tokenswift.bench import segments as seg

    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=gen_len, ignore_eos=True, **sp_kwargs)
    before = _spec_counters(llm, collectors)
    was_reset, pbefore = plugin_stats_before(llm) if plugin_stats else (False, None)
    rid = f"seg-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    snaps: list[dict] = []
    steps, n, final, t_first = 0, 0, None, None
    next_mark = 1
    mem_before_finish = None
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        for out in outs:
            if out.request_id != rid:
                continue
            n = len(out.outputs[0].token_ids)
            if out.finished:
                final = out
        if (plugin_stats and final is None and mem_before_finish is None
                and gen_len - n <= (k or 0) + 1):
            # the next step may finish the request and free its state: read its memory now
            mem_before_finish = (snapshot(llm, n, steps, True, collectors).get("plugin") or {}).get("memory")
        if n >= next_mark or (final is not None and (not snaps or snaps[-1]["tokens"] < n)):
            if t_first is None and n:
                t_first = time.perf_counter()
            snaps.append(snapshot(llm, n, steps, plugin_stats, collectors))
            next_mark = (n // segment_tokens + 1) * segment_tokens if n else 1
    wall = time.perf_counter() - t0
    if mem_before_finish and snaps:
        snaps[-1]["memory_before_finish"] = mem_before_finish
    ids = list(final.outputs[0].token_ids)
    rec: dict[str, Any] = {"num_tokens": len(ids), "wall_s": wall}
    rec.update(report.throughput(len(ids), wall, 1))
    if t_first is not None and len(ids) > 1:
        rec["ttft_s"] = t_first - t0
        rec["decode_tokens_per_s"] = (len(ids) - 1) / (t0 + wall - t_first)
    acc = report.acceptance_from_counters(report.counter_delta(before, _spec_counters(llm, collectors)), k)
    rec.update({kk: acc[kk] for kk in ("acceptance_rate", "mean_accepted_length", "num_drafts",
                                        "num_draft_tokens", "num_accepted_tokens",
                                        "draft_token_acceptance", "acceptance_per_pos")})
    if plugin_stats:
        rec.update(plugin_stats_after(llm, was_reset, pbefore, k or 0))
    rec.update(report.distinct_scores([ids]))
    try:
        rec["segments"] = seg.segments_from_snapshots(snaps, ids, k)
    except Exception as e:  # noqa: BLE001 - figures of the run, not the run: keep its tokens
        logger.exception("per-segment figures failed")
        rec["segments_error"] = f"{type(e).__name__}: {e}"
    return rec, [ids]


def warmup(llm: Any, prompt: list[int], tokens: int = 32,
           sp_kwargs: dict[str, Any] | None = None) -> None:
    """Untimed generate of ``tokens`` tokens (first-call allocations, caches);
    greedy unless ``sp_kwargs`` are given."""
    if tokens <= 0:
        return
    from vllm import SamplingParams
    kw = dict(sp_kwargs) if sp_kwargs else {"temperature": 0.0}
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(max_tokens=tokens, ignore_eos=True, **kw), use_tqdm=False)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fill_identical_to_ar(records: list[dict], outputs: dict[tuple, list[list[int]]]) -> None:
    """Set ``identical_to_ar`` (greedy only) and ``ar_common_prefix_tokens`` in place.

    ``outputs`` maps ``(method, gen_len, batch_size, sampling, repeat)`` to output ids;
    the reference is the first AR repeat of the same gen_len / batch size (so for
    ``ar`` itself the field says whether its repeats are deterministic).
    """
    for r in records:
        r.setdefault("identical_to_ar", None)
        if r.get("sampling") != "greedy" or r.get("status") != "ok":
            continue
        key = (r["method"], r["gen_len"], r["batch_size"], r["sampling"], r["repeat"])
        ref = next((outputs[kk] for kk in sorted(outputs, key=lambda t: t[4])
                    if kk[0] == "ar" and kk[1:4] == key[1:4]), None)
        mine = outputs.get(key)
        if ref is None or mine is None:
            continue
        r["identical_to_ar"] = all(a == b for a, b in zip(mine, ref)) and len(mine) == len(ref)
        r["ar_common_prefix_tokens"] = min(_common_prefix(a, b) for a, b in zip(mine, ref))


def _settings(cfg: BenchConfig) -> list[tuple[int, int, str]]:
    return [(g, b, s) for g in cfg.gen_lens for b in cfg.batch_sizes for s in cfg.samplings]


def _base_record(method: str, g: int, b: int, s: str, rep: int, prefix: int, cfg: BenchConfig,
                 spec: dict | None, engine: int = 0) -> dict[str, Any]:
    rec = {"method": method, "gen_len": g, "batch_size": b, "sampling": s, "repeat": rep, "engine": engine,
           "status": "ok", "prefix_len": prefix, "model": cfg.model, "yarn": cfg.yarn,
           "num_speculative_tokens": (spec or {}).get("num_speculative_tokens"),
           "speculative_config": spec, "note": None}
    for f in report.RECORD_FIELDS:
        rec.setdefault(f, None)
    rec["status"] = "ok"
    return rec


def run_bench(cfg: BenchConfig, progress: bool = True,
              on_records: Callable[[list[dict]], None] | None = None,
              bar_file: TextIO | None = None) -> list[dict]:
    """Run every method and setting of ``cfg``; return the records.

    ``engine_scope`` ``"method"``/``"setting"``: one engine at a time, each running all
    repeats of its settings in a row. ``"interleave"``: every method's engine is started
    first and kept (an idle vLLM engine uses no CPU, only memory), then the runs go
    round by round: for each setting and repeat, every method once in turn. Slow drift
    of a shared machine then hits all methods of a round alike, and each run's speedup
    is taken against the AR run of its own round (``paired_speedup``).

    ``cfg.engines`` > 1 does all of this once per engine instance (fresh engines each
    time; with ``"interleave"`` the methods' order rotates by one per instance), with
    the repeats numbered across instances (instance ``e``'s runs are ``e × repeats`` to
    ``(e + 1) × repeats - 1``) and each record's ``engine`` giving its instance.

    Args:
        cfg: the benchmark settings.
        progress: show tqdm bars (runs and engines).
        on_records: called with all records so far after each engine (``"interleave"``:
            after each round), for incremental saving.
        bar_file: stream of the progress bar (default stderr; see :func:`engine_output_to`).
    """
    from tqdm import tqdm

    max_len = model_max_len(cfg.model, cfg.yarn)
    prefix = effective_prefix_len(cfg.prefix_len, cfg.gen_lens, max_len)
    streams = load_prompt_tokens(cfg)
    prompts_by_b = {b: build_prompts(streams, b, prefix) for b in cfg.batch_sizes}
    settings = _settings(cfg)
    records: list[dict] = []
    outputs: dict[tuple, list[list[int]]] = {}
    n_inst = max(1, int(cfg.engines))
    total_runs = len(cfg.methods) * len(settings) * cfg.repeats * n_inst
    bar = tqdm(total=total_runs, desc="bench runs", disable=not progress, file=bar_file or sys.stderr,
               dynamic_ncols=True)
    tok_dir = os.path.join(cfg.out_dir, "tokens")
    interleave = cfg.engine_scope == "interleave"
    unavailable: set[str] = set()   # recorded once, not per engine instance

    def finish() -> None:
        fill_identical_to_ar(records, outputs)
        report.compute_speedups(records)
        if on_records is not None:
            on_records(records)

    def start(method: str, group: list[tuple[int, int, str]], inst: int) -> dict | None:
        """Start and warm up instance ``inst`` of ``method``'s engine for ``group``; None
        (records written) when the method is unavailable or its engine fails to start."""
        try:
            spec = speculative_config(method, cfg)
            engine_args = method_engine_args(method, cfg)
        except ValueError as e:
            spec, why = None, str(e)
        else:
            why = method_unavailable(method, spec)
        if why:
            if method not in unavailable:
                unavailable.add(method)
                for g, b, s in group:
                    rec = _base_record(method, g, b, s, 0, prefix, cfg, spec)
                    rec.update(status="unavailable", note=f"unavailable: {why}")
                    records.append(rec)
                logger.warning("%s unavailable: %s", method, why)
            bar.update(len(group) * cfg.repeats)
            return None
        is_ts = bool(spec) and spec.get("method") == "tokenswift"
        mml = prefix + max(g for g, _, _ in group) + 64
        budget = ((spec or {}).get("tokenswift") or {}).get("kv_budget") if is_ts else None
        if budget and budget > mml and (max_len is None or budget <= max_len):
            mml = int(budget)  # the plugin refuses kv_budget > max_model_len; no memory cost
        llm = None
        try:
            bar.set_postfix_str(f"{method}: starting engine" + (f" {inst + 1}/{n_inst}" if n_inst > 1 else ""))
            llm = build_engine(cfg, spec, mml, engine_args)
            warmup(llm, prompts_by_b[group[0][1]][0], cfg.warmup_tokens)
            for g, b, s in group:   # untimed: first use of each batch shape / sampling path
                try:
                    warmup(llm, prompts_by_b[b][0], cfg.warmup_tokens, sampling_kwargs(method, s, spec)[0])
                except Exception:
                    logger.debug("warm-up failed", exc_info=True)
        except Exception as e:  # engine cannot start: record and go on
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            logger.exception("%s: engine failed", method)
            for g, b, s in group:
                rec = _base_record(method, g, b, s, inst * cfg.repeats, prefix, cfg, spec, engine=inst)
                rec.update(status="error", note=f"engine start failed: {msg}"[:500])
                records.append(rec)
            bar.update(len(group) * cfg.repeats)
            teardown_engine(llm)
            return None
        return {"llm": llm, "spec": spec, "k": (spec or {}).get("num_speculative_tokens"), "is_ts": is_ts,
                # interleave: read this engine's counters from its own collectors
                "collectors": spec_metric_collectors() if interleave else None}

    def run_one(method: str, eng: dict, g: int, b: int, s: str, inst: int, r: int) -> None:
        """Time repeat ``r`` of engine instance ``inst`` of ``method`` at one setting (its
        record's ``repeat`` is numbered across instances)."""
        rep = inst * cfg.repeats + r
        bar.set_postfix_str(f"{method} gen={g} b={b} {s} r{rep}" + (f" e{inst}" if n_inst > 1 else ""))
        sp_kw, note = sampling_kwargs(method, s, eng["spec"])
        rec = _base_record(method, g, b, s, rep, prefix, cfg, eng["spec"], engine=inst)
        rec["note"] = note
        rec["paired_speedup"] = interleave
        try:
            if cfg.segment_tokens and b == 1:
                fields, ids = timed_run_segments(eng["llm"], prompts_by_b[b][0], sp_kw, g, eng["k"],
                                                 cfg.segment_tokens, plugin_stats=eng["is_ts"],
                                                 collectors=eng["collectors"])
            else:
                fields, ids = timed_run(eng["llm"], prompts_by_b[b], sp_kw, g, eng["k"],
                                        plugin_stats=eng["is_ts"], collectors=eng["collectors"])
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            rec.update(status="error", note=f"{type(e).__name__}: {msg}"[:500])
            logger.exception("%s gen=%d b=%d %s failed", method, g, b, s)
        else:
            rec.update(fields)
            outputs[(method, g, b, s, rep)] = ids
            if cfg.save_tokens:
                os.makedirs(tok_dir, exist_ok=True)
                with open(os.path.join(tok_dir, f"{method}_g{g}_b{b}_{s}_r{rep}.json"),
                          "w", encoding="utf-8") as f:
                    json.dump(ids, f)
        records.append(rec)
        bar.update(1)

    if interleave:
        for inst in range(n_inst):
            shift = inst % len(cfg.methods)
            order = list(cfg.methods[shift:]) + list(cfg.methods[:shift])
            engines: dict[str, dict] = {}
            try:
                for method in order:
                    eng = start(method, settings, inst)
                    if eng is not None:
                        engines[method] = eng
                for g, b, s in settings:
                    for rep in range(cfg.repeats):
                        for method in order:
                            if method in engines:
                                run_one(method, engines[method], g, b, s, inst, rep)
                        finish()
            finally:
                for method, eng in engines.items():
                    bar.set_postfix_str(f"{method}: teardown")
                    teardown_engine(eng["llm"])
    else:
        for method in cfg.methods:
            groups = ([settings] if cfg.engine_scope == "method" else [[st] for st in settings])
            for group in groups:
                for inst in range(n_inst):
                    eng = start(method, group, inst)
                    if eng is None:
                        continue
                    for g, b, s in group:
                        for rep in range(cfg.repeats):
                            run_one(method, eng, g, b, s, inst, rep)
                    bar.set_postfix_str(f"{method}: teardown")
                    teardown_engine(eng["llm"])
            finish()
    bar.close()
    fill_identical_to_ar(records, outputs)
    report.compute_speedups(records)
    return records
