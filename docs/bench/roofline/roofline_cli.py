"""The roofline projection of ``roofline.py`` as a command, its tables (Markdown) and JSON:
``python docs/bench/roofline/roofline_cli.py project --model qwen2.5-7b --gpu h100 ...``.

Research maths about GPUs, kept beside the docs it produced, not in the plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import (MODEL_PRESETS, GPU_PRESETS, GpuSpec, Projection,  # noqa: E402
                      SpecParams, paper_comparison, project_all, resolve_gpu, resolve_model)


def format_table(projections: list[Projection]) -> str:
    """Plain-text table: model, GPU, method, tokens/step, GB/step, tokens/s, wall minutes."""
    head = (f"{'model':<14} {'gpu':<18} {'method':<11} {'tok/step':>8} {'GB/step':>8} "
            f"{'tok/s':>8} {'ms/tok':>7} {'wall min':>9} {'vs ar':>6}")
    lines = [head, "-" * len(head)]
    ar_wall = {(p.model, p.gpu): p.wall_s for p in projections if p.method == "ar"}
    for p in projections:
        ref = ar_wall.get((p.model, p.gpu))
        sp = f"{ref / p.wall_s:6.2f}" if ref else f"{'-':>6}"
        lines.append(f"{p.model:<14} {p.gpu:<18} {p.method:<11} {p.tokens_per_step:8.2f} "
                     f"{p.bytes_mean_step / 1e9:8.2f} {p.tokens_per_s:8.1f} {p.ms_per_token:7.2f} "
                     f"{p.wall_min:9.1f} {sp}")
    return "\n".join(lines)


def format_paper_comparison(rows: list[dict[str, Any]], gpu: GpuSpec) -> str:
    """Plain-text table of :func:`paper_comparison` rows."""
    head = (f"{'model':<14} {'paper AR':>9} {'roof AR':>8} {'ratio':>6} {'paper TS':>9} "
            f"{'roof TS':>8} {'ratio':>6} {'A':>5} {'paper x':>8} {'roof x':>7} {'paper TB/s':>10} "
            f"{'+ms/tok':>9}")
    lines = [f"Paper vs roofline, minutes for 100K tokens at prefix 4096 on {gpu.name} "
             f"(efficiency {gpu.efficiency:g}); ratio = paper / roofline; A = TokenSwift tokens/step "
             f"from the paper's alpha (1 + 4*alpha); paper TB/s = roofline AR bytes / paper AR time; "
             f"+ms/tok = paper AR time beyond the roofline per token", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<14} {r['paper_ar_min']:9.1f} {r['roofline_ar_min']:8.1f} "
                     f"{r['ratio_ar']:6.1f} {r['paper_tokenswift_min']:9.1f} "
                     f"{r['roofline_tokenswift_min']:8.1f} {r['ratio_tokenswift']:6.1f} "
                     f"{r['tokenswift_accepted_length']:5.2f} {r['paper_speedup']:8.2f} "
                     f"{r['roofline_speedup']:7.2f} {r['paper_ar_effective_tbs']:10.3f} "
                     f"{r['implied_ar_overhead_ms_per_token']:9.1f}")
    ratios = sorted(r["ratio_ar"] for r in rows)
    if not ratios:
        return "\n".join(lines)
    mean_ratio = sum(ratios) / len(ratios)
    med = ratios[len(ratios) // 2] if len(ratios) % 2 else 0.5 * (ratios[len(ratios) // 2 - 1]
                                                                   + ratios[len(ratios) // 2])
    lines.append(f"AR ratio paper/roofline: {ratios[0]:.1f}x-{ratios[-1]:.1f}x (mean {mean_ratio:.1f}x, "
                 f"median {med:.1f}x) -- the paper's decoder ran this far "
                 "below the memory roofline (a finding about its implementation, not an error here). "
                 "Llama3.1-8b paper times are approximate (Fig. 1).")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``project`` sub-command on an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "project", help="GPU roofline projection of AR / TokenSwift / n-gram / suffix wall time",
        description=__doc__.split("\n\n")[0] + " Memory-bandwidth roofline; see module docs.")
    p.add_argument("--model", action="append", default=None,
                   help="preset (" + ", ".join(MODEL_PRESETS) + ") or HF config.json/folder; "
                        "repeatable; default: llama3.1-8b, qwen2.5-7b, qwen2.5-14b")
    p.add_argument("--gpu", default=None,
                   help="a100, h100, h200 or 'all' (default a100, or all when no --bandwidth-tbs)")
    p.add_argument("--bandwidth-tbs", type=float, default=None, help="custom peak HBM bandwidth (TB/s)")
    p.add_argument("--peak-tflops", type=float, default=None, help="custom peak bf16 compute (TFLOP/s)")
    p.add_argument("--efficiency", type=float, default=0.8,
                   help="achievable fraction of peak bandwidth/compute (default 0.8)")
    p.add_argument("--prefix", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--gen", type=int, default=100_000, help="generated tokens (default 100000)")
    p.add_argument("--accepted-length", type=float, default=3.0,
                   help="TokenSwift mean tokens per step incl. bonus (default 3.0)")
    p.add_argument("--ngram-accepted-length", type=float, default=1.8,
                   help="n-gram decoding mean tokens per step (default 1.8)")
    p.add_argument("--suffix-accepted-length", type=float, default=None,
                   help="suffix decoding mean tokens per step (default: the n-gram value)")
    p.add_argument("--kv-budget", type=int, default=4096,
                   help="TokenSwift draft KV budget in tokens; 0 = full cache (default 4096)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (default 4)")
    p.add_argument("--num-heads", type=int, default=3, help="TokenSwift draft heads (default 3)")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="fixed per-step overhead in ms (launch/scheduler), default 0")
    p.add_argument("--dtype-bytes", type=int, default=None, help="override bytes per weight/KV element")
    p.add_argument("--no-paper", action="store_true", help="skip the paper comparison")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the figures as JSON")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-tokenswift project``; prints the tables, returns 0."""
    try:
        models = [resolve_model(m) for m in (args.model or ["llama3.1-8b", "qwen2.5-7b", "qwen2.5-14b"])]
        if args.dtype_bytes:
            models = [replace(m, dtype_bytes=args.dtype_bytes) for m in models]
        if args.bandwidth_tbs is not None:
            gpus = [resolve_gpu(args.gpu, args.bandwidth_tbs, args.efficiency, args.peak_tflops)]
        elif args.gpu in (None, "all"):
            gpus = [resolve_gpu(g, None, args.efficiency, args.peak_tflops) for g in GPU_PRESETS]
        else:
            gpus = [resolve_gpu(args.gpu, None, args.efficiency, args.peak_tflops)]
        spec = SpecParams(k=args.k, accepted_length=args.accepted_length,
                          ngram_accepted_length=args.ngram_accepted_length,
                          suffix_accepted_length=args.suffix_accepted_length,
                          kv_budget=args.kv_budget or None, num_heads=args.num_heads,
                          overhead_s=args.overhead_ms / 1000.0)
        projections = [p for m in models for g in gpus
                       for p in project_all(m, g, args.prefix, args.gen, spec)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Roofline projection: prefix {args.prefix}, gen {args.gen} tokens, k={spec.k}, "
          f"TokenSwift A={spec.accepted_length:g} (kv_budget={spec.kv_budget}), "
          f"n-gram A={spec.ngram_accepted_length:g}, suffix A={spec.tokens_per_step('suffix'):g}, "
          f"overhead {args.overhead_ms:g} ms/step, efficiency {args.efficiency:g}")
    print(format_table(projections))
    out: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
                           "projections": [p.to_dict() for p in projections]}
    if not args.no_paper:
        a100 = resolve_gpu("a100", None, args.efficiency)
        rows = paper_comparison(a100, 4096, 100_000, replace(spec, overhead_s=spec.overhead_s))
        print()
        print(format_paper_comparison(rows, a100))
        out["paper_comparison"] = rows
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m vllm_tokenswift.bench.roofline [args]``."""
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["project", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
