"""``vllm-tokenswift bench``: offline vLLM benchmark of AR / TokenSwift / n-gram / suffix.

Example::

    vllm-tokenswift bench --methods ar,tokenswift,ngram,suffix --gen-lens 2048,4096 \\
        --batch-sizes 1 --sampling greedy,paper --repeats 1 --out runs/bench

writes ``results.json``, ``results.csv``, ``summary.md`` and PNG plots to ``--out``;
vLLM's log lines go to ``OUT/vllm.log`` (``--verbose``: to the terminal). The target is
SmolLM2-135M-Instruct with its heads by default (``--model tiny``: the bundled demo model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in _csv(s)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def name_json_arg(s: str) -> tuple[str, Any]:
    """argparse ``type`` for ``NAME=JSON`` options (``--method-config`` here,
    ``--ts-variant`` of ``docs/research/step_trace.py``): ``(NAME, parsed JSON)``.

    Raises:
        argparse.ArgumentTypeError: no ``=``, an empty name, or bad JSON.
    """
    name, sep, js = s.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {s!r}")
    try:
        return name.strip(), json.loads(js)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name}: bad JSON: {e}") from e


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` sub-command on an argparse ``subparsers`` object."""
    from vllm_tokenswift.bench import harness as h
    from vllm_tokenswift.cli.models import add_target_args

    p = subparsers.add_parser(
        "bench", help="benchmark AR / TokenSwift / n-gram / suffix decoding with vLLM offline",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", type=_csv, default=["ar", "tokenswift", "ngram", "suffix"],
                   help="comma-separated; known: " + ", ".join(h.KNOWN_METHODS)
                        + " (default ar,tokenswift,ngram,suffix)")
    p.add_argument("--gen-lens", type=_ints, default=None,
                   help="generated tokens per sequence, comma-separated (default: "
                        + ",".join(map(str, h.CPU_GEN_LENS)) + " on CPU, the paper's "
                        + ",".join(map(str, h.GPU_GEN_LENS)) + " on CUDA, cut to the model's window "
                        "(max_position_embeddings x --yarn) minus the prefix, which is added as the "
                        "longest length when it cuts the ladder)")
    p.add_argument("--batch-sizes", type=_ints, default=[1], help="comma-separated (default 1)")
    p.add_argument("--sampling", type=_csv, default=["greedy", "paper"],
                   help="greedy,paper (default both); paper = T 1.0, min_p 0.1, repetition "
                        "penalty 1.2 over a 1024-token window; paper-no-min-p = the same "
                        "without min_p, for every method alike")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per setting and engine instance (default 1)")
    p.add_argument("--engines", type=int, default=1,
                   help="engine instances per method, each started afresh after the previous one "
                        "is torn down (default 1): two instances of one engine differ in speed by "
                        "1-8%%, which repeats on one instance do not average out; with --interleave "
                        "every round of instances rotates the methods' order")
    p.add_argument("--out", default=os.path.join("runs", "bench-" + time.strftime("%Y%m%d-%H%M%S")),
                   help="output folder (default runs/bench-TIMESTAMP)")
    add_target_args(p, yarn_note="; bench then picks its default lengths from the longer window")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--prompt-files", nargs="+", default=None,
                   help=".txt prompts (tokenized) or .json token-id lists; default: bundled prompts")
    p.add_argument("--random-prompts", action="store_true",
                   help="seeded random token ids instead of prompt files (smoke tests)")
    p.add_argument("--prefix-len", type=int, default=2048,
                   help="prompt tokens per sequence, capped to fit the model window (default 2048)")
    p.add_argument("--k", type=int, default=h.DEFAULT_K,
                   help=f"TokenSwift num_speculative_tokens (default {h.DEFAULT_K})")
    p.add_argument("--kv-budget", type=int, default=h.DEFAULT_KV_BUDGET,
                   help=f"TokenSwift draft KV budget in tokens (default {h.DEFAULT_KV_BUDGET}); "
                        "a kv_budget in --tokenswift wins")
    p.add_argument("--tokenswift", type=json.loads, default={},
                   help='JSON merged into every variant\'s "tokenswift" settings, e.g. \'{"sink_tokens": 32}\'')
    p.add_argument("--method-config", type=name_json_arg, action="append", default=[],
                   metavar="NAME=JSON",
                   help="define or override a method's speculative_config ('null' = AR), repeatable")
    p.add_argument("--engine-scope", choices=["method", "setting", "interleave"], default="method",
                   help="one engine per method (default) or per (method, gen_len, batch, sampling); "
                        "interleave: all methods' engines at once (memory: one engine each), runs "
                        "alternating method by method, round by round, speedups paired per round")
    p.add_argument("--interleave", dest="engine_scope", action="store_const", const="interleave",
                   help="same as --engine-scope interleave")
    p.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                   help="let vLLM compile the model (slower start)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size in GiB (default 1)")
    p.add_argument("--dtype", default="float32", help="model dtype (default float32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-tokens", type=int, default=32,
                   help="tokens of each untimed warm-up generate (default 32)")
    p.add_argument("--save-tokens", action="store_true", help="write output token ids per run")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="extra vllm.LLM keyword argument, repeatable (e.g. block_size=32)")
    p.add_argument("--cpu-threads-bind", default=None,
                   help="sets VLLM_CPU_OMP_THREADS_BIND (e.g. 0 or 0-1) before vLLM starts")
    p.add_argument("--book", dest="books", type=_csv, default=None, metavar="ID[,ID...]",
                   help="prompts from these Project Gutenberg books of the pg-books corpus (e.g. 28054, "
                        "The Brothers Karamazov, which the demo model never saw) instead of "
                        "--prompt-files; $TOKENSWIFT_BOOKS names the corpus file")
    p.add_argument("--segment-tokens", type=int, default=0, metavar="N",
                   help="batch-1 runs: figures per N-token segment of the output (segments.md/png): "
                        "speed, α, β, decision mix, proposer time and memory (default 0: off)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true",
                   help="show vLLM's log lines instead of writing them to OUT/vllm.log")
    p.set_defaults(func=run_cli)
    r = subparsers.add_parser(
        "bench-report", help="merge results.json files of several bench runs into one report",
        description="Concatenate the records of several `vllm-tokenswift bench` runs (each with "
                    "its own AR baseline) and write one results.json/csv, summary.md and the PNGs.")
    r.add_argument("results", nargs="+", help="results.json files (or folders holding one)")
    r.add_argument("--out", required=True, help="output folder")
    r.add_argument("--title-note", default=None, help="extra line for summary.md's header")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    r.set_defaults(func=run_report_cli)
    t = subparsers.add_parser(
        "bench-table", help="one table of every setting against every method, from several bench runs",
        description="Pivot the results.json of several `vllm-tokenswift bench` runs into one row per "
                    "setting (model, YaRN, sampling, batch, length) and one column per method "
                    "(× AR of the same invocation, median over runs), with the TokenSwift decision "
                    "mix and its verdicts against AR and the best peer.")
    t.add_argument("results", nargs="+", help="results.json files (or folders holding one)")
    t.add_argument("--methods", type=_csv, default=None,
                   help="method columns in order (default: tokenswift, tokenswift-paper, ngram, "
                        "ngram-best, suffix where present, then the others)")
    t.add_argument("--focus", default="tokenswift", help="the method the verdicts are about")
    t.add_argument("--peers", type=_csv, default=["ngram", "ngram-best", "suffix"],
                   help="methods the focus is compared with (default ngram,ngram-best,suffix)")
    t.add_argument("--floor", type=float, default=0.97, help="the \"never slower\" threshold (default 0.97)")
    t.add_argument("--out", default=None, help="also write the table to this markdown file")
    t.add_argument("--png", default=None, help="also write a grouped bar chart to this PNG")
    t.set_defaults(func=run_table_cli)
    return p


