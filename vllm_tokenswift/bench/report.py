"""Benchmark records -> JSON, CSV, PNG plots and a markdown summary.

Pure functions (no vLLM, no torch); matplotlib is imported lazily by
:func:`write_plots` with the ``Agg`` backend.

A *record* is one timed run of one method in one setting (a ``dict``). Keys
(see :data:`RECORD_FIELDS`):

* ``method``, ``gen_len``, ``batch_size``, ``sampling``, ``repeat``: the setting.
* ``engine``: the engine instance that ran it (``bench --engines N``: 0..N-1; the
  ``repeat`` numbers run on across instances).
* ``status``: ``"ok"``, ``"unavailable"`` (method cannot run here; ``note`` says why)
  or ``"error"``; ``note``: free text (e.g. "min_p dropped").
* ``tokens_per_s``: generated tokens over all sequences / wall seconds.
* ``latency_per_token_ms``: ``1000 * wall_s / (num_tokens / batch_size)``, the
  average time per generated token of one sequence (paper Eq. 5 latency).
* ``speedup_vs_ar``: method tokens/s / AR tokens/s (median AR over repeats of the
  same ``gen_len``/``batch_size``/``sampling``), i.e. AR latency / method latency.
  Records with ``paired_speedup`` true (``bench --interleave``: runs alternate method
  by method, round by round) are divided by the AR run of the same round (``repeat``)
  instead, when that run succeeded.
* ``decode_speedup_vs_ar``: the same ratio of ``decode_tokens_per_s`` (the tokens
  after each output's first over the time after the last first token), paired the same
  way: the decode phase alone. The prefill is the same work for every method (same
  prompts, same target), yet its time moves by several percent from one engine instance
  to another (at batch 8, 1K tokens on the CPU, a quarter of the wall time: a TTFT of
  36-39 s in one invocation), enough to decide a tie in ``speedup_vs_ar``. At batch > 1
  it is not the decode phase alone: ``decode_tokens_per_s`` counts the tokens that the
  first requests generate while later ones still prefill but not that time, which
  favours a method that generates more tokens per step then; read it as indicative.
* ``acceptance_rate``: α (paper Eq. 4) ``= accepted / (num_spec_tokens * drafts)``.
* ``mean_accepted_length``: ``1 + accepted / drafts`` tokens per step (bonus included).
* ``ngram_acceptance``: β (Eq. 6) from the TokenSwift plugin, else ``None``.
* ``draft_time_share``: proposer time / engine step time (plugin), else ``None``.
* ``identical_to_ar``: greedy only: every output's token ids equal AR's; else ``None``.
* ``distinct_1`` .. ``distinct_4``: Distinct-n (Li et al. 2016; paper Table 6),
  per output, averaged over outputs.
* ``num_tokens``, ``wall_s``; optional ``time_draft_s``, ``time_verify_s``,
  ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
  ``acceptance_per_pos``, ``num_speculative_tokens``, ``prefix_len``, ``model``,
  ``ar_common_prefix_tokens`` (greedy: tokens equal to AR's before the first
  difference, minimum over outputs), ``ttft_s`` (time to first token, s) and
  ``decode_tokens_per_s`` (tokens after the first / time after it).
* ``steps_by_kind`` / ``accepted_by_kind`` (TokenSwift only): request-steps per
  drafting decision (``forward``, ``fused``, ``ngram``, ``none``) and the draft tokens
  accepted after each kind, from the plugin's counters for this run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from collections import defaultdict
from typing import Any, Iterable

# the counter helpers, re-exported: the report's public names since before they moved
from vllm_tokenswift.core.figures import (  # noqa: F401
    SPEC_COUNTERS, SPEC_PER_POS, STEP_KINDS, _sum_dicts, acceptance_from_counters, counter_delta,
    decision_mix_fractions, distinct_n, distinct_scores, format_decision_mix, spec_counters_from_collectors,
    spec_counters_from_metrics)

#: Columns of results.csv, in order (records may carry more keys; JSON keeps all).
RECORD_FIELDS: list[str] = [
    "method", "gen_len", "batch_size", "sampling", "repeat", "engine", "status",
    "tokens_per_s", "latency_per_token_ms", "speedup_vs_ar", "decode_speedup_vs_ar",
    "acceptance_rate", "mean_accepted_length", "ngram_acceptance", "draft_time_share",
    "identical_to_ar", "distinct_1", "distinct_2", "distinct_3", "distinct_4",
    "num_tokens", "wall_s", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
    "num_speculative_tokens", "time_draft_s", "time_verify_s", "prefix_len",
    "ar_common_prefix_tokens", "ttft_s", "decode_tokens_per_s", "steps_by_kind",
    "accepted_by_kind", "paired_speedup", "note",
]

#: Columns of the markdown summary table.
SUMMARY_COLUMNS: list[str] = [
    "method", "sampling", "batch", "gen_len", "repeats", "tok/s med", "tok/s min",
    "ms/tok med", "ms/tok min", "speedup med", "decode speedup med", "alpha", "mean acc len", "beta",
    "draft share", "decision mix % fwd/fused/ngram/none[/chain]", "identical to AR", "distinct-1", "distinct-2", "distinct-3", "distinct-4",
    "note",
]

_SETTING = ("gen_len", "batch_size", "sampling")


# ---------------------------------------------------------------------------
# Figures computed from raw data (the counter helpers are in vllm_tokenswift/counters.py)
# ---------------------------------------------------------------------------

def throughput(num_tokens: int, wall_s: float, batch_size: int) -> dict[str, float | None]:
    """``tokens_per_s`` (all sequences) and ``latency_per_token_ms`` (per sequence)."""
    if wall_s <= 0 or num_tokens <= 0:
        return {"tokens_per_s": None, "latency_per_token_ms": None}
    per_seq = num_tokens / max(1, batch_size)
    return {"tokens_per_s": num_tokens / wall_s, "latency_per_token_ms": 1000.0 * wall_s / per_seq}


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------

def _ok(r: dict) -> bool:
    return r.get("status", "ok") == "ok" and isinstance(r.get("tokens_per_s"), (int, float))


def _median(vals: Iterable[Any]) -> float | None:
    v = [x for x in vals if isinstance(x, (int, float)) and not isinstance(x, bool)
         and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(v) if v else None


def _min(vals: Iterable[Any]) -> float | None:
    v = [x for x in vals if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return min(v) if v else None


def compute_speedups(records: list[dict]) -> list[dict]:
    """Fill ``speedup_vs_ar`` in place: method tokens/s ÷ median AR tokens/s of the
    same (gen_len, batch_size, sampling) (= AR latency / method latency, paper Eq. 5),
    and ``decode_speedup_vs_ar``: the same for ``decode_tokens_per_s`` (the decode phase
    alone, after the first token; ``None`` where either side lacks it).

    A record with ``paired_speedup`` true (interleaved runs) is divided by the AR run of
    the same setting and ``repeat`` (its round) when that one succeeded, else by the
    median. ``None`` where no AR run of that setting succeeded. Returns ``records``.
    """
    for field, out in (("tokens_per_s", "speedup_vs_ar"), ("decode_tokens_per_s", "decode_speedup_vs_ar")):
        ar: dict[tuple, list[float]] = defaultdict(list)
        ar_round: dict[tuple, float] = {}
        for r in records:
            if r.get("method") == "ar" and _ok(r) and r.get(field):
                key = tuple(r.get(k) for k in _SETTING)
                ar[key].append(r[field])
                ar_round[key + (r.get("repeat"),)] = r[field]
        for r in records:
            key = tuple(r.get(k) for k in _SETTING)
            base = ar_round.get(key + (r.get("repeat"),)) if r.get("paired_speedup") else None
            if not base:
                base = _median(ar.get(key, []))
            r[out] = (r[field] / base) if (base and _ok(r) and r.get(field)) else None
    if any(r.get("segments") for r in records):
        from vllm_tokenswift.bench.segments import paired_segments

        paired_segments(records)
    return records


def _group_key(r: dict) -> tuple:
    return (r.get("method"), r.get("sampling"), r.get("batch_size"), r.get("gen_len"))


def summarize(records: list[dict]) -> list[dict]:
    """One row per (method, sampling, batch_size, gen_len): medians over repeats.

    Keys: ``method, sampling, batch_size, gen_len, repeats`` (successful runs),
    ``tokens_per_s_median/min``, ``latency_ms_median/min``, ``speedup_median``,
    ``decode_speedup_median``,
    ``acceptance_rate``, ``mean_accepted_length``, ``ngram_acceptance``,
    ``draft_time_share``, ``distinct_1..4`` (medians), ``identical_to_ar`` (all
    repeats identical; ``None`` when not applicable), ``steps_by_kind`` and
    ``accepted_by_kind`` (summed over repeats; ``None`` without TokenSwift counters),
    ``engines`` (engine instances with a successful run) and ``speedup_by_engine``
    (per instance, in instance order: the median speedup of its runs), ``status`` and
    ``note``.
    Rows keep the order in which settings first appear.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(_group_key(r), []).append(r)
    rows = []
    for key, rs in groups.items():
        ok = [r for r in rs if _ok(r)]
        ident = [r.get("identical_to_ar") for r in ok if r.get("identical_to_ar") is not None]
        notes = sorted({str(r["note"]) for r in rs if r.get("note")})
        row = {
            "method": key[0], "sampling": key[1], "batch_size": key[2], "gen_len": key[3],
            "repeats": len(ok),
            "status": "ok" if ok else (rs[0].get("status") or "error"),
            "tokens_per_s_median": _median(r["tokens_per_s"] for r in ok),
            "tokens_per_s_min": _min(r["tokens_per_s"] for r in ok),
            "latency_ms_median": _median(r.get("latency_per_token_ms") for r in ok),
            "latency_ms_min": _min(r.get("latency_per_token_ms") for r in ok),
            "speedup_median": _median(r.get("speedup_vs_ar") for r in ok),
            "decode_speedup_median": _median(r.get("decode_speedup_vs_ar") for r in ok),
            "identical_to_ar": (all(ident) if ident else None),
            "note": "; ".join(notes),
            # summed over repeats (counts), not medians
            "steps_by_kind": _sum_dicts(r.get("steps_by_kind") for r in ok),
            "accepted_by_kind": _sum_dicts(r.get("accepted_by_kind") for r in ok),
        }
        by_engine: dict[int, list] = defaultdict(list)
        for r in ok:
            by_engine[int(r.get("engine") or 0)].append(r.get("speedup_vs_ar"))
        row["engines"] = len(by_engine)
        row["speedup_by_engine"] = [_median(by_engine[e]) for e in sorted(by_engine)]
        for f in ("acceptance_rate", "mean_accepted_length", "ngram_acceptance",
                  "draft_time_share", "distinct_1", "distinct_2", "distinct_3", "distinct_4",
                  "time_draft_s", "time_verify_s", "wall_s"):
            row[f] = _median(r.get(f) for r in ok)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------

