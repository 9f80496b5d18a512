"""Tables and plots of a serving benchmark block (``scripts/bench-serve.sh``): reads the
``--save-result`` JSONs that ``vllm bench serve`` (``vllm-tokenswift bench-serve``) wrote
into a folder, prints one Markdown table per sampling (and per request rate for open-loop
runs), writes them to ``report.md`` and draws ``tpot-<sampling>.png`` and
``throughput-<sampling>.png`` (median TPOT and output tokens/s against concurrency, one
line per method) with matplotlib.

Columns, all from vLLM's result JSON (units as there): completed / failed requests,
output tokens/s (``output_throughput``), × plain (output tokens/s over the ``plain``
method's at the same concurrency and sampling), requests/s, TTFT, TPOT and ITL p50 and
p99 in ms (p90 too where the run asked for it: ``--metric-percentiles 50,90,99``), goodput
(requests/s within ``--goodput``), and vLLM's speculative-decoding counters of the run
(acceptance rate, mean acceptance length, drafts) where the server speculated.

The method, sampling, block and round of a run come from its ``--metadata method=...
sampling=... block=... round=...`` (the script sets them); the concurrency from vLLM's
``max_concurrency``. Paired rounds (``ROUNDS`` in the script: in each round every method
runs once) are merged into one row per method, sampling, concurrency and rate: every
figure is the median over the rounds, × plain the median of each round's ratio to the
plain run of the same round, with the rounds' lowest and highest ratio beside it. Engine-free: neither vLLM nor torch is imported; matplotlib only
to draw. ``python -m vllm_tokenswift.bench.serving_report FOLDER [--no-plots]``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Sequence

from vllm_tokenswift.bench.serving import load_results

#: method order in tables and legends (others follow by name)
METHOD_ORDER = ("plain", "ar-vk", "tokenswift", "ngram-vk", "suffix-vk")


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _pct(r: dict, metric: str, p: str) -> float | None:
    """``p`` ("50", "90", "99") percentile of ``metric`` in ms; vLLM writes p50 as
    ``median_<metric>_ms`` and the others as ``p<p>_<metric>_ms``."""
    if p == "50":
        return _num(r.get(f"median_{metric}_ms", r.get(f"p50_{metric}_ms")))
    return _num(r.get(f"p{p}_{metric}_ms"))


def rows(results: Sequence[dict]) -> list[dict]:
    """One row per run: ``method``, ``sampling``, ``concurrency`` (None: no cap),
    ``rate`` (requests/s; None: all at once), ``round`` (int, 1 when the run has no
    ``round`` metadata), the counts, throughputs, latency percentiles (``ttft_p50`` ... in
    ms, None where the run did not report them), ``goodput``, ``speedup`` (output tokens/s
    over ``plain``'s at the same sampling, concurrency, rate and round; None without such a
    run) and the spec-decode counters."""
    out = []
    for r in results:
        rate = r.get("request_rate")
        row = {"method": r.get("method") or r.get("label") or "?", "sampling": r.get("sampling") or "?",
               "concurrency": r.get("max_concurrency"), "rate": None if rate in (None, "inf") else _num(rate),
               "completed": r.get("completed"), "failed": r.get("failed"),
               "output_tps": _num(r.get("output_throughput")), "req_s": _num(r.get("request_throughput")),
               "goodput": _num(r.get("request_goodput")),
               "acceptance_rate": _num(r.get("spec_decode_acceptance_rate")),
               "acceptance_length": _num(r.get("spec_decode_acceptance_length")),
               "drafts": r.get("spec_decode_num_drafts"), "round": _round(r.get("round"))}
        for m in ("ttft", "tpot", "itl", "e2el"):
            for p in ("50", "90", "99"):
                row[f"{m}_p{p}"] = _pct(r, m, p)
        out.append(row)
    base = {(x["sampling"], x["concurrency"], x["rate"], x["round"]): x["output_tps"]
            for x in out if x["method"] == "plain"}
    for x in out:
        b = base.get((x["sampling"], x["concurrency"], x["rate"], x["round"]))
        x["speedup"] = x["output_tps"] / b if b and x["output_tps"] is not None else None
    return sorted(out, key=_order)


def _round(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 1


#: summed over the rounds when they are merged (the others are medians)
_SUMMED = ("completed", "failed")
_KEYS = ("method", "sampling", "concurrency", "rate")


def merge_rounds(rs: Sequence[dict]) -> list[dict]:
    """One row per method, sampling, concurrency and rate from :func:`rows`' per-run rows:
    ``rounds`` (how many), ``completed`` and ``failed`` summed over them, every other
    figure the median over the rounds that have it (None where none has), ``speedup``
    the median of the rounds' own ``speedup`` and ``speedup_range`` their ``(lowest,
    highest)`` (None with fewer than two). A single round gives its row unchanged (plus
    ``rounds`` 1 and ``speedup_range`` None)."""
    groups: dict[tuple, list[dict]] = {}
    for x in rs:
        groups.setdefault(tuple(x[k] for k in _KEYS), []).append(x)
    out = []
    for key, xs in groups.items():
        m = dict(zip(_KEYS, key))
        for field in xs[0]:
            if field in _KEYS or field == "round":
                continue
            vals = [x[field] for x in xs if x.get(field) is not None]
            if field in _SUMMED:
                m[field] = sum(vals) if vals else None
            elif not vals:
                m[field] = None
            elif len(vals) == 1:
                m[field] = vals[0]
            else:
                m[field] = statistics.median(vals)
        sp = [x["speedup"] for x in xs if x.get("speedup") is not None]
        m["rounds"] = len(xs)
        m["speedup_range"] = (min(sp), max(sp)) if len(sp) > 1 else None
        out.append(m)
    return sorted(out, key=_order)


def _order(x: dict):
    m = x["method"]
    return (x["sampling"], x["rate"] is not None, x["rate"] or 0.0,
            METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m, x["concurrency"] or 0)


def _f(v, digits: int = 1) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def tables(rs: Sequence[dict]) -> str:
    """Markdown: one table per sampling and load kind (closed loop by concurrency, or
    open loop by request rate), rows in method then concurrency order; with rows merged
    over several rounds (:func:`merge_rounds`) a ``rounds`` column, and × plain as the
    median with the rounds' range."""
    groups: dict[tuple, list[dict]] = {}
    for x in rs:
        groups.setdefault((x["sampling"], x["rate"] is not None), []).append(x)
    parts = []
    for (sampling, open_loop), xs in groups.items():
        p90 = any(x["tpot_p90"] is not None or x["ttft_p90"] is not None for x in xs)
        pcts = ("50", "90", "99") if p90 else ("50", "99")
        spec = any(x["acceptance_rate"] is not None for x in xs)
        multi = any((x.get("rounds") or 1) > 1 for x in xs)
        head = ["method", "rate (req/s)" if open_loop else "concurrency"] + (["rounds"] if multi else [])
        head += ["completed", "failed", "output tok/s", "× plain" + (" (rounds)" if multi else ""), "req/s"]
        head += [f"{m.upper()} p{p} (ms)" for m in ("ttft", "tpot", "itl") for p in pcts]
        if any(x["goodput"] is not None for x in xs):
            head.append("goodput (req/s)")
        if spec:
            head += ["acceptance (%)", "accepted length", "drafts"]
        lines = [f"**{sampling}**, " + ("open loop (Poisson arrivals)" if open_loop else "closed loop"), "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for x in xs:
            cells = [x["method"], _f(x["rate"], 3) if open_loop else str(x["concurrency"])]
            cells += [str(x.get("rounds") or 1)] if multi else []
            cells += [str(x["completed"]), str(x["failed"]), _f(x["output_tps"]), _speedup(x), _f(x["req_s"], 3)]
            cells += [_f(x[f"{m}_p{p}"]) for m in ("ttft", "tpot", "itl") for p in pcts]
            if "goodput (req/s)" in head:
                cells.append(_f(x["goodput"], 3))
            if spec:
                cells += [_f(x["acceptance_rate"], 1), _f(x["acceptance_length"], 2),
                          "" if x["drafts"] is None else str(x["drafts"])]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _speedup(x: dict) -> str:
    if x["speedup"] is None:
        return ""
    rng = x.get("speedup_range")
    return f"{x['speedup']:.2f}x" + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng else "")


