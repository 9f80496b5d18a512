"""One table of every benchmark setting against every method, from several invocations.

``vllm-tokenswift bench`` writes one folder per invocation, and each invocation covers a
few settings (a generation length, a batch size, a sampling) with its own AR baseline.
The benchmark matrix (``scripts/bench-matrix.sh``) spreads the settings and methods over
several invocations, so the figure a reader wants (how does each method do at each
setting?) is spread over many ``results.json`` files. This module pivots them:

* one **row per setting**: model, YaRN factor, sampling, batch size, generation length;
* one **column per method**: generated tokens per second × AR of the *same invocation*
  (the record's own ``speedup_vs_ar``, paired round by round under ``--interleave``;
  see :func:`vllm_tokenswift.bench.report.compute_speedups`), median over every run of
  that method at that setting, the single runs in brackets when there are several;
* AR's own tokens per second, the focus method's decision mix, and two verdicts for the
  focus method (by default ``tokenswift``): at least ``floor`` × AR, and at least the best
  of the peer methods.

Runs whose records carry a note (e.g. "min_p=0.1 dropped: vLLM refuses min_p with ngram")
get a footnote mark, so a figure measured under other sampling is never read as like for
like. Pure functions (no vLLM, no torch); :func:`write_plot` imports matplotlib lazily.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from vllm_tokenswift.bench.report import _median, _ok, _sum_dicts, format_decision_mix, load_invocation

#: the default column order; other methods follow in the order they first appear
DEFAULT_METHODS: tuple[str, ...] = ("tokenswift", "tokenswift-paper", "ngram", "ngram-best", "suffix")
DEFAULT_PEERS: tuple[str, ...] = ("ngram", "ngram-best", "suffix")


def setting_key(rec: dict) -> tuple:
    """The setting a record belongs to: ``(model, yarn, sampling, batch_size, gen_len)``.

    ``model`` is the model folder's base name (``SmolLM2-135M-Instruct``, ``demo-model``);
    ``yarn`` the YaRN factor or None."""
    model = os.path.basename(str(rec.get("model") or "").rstrip("/")) or "?"
    return (model, rec.get("yarn"), rec.get("sampling"), rec.get("batch_size"), rec.get("gen_len"))


def setting_label(key: tuple) -> str:
    """``("SmolLM2-135M-Instruct", 2.0, "paper", 1, 12288)`` -> ``"SmolLM2-135M-Instruct YaRN ×2, paper, 12K, b=1"``."""
    model, yarn, sampling, batch, gen = key
    length = f"{gen // 1024}K" if gen and gen % 1024 == 0 else str(gen)
    y = f" YaRN ×{yarn:g}" if yarn else ""
    return f"{model}{y}, {sampling}, {length}, b={batch}"


def load_invocations(paths: Sequence[str]) -> list[dict]:
    """Records of several ``bench`` folders (or ``results.json`` files), each read by
    :func:`vllm_tokenswift.bench.report.load_invocation` (speedups within its own
    invocation, ``source`` tag), with ``yarn`` from the folder's ``config.json`` where the
    record lacks it (records written before the harness stored it).

    Raises:
        OSError, json.JSONDecodeError: an unreadable file.
        ValueError: a file that is not a list of records.
    """
    records: list[dict] = []
    for path in paths:
        recs, folder = load_invocation(path)
        yarn = None
        cfg_path = os.path.join(folder, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as fh:
                yarn = json.load(fh).get("yarn")
        for r in recs:
            if r.get("yarn") is None:
                r["yarn"] = yarn
        records.extend(recs)
    return records


def settings_table(records: Iterable[dict], methods: Sequence[str] | None = None,
                   focus: str = "tokenswift", peers: Sequence[str] = DEFAULT_PEERS,
                   floor: float = 0.97) -> tuple[list[str], list[dict]]:
    """Pivot records into one row per setting (:func:`setting_key`).

    Args:
        records: bench records with ``speedup_vs_ar`` computed (see :func:`load_invocations`).
        methods: the method columns, in order; None: :data:`DEFAULT_METHODS` that occur,
            then any other non-AR method in order of first appearance.
        focus: the method the verdicts are about.
        peers: the methods ``focus`` is compared with (those present at the setting;
            ``focus`` itself is never its own peer).
        floor: the "never slower" threshold on ``focus``'s median speedup.

    Returns:
        ``(methods, rows)``. Each row: ``key``, ``label``, ``ar_tokens_per_s`` (AR's
        median tokens/s over its runs, all invocations), ``cells`` (method -> dict with
        ``median`` speedup, ``runs`` (each run's speedup, in record order), ``notes``
        (the runs' distinct notes)), ``mix`` (``focus``'s request-steps per decision kind,
        summed over its runs; None without counters), ``best_peer`` (name or None),
        ``meets_floor`` and ``beats_peers`` (bool, or None where ``focus`` or every peer
        is missing).
    """
    records = [r for r in records if _ok(r)]
    order: list[tuple] = []
    by_key: dict[tuple, list[dict]] = {}
    for r in records:
        k = setting_key(r)
        if k not in by_key:
            order.append(k)
            by_key[k] = []
        by_key[k].append(r)
    if methods is None:
        seen = list(dict.fromkeys(r["method"] for r in records if r.get("method") != "ar"))
        methods = [m for m in DEFAULT_METHODS if m in seen] + [m for m in seen if m not in DEFAULT_METHODS]
    rows = []
    for k in order:
        rs = by_key[k]
        cells: dict[str, dict] = {}
        for m in methods:
            mine = [r for r in rs if r.get("method") == m and r.get("speedup_vs_ar") is not None]
            if not mine:
                continue
            runs = [float(r["speedup_vs_ar"]) for r in mine]
            cells[m] = {"median": _median(runs), "runs": runs,
                        "notes": sorted({str(r["note"]) for r in mine if r.get("note")})}
        steps = _sum_dicts(r.get("steps_by_kind") for r in rs if r.get("method") == focus)
        present = [p for p in peers if p in cells and p != focus]
        best = max(present, key=lambda p: cells[p]["median"]) if present else None
        f = cells.get(focus)
        rows.append({
            "key": k, "label": setting_label(k),
            "ar_tokens_per_s": _median(r.get("tokens_per_s") for r in rs if r.get("method") == "ar"),
            "cells": cells, "mix": steps or None,
            "best_peer": best,
            "meets_floor": (f["median"] >= floor) if f else None,
            "beats_peers": (f["median"] >= cells[best]["median"]) if (f and best) else None,
        })
    return list(methods), rows


def _cell_text(cell: dict | None, marks: dict[str, int], bold: bool) -> str:
    if cell is None:
        return "–"
    txt = f"{cell['median']:.2f}x"
    if bold:
        txt = f"**{txt}**"
    if len(cell["runs"]) > 1:
        txt += " (" + ", ".join(f"{v:.3f}" for v in cell["runs"]) + ")"
    for n in cell["notes"]:
        txt += f" {marks[n]}"
    return txt


def markdown(methods: Sequence[str], rows: Sequence[dict], focus: str = "tokenswift",
             floor: float = 0.97) -> str:
    """The pivot of :func:`settings_table` as a markdown table, with the notes as numbered
    footnotes. Bold: the largest median speedup of the row."""
    marks: dict[str, int] = {}
    for row in rows:
        for m in methods:
            for n in (row["cells"].get(m) or {}).get("notes", []):
                marks.setdefault(n, len(marks) + 1)
    marks_txt = {n: f"[{i}]" for n, i in marks.items()}
    head = ["setting", "AR tok/s", *methods, f"{focus} decision mix % fwd/fused/ngram/none[/chain]",
            f"{focus} ≥ {floor:g}x AR", f"{focus} ≥ best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    verdict = {True: "yes", False: "**no**", None: "–"}
    for row in rows:
        present = [m for m in methods if m in row["cells"]]
        top = max(present, key=lambda m: row["cells"][m]["median"]) if present else None
        mix_txt = format_decision_mix(row["mix"]) or "–"
        peer = row["best_peer"]
        lines.append("| " + " | ".join([
            row["label"],
            f"{row['ar_tokens_per_s']:.1f}" if row["ar_tokens_per_s"] else "–",
            *[_cell_text(row["cells"].get(m), marks_txt, m == top) for m in methods],
            mix_txt, verdict[row["meets_floor"]],
            verdict[row["beats_peers"]] + (f" ({peer})" if peer and row["beats_peers"] is not None else ""),
        ]) + " |")
    if marks:
        lines.append("")
        lines.extend(f"[{i}] {n}" for n, i in marks.items())
    return "\n".join(lines)


def write_plot(methods: Sequence[str], rows: Sequence[dict], path: str) -> str:
    """Grouped bars: per setting, each method's median speedup × AR (the dotted line at
    1.0 is AR), each run's figure as a dot on its bar. Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(methods))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(rows) + 2), 5.0))
    for i, m in enumerate(methods):
        xs, ys, dots_x, dots_y = [], [], [], []
        for j, row in enumerate(rows):
            c = row["cells"].get(m)
            if c is None:
                continue
            x = j - 0.4 + width * (i + 0.5)
            xs.append(x)
            ys.append(c["median"])
            if len(c["runs"]) > 1:
                dots_x += [x] * len(c["runs"])
                dots_y += c["runs"]
        ax.bar(xs, ys, width=width * 0.95, label=m)
        if dots_x:
            ax.plot(dots_x, dots_y, ls="", marker=".", ms=3, color="black")
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=5, rotation=90)
    ax.axhline(1.0, color="grey", lw=1, ls=":", label="AR")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["label"].replace(", ", "\n") for r in rows], fontsize=6)
    ax.set_ylabel("generated tokens/s × AR of the same invocation")
    ax.set_title("Every setting, every method (median over runs; dots: single runs)", fontsize=9)
    ax.legend(fontsize=7, ncol=min(6, n + 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