def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(records: list[dict], path: str) -> str:
    """Write the records as a JSON list (all keys kept). Returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(records), f, indent=2)
    return path


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def write_csv(records: list[dict], path: str) -> str:
    """Write :data:`RECORD_FIELDS` columns (missing values empty). Returns ``path``."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RECORD_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({k: _csv_cell(r.get(k)) for k in RECORD_FIELDS})
    return path


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v).replace("|", "/")


def markdown_table(rows: list[dict]) -> str:
    """Markdown table of :func:`summarize` rows with :data:`SUMMARY_COLUMNS`; where a row
    ran on several engine instances (``bench --engines``), a column ``speedup per engine``
    (each instance's median speedup, slash-separated) follows ``speedup med``."""
    per_engine = any((r.get("engines") or 0) > 1 for r in rows)
    cols = list(SUMMARY_COLUMNS)
    if per_engine:
        cols.insert(cols.index("speedup med") + 1, "speedup per engine")
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in rows:
        note = r.get("note") or ""
        st = r.get("status")
        if st not in (None, "ok") and not note.startswith(f"{st}:"):
            note = f"{st}: {note}" if note else str(st)
        cells = [r["method"], r["sampling"], r["batch_size"], r["gen_len"], r["repeats"],
                 _fmt(r["tokens_per_s_median"], 1), _fmt(r["tokens_per_s_min"], 1),
                 _fmt(r["latency_ms_median"], 2), _fmt(r["latency_ms_min"], 2),
                 _fmt(r["speedup_median"], 2),
                 *([" / ".join(_fmt(v, 3) for v in r.get("speedup_by_engine") or []) or "–"]
                   if per_engine else []),
                 _fmt(r.get("decode_speedup_median"), 2),
                 _fmt(r["acceptance_rate"], 3),
                 _fmt(r["mean_accepted_length"], 2), _fmt(r["ngram_acceptance"], 3),
                 _fmt(r["draft_time_share"], 2), _fmt(format_decision_mix(r.get("steps_by_kind"))),
                 _fmt(r["identical_to_ar"]),
                 _fmt(r["distinct_1"], 3), _fmt(r["distinct_2"], 3), _fmt(r["distinct_3"], 3),
                 _fmt(r["distinct_4"], 3), _fmt(note)]
        lines.append("| " + " | ".join(_fmt(c) if not isinstance(c, str) else c.replace("|", "/")
                                       for c in cells) + " |")
    return "\n".join(lines)