def run_table_cli(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-tokenswift bench-table``: prints the table (and writes the
    ``--out`` / ``--png`` files); 0 on success, 2 on unreadable input or no records."""
    from vllm_tokenswift.bench import settings_table as st

    try:
        records = st.load_invocations(args.results)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    methods, rows = st.settings_table(records, methods=args.methods, focus=args.focus,
                                      peers=args.peers, floor=args.floor)
    if not rows:
        print("error: no successful runs in the inputs", file=sys.stderr)
        return 2
    md = st.markdown(methods, rows, focus=args.focus, floor=args.floor)
    print(md)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(md + "\n")
    if args.png:
        st.write_plot(methods, rows, args.png)
    return 0


def run_report_cli(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-tokenswift bench-report``; 0 on success, 2 on unreadable input.

    Speedups are recomputed inside each source file only (a run is compared with the AR
    run of the same invocation, never with another invocation's AR)."""
    from vllm_tokenswift.bench import report

    records: list[dict] = []
    sources = []
    for path in args.results:
        try:
            recs, folder = report.load_invocation(path)  # speedups within this invocation
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
        name = os.path.basename(folder)
        records.extend(recs)
        cfg_path = os.path.join(folder, "config.json")
        desc = name
        if os.path.isfile(cfg_path):  # written by `vllm-tokenswift bench` next to results.json
            with open(cfg_path, encoding="utf-8") as fh:
                c = json.load(fh)
            desc += (f" (methods {', '.join(c.get('methods', []))}; gen_lens {c.get('gen_lens')}; "
                     f"batch_sizes {c.get('batch_sizes')}; sampling {', '.join(c.get('samplings', []))}; "
                     f"repeats {c.get('repeats')}; engines {c.get('engines', 1)}; prefix_len {c.get('prefix_len')}; k {c.get('k')}; "
                     f"tokenswift {json.dumps(c.get('tokenswift') or {})}; dtype {c.get('dtype')}; "
                     f"model {os.path.basename(str(c.get('model')))})")
        sources.append(desc)
    keys = [(r.get("method"), r.get("gen_len"), r.get("batch_size"), r.get("sampling"), r.get("repeat"))
            for r in records]
    if len(set(keys)) != len(keys):
        print("error: the inputs overlap (same method/gen_len/batch/sampling/repeat twice)", file=sys.stderr)
        return 2
    meta = {f"source {i + 1}": d for i, d in enumerate(sources)}
    if args.title_note:
        meta["note"] = args.title_note
    paths = report.write_report(records, args.out, meta=meta, plots=not args.no_plots, recompute=False)
    print(report.markdown_table(report.summarize(records)))
    print(f"\nwrote {paths['json']}, {paths['csv']}, {paths['markdown']}"
          + (f" and {len(paths['plots'])} plots" if paths["plots"] else ""))
    return 0


def config_from_args(args: argparse.Namespace, fetch: bool = True):
    """Build a :class:`~vllm_tokenswift.bench.harness.BenchConfig` from parsed args.

    Resolves ``--model`` (``smollm2`` is converted on first use unless ``fetch`` is
    false) and the default heads, and picks the default generation lengths from the
    model's window.

    Raises:
        ValueError: a bad argument (unknown sampling, repeats < 1, bad --engine-arg,
            bad --yarn, a prefix that fills the window).
        vllm_tokenswift.cli.models.ModelFetchError: the model could not be converted.
    """
    from vllm_tokenswift.bench.harness import DEFAULT_KV_BUDGET, SAMPLING_PRESETS, BenchConfig, default_gen_lens
    from vllm_tokenswift.cli.models import model_window, resolve_target, yarn_overrides

    for s in args.sampling:
        if s not in SAMPLING_PRESETS:
            raise ValueError(f"unknown sampling {s!r}; one of {sorted(SAMPLING_PRESETS)}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if getattr(args, "engines", 1) < 1:
        raise ValueError("--engines must be >= 1")
    engine_kwargs = {}
    for kv in args.engine_arg:
        key, sep, val = kv.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg expects KEY=JSON, got {kv!r}")
        try:
            engine_kwargs[key] = json.loads(val)
        except ValueError:
            engine_kwargs[key] = val
    model, heads = resolve_target(args.model, args.heads, fetch=fetch)
    yarn = getattr(args, "yarn", None)
    if yarn:
        yarn_overrides(model, yarn)  # raises ValueError early on a bad factor or config
    gen_lens = args.gen_lens or default_gen_lens(window=model_window(model, yarn),
                                                 prefix_len=args.prefix_len)
    ts = {"kv_budget": getattr(args, "kv_budget", None) or DEFAULT_KV_BUDGET, **dict(args.tokenswift or {})}
    return BenchConfig(
        methods=list(args.methods), gen_lens=list(gen_lens),
        batch_sizes=list(args.batch_sizes), samplings=list(args.sampling),
        repeats=args.repeats, out_dir=args.out, model=model, heads=heads or "",
        tokenizer=args.tokenizer, prompt_files=args.prompt_files,
        random_prompts=args.random_prompts, prefix_len=args.prefix_len, k=args.k,
        tokenswift=ts, method_configs=dict(args.method_config),
        engine_scope=args.engine_scope, enforce_eager=args.enforce_eager,
        kv_cache_gb=args.kv_cache_gb, dtype=args.dtype, seed=args.seed,
        warmup_tokens=args.warmup_tokens, save_tokens=args.save_tokens,
        engine_kwargs=engine_kwargs, yarn=yarn, engines=getattr(args, "engines", 1),
        segment_tokens=max(0, int(getattr(args, "segment_tokens", 0) or 0)),
        books=getattr(args, "books", None))


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-tokenswift bench``; returns 0 when every run succeeded or was
    reported unavailable, 1 when a run failed with an error, 2 on bad arguments."""
    from dataclasses import asdict

    from vllm_tokenswift.bench import harness, report
    from vllm_tokenswift.cli.models import ModelFetchError

    try:
        cfg = config_from_args(args)
    except (ValueError, ModelFetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cpu_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_threads_bind

    os.makedirs(cfg.out_dir, exist_ok=True)
    meta = {k: v for k, v in asdict(cfg).items() if k not in ("engine_kwargs",)}
    meta["engine_kwargs"] = cfg.engine_kwargs
    with open(os.path.join(cfg.out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, default=str)

    def save(records):
        report.write_json(records, os.path.join(cfg.out_dir, "results.json"))

    log = None if getattr(args, "verbose", False) else os.path.join(cfg.out_dir, "vllm.log")
    with harness.engine_output_to(log) as (out, err):
        if log:
            print(f"vLLM log: {log}", file=out, flush=True)
        try:
            records = harness.run_bench(cfg, progress=not args.quiet, on_records=save, bar_file=err)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=err)
            return 2
    md_meta = {"model": cfg.model, "heads": cfg.heads, "prefix_len": records[0]["prefix_len"]
               if records else cfg.prefix_len, "methods": ", ".join(cfg.methods),
               "gen_lens": cfg.gen_lens, "batch_sizes": cfg.batch_sizes,
               "sampling": ", ".join(cfg.samplings), "repeats": cfg.repeats,
               "engines": cfg.engines, "engine_scope": cfg.engine_scope, "dtype": cfg.dtype, "k": cfg.k,
               "tokenswift": json.dumps(cfg.tokenswift), "yarn": cfg.yarn}
    paths = report.write_report(records, cfg.out_dir, meta=md_meta, plots=not args.no_plots)
    rows = report.summarize(records)
    print(report.markdown_table(rows))
    print(f"\nwrote {paths['json']}, {paths['csv']}, {paths['markdown']}"
          + (f" and {len(paths['plots'])} plots" if paths["plots"] else ""))
    return 1 if any(r.get("status") == "error" for r in records) else 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m vllm_tokenswift.bench.cli [args]``."""
    parser = argparse.ArgumentParser(prog="vllm-tokenswift")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