def plots(rs: Sequence[dict], out_dir: str) -> list[str]:
    """Per sampling with closed-loop runs at two or more concurrencies:
    ``tpot-<sampling>.png`` (median TPOT, ms) and ``throughput-<sampling>.png`` (output
    tokens/s) against concurrency, one line per method. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    closed = [x for x in rs if x["rate"] is None and x["concurrency"]]
    for sampling in sorted({x["sampling"] for x in closed}):
        xs = [x for x in closed if x["sampling"] == sampling]
        if len({x["concurrency"] for x in xs}) < 2:
            continue
        for key, ylabel, stem in (("tpot_p50", "median TPOT (ms)", "tpot"),
                                  ("output_tps", "output tokens/s", "throughput")):
            fig, ax = plt.subplots(figsize=(6, 4))
            for method in sorted({x["method"] for x in xs},
                                 key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m)):
                pts = sorted((x["concurrency"], x[key]) for x in xs if x["method"] == method and x[key] is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} against concurrency, {sampling}")
            ax.grid(True, alpha=0.3)
            ax.legend()
            path = os.path.join(out_dir, f"{stem}-{sampling}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def report(folder: str, draw: bool = True) -> tuple[str, list[str]]:
    """Tables of every result in ``folder`` (also written to ``folder/report.md``) and,
    with ``draw``, the PNGs. Returns ``(markdown, png paths)``.

    Raises:
        ValueError: no vLLM result JSON in ``folder``.
    """
    results = load_results(folder)
    if not results:
        raise ValueError(f"no vllm bench serve result (--save-result JSON) in {folder}")
    rs = merge_rounds(rows(results))
    md = tables(rs)
    with open(os.path.join(folder, "report.md"), "w", encoding="utf-8") as f:
        f.write(f"# Serving benchmark: {os.path.basename(os.path.abspath(folder))}\n\n"
                "Generated by `python -m vllm_tokenswift.bench.serving_report` from the "
                "`vllm bench serve --save-result` JSONs in this folder.\n\n" + md)
    return md, (plots(rs, folder) if draw else [])


def main(argv: list[str] | None = None) -> int:
    """Print the tables of each folder, write ``report.md`` and the PNGs next to the JSONs."""
    ap = argparse.ArgumentParser(prog="python -m vllm_tokenswift.bench.serving_report",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    rc = 0
    for folder in a.folders:
        try:
            md, pngs = report(folder, draw=not a.no_plots)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 2
            continue
        print(f"== {folder}\n\n{md}")
        for p in pngs:
            print(f"wrote {p}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