def write_markdown(records: list[dict], path: str, meta: dict | None = None) -> str:
    """Write summary.md: settings, the summary table (median over repeats, min too)
    and the figure list. Returns ``path``."""
    rows = summarize(records)
    out = ["# vllm-tokenswift benchmark", ""]
    if meta:
        for k, v in meta.items():
            out.append(f"- **{k}**: {v}")
        out.append("")
    out += ["Medians over repeats (`tok/s min` = slowest repeat, `ms/tok min` = fastest). "
            "speedup = method tok/s ÷ AR tok/s of the same gen_len/batch/sampling "
            "(= AR latency / method latency, paper Eq. 5); decode speedup = the same for the "
            "decode phase (tokens after the first ÷ time after the last first token; at batch "
            "> 1 it also counts tokens generated while later requests prefilled): the "
            "prefill is the same work for every method but its time varies between engine "
            "instances. alpha = accepted / "
            "(num_speculative_tokens × drafts) (Eq. 4); mean acc len = 1 + accepted / drafts; "
            "beta = n-gram acceptance (Eq. 6, TokenSwift plugin only); decision mix = share of "
            "request-steps by the drafting policy's choice (draft forward / fused heads / n-gram "
            "chain alone / no draft, TokenSwift only); distinct-n per output, averaged (Table 6).", "", markdown_table(rows), "",
            "Figures: `speedup_vs_gen_len.png`, `acceptance_vs_gen_len.png`, "
            "`tokenswift_time_breakdown.png`.", ""]
    steps = step_breakdown_table(rows)
    if steps:
        out += ["## Where a TokenSwift step's time goes", "",
                "Milliseconds per engine step (all repeats): TokenSwift's proposer (its draft "
                "forward and fused heads included), verification (the rest of the worker's step: "
                "the target's forward and the rejection sampler) and the rest of the wall time "
                "(the prompt's prefill, which runs before the proposer's first call, the scheduler "
                "and the front end), next to AR's wall time per step at the same setting (its "
                "prefill included, all under verification). "
                "Steps per request count every engine step, plain ones included. Accepted per "
                "step: accepted draft tokens per step of that kind.", "", steps, ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out))
    return path


