"""Per-step timings of the worker, by what each TokenSwift step did: where a step's time goes.

Starts one engine per method (``ar``, ``ts`` = TokenSwift as shipped, ``suffix``), one
after another, runs one timed generation of ``--new-tokens`` tokens for ``--batch-size``
book prompts, and records for every engine step, inside the worker (``collective_rpc``
wraps the model runner's methods; nothing of the package is changed): the tokens it
scheduled, ``execute_model`` (the target's forward), ``sample_tokens`` (sampling or
rejection sampling, bookkeeping and the proposer), the proposer alone, and the gap before
the next step (scheduler, output handling). For TokenSwift it also records what the
proposer decided for the *next* step: rows taking the draft forward (F), the fused heads
(U) or an n-gram chain (N), rows forced to try (exploration), draft tokens, and the
milliseconds of the draft forward and fused heads. Prints a table per method grouped by
that decision, and per number of scheduled tokens.

    python docs/research/step_trace.py --methods ar,ts --batch-size 8 --new-tokens 1024 --sampling paper

The methods run one after another (not interleaved), so compare their per-step figures,
not their wall times, and only within one invocation. With ``--rounds R`` (R > 1) every
method's engine is started first and kept, and the runs alternate round by round, so slow
drift of the machine hits every method alike; a last table then gives, per quarter of the
run, the median milliseconds of single-token steps per method (medians over rounds):
where a per-step gap between two engines lies, and whether it grows with the output.
``ts-empty`` is a TokenSwift engine whose proposer returns no drafts at once;
``--ts-variant NAME=JSON`` adds TokenSwift engines with other settings (an A/B in one run).
A last table splits every run's steps by width (plain, drafts verified, the batch's tail,
prefill); ``--from-json FILE`` prints all tables again from a run saved with ``--json``.

    python docs/research/step_trace.py --model tiny --k 4 --methods ar,ts-empty,ts \
        --batch-size 1 --new-tokens 16384 --rounds 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time


def _instrument(worker):
    """Wrap the runner's ``execute_model``/``sample_tokens``/``propose_draft_token_ids``
    (and the TokenSwift proposer's ``_draft``) to record one dict per engine step."""
    import collections as _c
    import time as _t

    r = worker.model_runner
    r._trace, r._trace_end, r._trace_cur = [], None, None
    ex, sm, pr = r.execute_model, r.sample_tokens, r.propose_draft_token_ids

    def execute_model(so, *a, **k):
        t0 = _t.perf_counter()
        out = ex(so, *a, **k)
        r._trace_cur = {"tok": int(so.total_num_scheduled_tokens), "exec": _t.perf_counter() - t0,
                        "gap": (t0 - r._trace_end) if r._trace_end else 0.0, "prop": 0.0}
        return out

    def sample_tokens(*a, **k):
        t0 = _t.perf_counter()
        out = sm(*a, **k)
        t1 = _t.perf_counter()
        if r._trace_cur is not None:
            r._trace_cur["sample"] = t1 - t0
            r._trace.append(r._trace_cur)
            r._trace_cur = None
        r._trace_end = t1
        return out

    def propose_draft_token_ids(*a, **k):
        t0 = _t.perf_counter()
        out = pr(*a, **k)
        if r._trace_cur is not None:
            r._trace_cur["prop"] += _t.perf_counter() - t0
        return out

    r.execute_model, r.sample_tokens, r.propose_draft_token_ids = execute_model, sample_tokens, propose_draft_token_ids
    d = getattr(r, "drafter", None)
    if d is not None and hasattr(d, "_hand_over"):
        hand_over = d._hand_over

        def _hand_over(step, plan, drafts):
            # the proposer's step 5: (StepInput, StepPlan, Drafts) -> StepProposal; each row's
            # decision is in its state's ``last`` proposal once the original has run
            proposal = hand_over(step, plan, drafts)
            kinds = _c.Counter(r_.state.last.kind for r_ in plan.rows)
            if r._trace_cur is not None:
                r._trace_cur.update({
                    "F": kinds.get("forward", 0), "U": kinds.get("fused", 0), "N": kinds.get("ngram", 0),
                    "forced": sum(1 for f in plan.forced if f),
                    "drafted": sum(len(proposal.draft_token_ids[r_.batch_row]) for r_ in plan.rows),
                    "fwd": drafts.forward[0] if drafts.forward else 0.0,
                    "fused": drafts.fused[0] if drafts.fused else 0.0})
            return proposal

        d._hand_over = _hand_over
    return True


def _by_quarter(records: dict) -> str:
    """Per method and quarter of the run, medians (over rounds) of the per-round median
    milliseconds of single-token steps: execute_model, sampling (proposer excluded),
    proposer, gap."""
    ms = 1000.0
    cols = (("exec", lambda x: x["exec"]), ("sample-prop", lambda x: x.get("sample", 0.0) - x.get("prop", 0.0)),
            ("proposer", lambda x: x.get("prop", 0.0)), ("gap", lambda x: x.get("gap", 0.0)))
    lines = ["single-token steps, median ms per quarter of the run (median over rounds):",
             "  method      quarter  " + "  ".join(f"{h:>11}" for h, _ in cols) + "        sum"]
    for name, runs in records.items():
        for q in range(4):
            parts = [[x for x in st[q * len(st) // 4:(q + 1) * len(st) // 4] if x["tok"] == 1]
                     for st in (run["steps"] for run in runs)]
            parts = [p for p in parts if p]
            if not parts:
                continue
            vals = [statistics.median(statistics.median(f(x) for x in p) * ms for p in parts) for _, f in cols]
            lines.append(f"  {name:<11} {q + 1:>7}  " + "  ".join(f"{v:11.2f}" for v in vals)
                         + f"  {sum(vals):9.2f}")
    return "\n".join(lines)


def _by_width(records: dict, batch_size: int, k: int) -> str:
    """Per run, the steps by how many tokens they scheduled against the batch: ``plain``
    (exactly ``batch_size``: every request decodes one token, no drafts), ``drafts``
    (more, up to ``batch_size × (k + 1)``: draft tokens verified; the extra execute_model
    milliseconds per step over the plain steps' median, and the draft tokens), ``tail``
    (fewer: requests that already finished, or had not started) and ``prefill`` (more than
    that). Seconds are execute_model + sampling + gap: what the run spent in them."""
    ms = 1000.0
    lines = [f"steps by width (batch {batch_size}): count, seconds; drafts: extra ms per step over "
             "the plain median, draft tokens",
             "  method      round   plain      s     drafts      s  extra ms  tokens    tail      s  "
             "prefill      s  proposer s"]
    cap = batch_size * (k + 1)
    for name, runs in records.items():
        for run in runs:
            st = run["steps"]
            parts = {"plain": [x for x in st if x["tok"] == batch_size],
                     "drafts": [x for x in st if batch_size < x["tok"] <= cap],
                     "tail": [x for x in st if x["tok"] < batch_size],
                     "prefill": [x for x in st if x["tok"] > cap]}

            def secs(xs):
                return sum(x["exec"] + x.get("sample", 0.0) + x.get("gap", 0.0) for x in xs)

            plain_med = statistics.median(x["exec"] for x in parts["plain"]) if parts["plain"] else 0.0
            d = parts["drafts"]
            extra = (statistics.mean(x["exec"] for x in d) - plain_med) * ms if d else 0.0
            lines.append(f"  {name:<11} {run.get('round', 0):>5} {len(parts['plain']):7d} {secs(parts['plain']):6.1f} "
                         f"{len(d):10d} {secs(d):6.1f} {extra:9.1f} {sum(x['tok'] - batch_size for x in d):7d} "
                         f"{len(parts['tail']):7d} {secs(parts['tail']):6.1f} {len(parts['prefill']):8d} "
                         f"{secs(parts['prefill']):6.1f} {sum(x.get('prop', 0.0) for x in st):11.2f}")
    return "\n".join(lines)


def _take(worker):
    r = worker.model_runner
    out, r._trace, r._trace_end = r._trace, [], None
    return out


def _summary(name: str, wall: float, steps: list[dict], first: dict | None = None) -> str:
    ms = 1000.0
    lines = [f"== {name}: wall {wall:.1f} s, {len(steps)} steps"]
    if first:
        lines.append(f"  first step (prefill): {first['tok']} tokens, exec {first['exec'] * ms:.1f} ms, "
                     f"sample {(first.get('sample', 0.0) - first.get('prop', 0.0)) * ms:.1f} ms, "
                     f"proposer {first.get('prop', 0.0) * ms:.1f} ms")
    groups = collections.defaultdict(list)
    for s in steps:
        key = "".join(c for c in "FUN" if s.get(c)) or ("none" if "F" in s else "-")
        groups[key].append(s)
    lines.append("  next step  steps  sched tok  exec ms  sample ms  proposer ms  fwd ms  fused ms  gap ms  forced  drafted")
    for key, xs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        def m(k):
            return statistics.mean((x.get(k) or 0.0) for x in xs)
        lines.append(f"  {key:<9} {len(xs):6d} {m('tok'):10.2f} {m('exec') * ms:8.2f} {(m('sample') - m('prop')) * ms:10.2f} "
                     f"{m('prop') * ms:12.2f} {m('fwd') * ms:7.2f} {m('fused') * ms:9.2f} {m('gap') * ms:7.2f} "
                     f"{m('forced'):7.2f} {m('drafted'):8.2f}")
    by = collections.defaultdict(list)
    for s in steps:
        by[s["tok"]].append(s["exec"])
    common = sorted(by.items(), key=lambda kv: -len(kv[1]))[:8]
    lines.append("  execute_model ms by scheduled tokens (most frequent): " + ", ".join(
        f"{t}: {statistics.median(v) * ms:.1f} (n={len(v)})" for t, v in sorted(common)))
    return "\n".join(lines)


def main() -> None:
    from vllm_tokenswift.bench.cli import name_json_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ar,ts")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--sampling", default="paper", choices=("paper", "greedy"))
    ap.add_argument("--model", default="smollm2",
                    help="target: smollm2 (default), tiny (the bundled 12.6M demo model) or a folder")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of ts and suffix")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per method, alternating round by round with every engine kept (default 1: "
                         "one run each, engines one after another)")
    ap.add_argument("--ts-variant", type=name_json_arg, action="append", default=[], metavar="NAME=JSON",
                    help="another TokenSwift engine NAME with these \"tokenswift\" settings merged into "
                         "ts's, e.g. 'ts-old={\"policy_tuning\": {\"explore_beside_ngram\": true}}' "
                         "(repeatable; list NAME in --methods)")
    ap.add_argument("--json", default=None, help="write every step's record here")
    ap.add_argument("--log", default="/tmp/step_trace.log", help="vLLM's own log lines go here")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="print the tables of a run saved with --json (no engine is started)")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        a, records = saved["args"], saved["runs"]
        for name, runs in records.items():
            for run in runs:
                label = name if len(runs) == 1 else f"{name} (round {run.get('round', 0)})"
                print(_summary(label, run["wall_s"], run["steps"], run.get("first")))
        if any(len(runs) > 1 for runs in records.values()):
            print(_by_quarter(records))
        print(_by_width(records, a["batch_size"], a["k"]))
        return
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc with callables
    from vllm_tokenswift.bench.harness import (DEFAULT_KV_BUDGET, SAMPLING_PRESETS, BenchConfig, build_prompts,
                                               empty_proposer, engine_output_to, load_prompt_tokens, teardown_engine)

    with engine_output_to(args.log) as (out, _err):
        from vllm import LLM, SamplingParams

        from vllm_tokenswift.cli.models import resolve_target

        model, heads = resolve_target(args.model)
        prompts = build_prompts(load_prompt_tokens(BenchConfig(model=model, prefix_len=args.prefix_len)),
                                args.batch_size, args.prefix_len)
        specs = {"ar": None,
                 "ts": {"method": "tokenswift", "model": heads, "num_speculative_tokens": args.k,
                        "tokenswift": {"kv_budget": DEFAULT_KV_BUDGET, "log_interval_s": 0}},
                 "suffix": {"method": "suffix", "num_speculative_tokens": args.k,
                            "suffix_decoding_max_cached_requests": 0}}
        sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, **SAMPLING_PRESETS[args.sampling])
        if args.sampling == "paper":
            sp_other = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True,
                                      **SAMPLING_PRESETS["paper-no-min-p"])
        specs["ts-empty"] = specs["ts"]
        for name, extra in args.ts_variant:
            specs[name] = {**specs["ts"], "tokenswift": {**specs["ts"]["tokenswift"], **extra}}
        names = args.methods.split(",")
        bad = [n for n in names if n not in specs]
        if bad:
            raise SystemExit(f"unknown methods {bad}; choose from {', '.join(specs)}")
        if args.rounds < 1:
            raise SystemExit("--rounds must be at least 1")
        records = {name: [] for name in names}
        engines = {}

        def start(name):
            print(f"starting {name} ...", file=out, flush=True)
            llm = LLM(model=model, dtype="float32", max_model_len=args.prefix_len + args.new_tokens + 64,
                      enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=int(1.25 * 2**30),
                      seed=0, speculative_config=specs[name], max_num_seqs=args.batch_size)
            if name == "ts-empty":
                llm.collective_rpc(empty_proposer)
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=32), use_tqdm=False)
            llm.collective_rpc(_instrument)
            return llm

        if args.rounds > 1:
            for name in names:
                engines[name] = start(name)
        for rnd in range(args.rounds):
            for name in names:
                llm = engines.get(name) or start(name)
                llm.collective_rpc(_take)
                # stock vLLM refuses min_p with suffix decoding: that run drops it (as the benchmark does)
                params = sp_other if (name == "suffix" and args.sampling == "paper") else sp
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                wall = time.perf_counter() - t
                taken = llm.collective_rpc(_take)[0]
                steps = taken[1:]    # the first step's gap reaches back to the warm-up
                first = dict(taken[0], gap=0.0) if taken else None    # the prefill step
                records[name].append({"round": rnd, "wall_s": wall, "steps": steps, "first": first})
                label = name if args.rounds == 1 else f"{name} (round {rnd})"
                print(_summary(label, wall, steps, first), file=out, flush=True)
                if specs[name] is not None and specs[name]["method"] == "tokenswift":
                    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

                    st = get_engine_stats(llm) or {}
                    cm = st.get("cost_model") or {}
                    print("  adaptive policy's cost model (ms): " + ", ".join(
                        f"{k} {v * 1000:.1f}" for k, v in cm.items()) + f"; steps by kind {st.get('steps_by_kind')}",
                          file=out, flush=True)
                if args.rounds == 1:
                    teardown_engine(llm)
        if args.rounds > 1:
            print(_by_quarter(records), file=out, flush=True)
            for llm in engines.values():
                teardown_engine(llm)
        print(_by_width(records, args.batch_size, args.k), file=out, flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "runs": records}, fh)


if __name__ == "__main__":
    main()