def _series(rows: list[dict], field: str, skip_ar: bool = False) -> dict[str, list[tuple]]:
    """label -> sorted [(gen_len, value)] for rows with a value."""
    ser: dict[str, list[tuple]] = defaultdict(list)
    for r in rows:
        if skip_ar and r["method"] == "ar":
            continue
        v = r.get(field)
        if v is None or not isinstance(r.get("gen_len"), (int, float)):
            continue
        ser[f"{r['method']} [{r['sampling']}, b={r['batch_size']}]"].append((r["gen_len"], v))
    return {k: sorted(v) for k, v in ser.items()}


def _steps_per_request(r: dict) -> float:
    """Engine steps per request of a :func:`summarize` row (see :func:`step_breakdown`)."""
    sbk = r.get("steps_by_kind")
    total = sum(float(v or 0) for v in sbk.values()) if isinstance(sbk, dict) else 0.0
    if total > 0:
        return total / (max(1, int(r.get("batch_size") or 1)) * max(1, int(r.get("repeats") or 1)))
    return r["gen_len"] / r["mean_accepted_length"]


def step_breakdown(rows: list[dict]) -> list[dict]:
    """Per-step time split of TokenSwift settings, each preceded by AR's step at the same
    (sampling, batch_size, gen_len), from :func:`summarize` rows.

    Steps per request: where the row has the drafting policy's decision counts
    (``steps_by_kind``, request-steps summed over the row's repeats), their total
    divided by ``batch_size × repeats`` — every engine step, plain ones included;
    otherwise ``gen_len / mean_accepted_length`` (which counts only steps that verified
    a draft, so it is exact only when every step drafts). ``tokens_per_step`` is
    ``gen_len`` over those steps. Returns dicts with
    ``method, sampling, batch_size, gen_len, tokens_per_step`` and ``step_ms``,
    ``draft_ms`` (proposer), ``verify_ms`` (the rest of the worker's step: target
    forward + rejection sampling; AR: its whole wall time per step), ``other_ms`` (the rest
    of the wall time: the prompt's prefill, which runs before the proposer's first call,
    and the front end's work outside the timed steps), all in milliseconds per step, and ``decision_mix`` (TokenSwift rows:
    :func:`decision_mix_fractions` of the row's ``steps_by_kind``, else None; AR: None).
    TokenSwift rows without timings are left out.
    """
    out: list[dict] = []
    ar = {(r["sampling"], r["batch_size"], r["gen_len"]): r for r in rows if r["method"] == "ar"}
    done_ar = set()
    for r in rows:
        if not (r.get("time_draft_s") is not None
                and r.get("wall_s") and r.get("mean_accepted_length") and r.get("gen_len")):
            continue
        key = (r["sampling"], r["batch_size"], r["gen_len"])
        a = ar.get(key)
        if a is not None and a.get("wall_s") and key not in done_ar:
            done_ar.add(key)
            step = 1000.0 * a["wall_s"] / a["gen_len"]
            out.append({"method": "ar", "sampling": key[0], "batch_size": key[1], "gen_len": key[2],
                        "tokens_per_step": 1.0, "step_ms": step, "draft_ms": 0.0, "verify_ms": step,
                        "other_ms": 0.0, "decision_mix": None})
        steps = _steps_per_request(r)
        step = 1000.0 * r["wall_s"] / steps
        d = 1000.0 * r["time_draft_s"] / steps
        v = 1000.0 * (r.get("time_verify_s") or 0.0) / steps
        out.append({"method": r["method"], "sampling": key[0], "batch_size": key[1], "gen_len": key[2],
                    "tokens_per_step": r["gen_len"] / steps, "step_ms": step, "draft_ms": d,
                    "verify_ms": v, "other_ms": max(0.0, step - d - v),
                    "decision_mix": decision_mix_fractions(r.get("steps_by_kind"))})
    return out


def step_breakdown_table(rows: list[dict]) -> str:
    """Markdown table of :func:`step_breakdown` for :func:`summarize` rows ("" when no
    TokenSwift row has timings): per setting, AR's step next to TokenSwift's, split into
    the proposer (draft forward and fused heads included), verification (the rest of the
    worker's step) and the rest of the wall time, with the decision mix and, per step
    kind, the accepted draft tokens per step of that kind (``accepted_by_kind`` /
    ``steps_by_kind``)."""
    bars = step_breakdown(rows)
    if not any(b["method"] != "ar" for b in bars):
        return ""
    by_key = {(r["method"], r["sampling"], r["batch_size"], r["gen_len"]): r for r in rows}
    lines = ["| method | sampling | batch | gen_len | steps per request | tokens per step | "
             "ms per step | proposer ms | verification ms | other ms | "
             "decision mix % fwd/fused/ngram/none[/chain] | accepted per step fwd/fused/ngram[/chain] |",
             "|" + "|".join(["---"] * 12) + "|"]
    for b in bars:
        r = by_key.get((b["method"], b["sampling"], b["batch_size"], b["gen_len"]), {})
        steps = (b["gen_len"] / b["tokens_per_step"]) if b["tokens_per_step"] else None
        sbk, abk = r.get("steps_by_kind"), r.get("accepted_by_kind")
        per = "–"
        if isinstance(sbk, dict) and isinstance(abk, dict):
            per = "/".join(_fmt((abk.get(k) or 0) / sbk[k], 2) if sbk.get(k) else "–"
                           for k in ("forward", "fused", "ngram") + (("chain",) if sbk.get("chain") else ()))
        mix = format_decision_mix(sbk) if b["method"] != "ar" else None
        lines.append("| " + " | ".join([
            str(b["method"]), str(b["sampling"]), str(b["batch_size"]), str(b["gen_len"]),
            _fmt(steps, 0), _fmt(b["tokens_per_step"], 2), _fmt(b["step_ms"], 1),
            _fmt(b["draft_ms"], 1), _fmt(b["verify_ms"], 1), _fmt(b["other_ms"], 1),
            _fmt(mix), per]) + " |")
    return "\n".join(lines)


def write_plots(records: list[dict], out_dir: str) -> list[str]:
    """Write the three PNG figures into ``out_dir``; returns their paths.

    * ``speedup_vs_gen_len.png``: median speedup vs AR per method (1.0 line = AR).
    * ``acceptance_vs_gen_len.png``: α (solid) and β (dashed) per method.
    * ``tokenswift_time_breakdown.png``: stacked bars, milliseconds per engine step:
      draft / verification / other per TokenSwift setting, next to AR's step
      (:func:`step_breakdown`; a placeholder figure if no run recorded timings).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(records)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in _series(rows, "speedup_median", skip_ar=True).items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=1, ls=":", label="AR")
    ax.set_xlabel("generation length (tokens)")
    ax.set_ylabel("speedup vs AR (x)")
    ax.set_title("Speedup vs generation length")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, "speedup_vs_gen_len.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = 0
    for label, pts in _series(rows, "acceptance_rate", skip_ar=True).items():
        line, = ax.plot([q[0] for q in pts], [q[1] for q in pts], marker="o", label=f"α {label}")
        beta = dict(_series(rows, "ngram_acceptance", skip_ar=True)).get(label)
        if beta:
            ax.plot([q[0] for q in beta], [q[1] for q in beta], marker="x", ls="--",
                    color=line.get_color(), label=f"β {label}")
        n += 1
    if n == 0:
        ax.text(0.5, 0.5, "no speculative runs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("generation length (tokens)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance α (Eq. 4) and n-gram acceptance β (Eq. 6)")
    if n:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, "acceptance_vs_gen_len.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    bars = step_breakdown(rows)
    fig, ax = plt.subplots(figsize=(min(14.0, max(7.0, 0.8 * len(bars))), 4.8))
    if bars:
        labels = [f"{b['method']}\n{b['sampling']} b={b['batch_size']}\n{b['gen_len']}" for b in bars]
        draft = [b["draft_ms"] for b in bars]
        verify = [b["verify_ms"] for b in bars]
        other = [b["other_ms"] for b in bars]
        x = list(range(len(bars)))
        ax.bar(x, draft, label="draft (proposer)")
        ax.bar(x, verify, bottom=draft, label="verification / decode forward + sampling")
        ax.bar(x, other, bottom=[d + v for d, v in zip(draft, verify)], label="other (front end, scheduling)")
        for xi, b in zip(x, bars):
            label = f"{b['tokens_per_step']:.2f} tok"
            mix = format_decision_mix(b.get("decision_mix"))
            if mix:
                label += f"\n{mix}"
            ax.text(xi, b["step_ms"], label, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("ms per engine step (median run)")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no TokenSwift timing recorded\n(time_draft_s missing)",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
    ax.set_title("Where a TokenSwift step spends its time (AR step for reference)\n"
                 "above bars: tokens per step; % of steps forward/fused/ngram/none", fontsize=9)
    fig.tight_layout()
    p = os.path.join(out_dir, "tokenswift_time_breakdown.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def load_invocation(path: str) -> tuple[list[dict], str]:
    """The records of one ``vllm-tokenswift bench`` invocation: ``path`` is its folder or
    its ``results.json``. Speedups are computed inside this invocation only (a run is never
    compared with another invocation's AR), and each record without one gets ``source``,
    the folder's name. Returns ``(records, folder)``.

    Raises:
        OSError, json.JSONDecodeError: an unreadable file.
        ValueError: a file that is not a list of records.
    """
    f = os.path.join(path, "results.json") if os.path.isdir(path) else path
    with open(f, encoding="utf-8") as fh:
        recs = json.load(fh)
    if not isinstance(recs, list):
        raise ValueError(f"{f} is not a list of records")
    folder = os.path.dirname(os.path.abspath(f))
    compute_speedups(recs)
    for r in recs:
        r.setdefault("source", os.path.basename(folder))
    return recs, folder


def write_report(records: list[dict], out_dir: str, meta: dict | None = None,
                 plots: bool = True, recompute: bool = True) -> dict[str, Any]:
    """Compute speedups and write results.json, results.csv, summary.md and the PNGs.

    The PNGs need matplotlib (the ``[bench]`` extra); without it they are skipped
    with a warning. Returns a dict of the written paths (``json``, ``csv``,
    ``markdown``, ``plots``). ``recompute=False`` keeps the records' own
    ``speedup_vs_ar`` (merged reports: each was computed within its own invocation).
    """
    os.makedirs(out_dir, exist_ok=True)
    if recompute:
        compute_speedups(records)
    paths: dict[str, Any] = {
        "json": write_json(records, os.path.join(out_dir, "results.json")),
        "csv": write_csv(records, os.path.join(out_dir, "results.csv")),
        "markdown": write_markdown(records, os.path.join(out_dir, "summary.md"), meta),
    }
    paths["plots"] = []
    if plots:
        try:
            paths["plots"] = write_plots(records, out_dir)
        except ImportError as e:  # matplotlib is an optional ([bench]) dependency
            import warnings
            warnings.warn(f"plots skipped: {e} (pip install matplotlib)")
    if any(r.get("segments") for r in records):
        from vllm_tokenswift.bench import segments

        paths["segments"] = os.path.join(out_dir, "segments.md")
        with open(paths["segments"], "w", encoding="utf-8") as f:
            f.write("# Per-segment figures (one request per run)\n\n" + segments.markdown(records))
        if plots:
            png = segments.plot(records, os.path.join(out_dir, "segments.png"))
            if png:
                paths["plots"].append(png)
    return paths
