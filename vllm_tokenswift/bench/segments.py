"""Per-segment figures of one long request (``bench --segment-tokens N``), the layout of
the paper's Table 3 and Figure 3: how speed, acceptance and the proposer's cost and
memory change as the output grows.

While a single request generates, the harness takes a *snapshot* every ``N`` output
tokens (:func:`vllm_tokenswift.bench.harness.snapshot`): the wall clock, the engine steps
so far, vLLM's speculative-decoding counters and, on TokenSwift engines, the plugin's
counters and memory figures. :func:`segments_from_snapshots` turns consecutive snapshots into one
row per segment; :func:`paired_segments` divides each method's segment speed by AR's
speed over the same segment of the same round; :func:`markdown` and :func:`plot` show
them. Everything here is engine-free (the snapshots are taken by the harness).

Per segment: ``tokens``, ``wall_s``, ``steps``, ``tokens_per_s``, ``tokens_per_step``,
``acceptance_rate`` (α, Eq. 4, from vLLM's counters), ``ngram_acceptance`` (β, Eq. 6,
TokenSwift), ``steps_by_kind`` (decision mix), ``proposer_ms_per_step``, the memory at
the segment's end (``history_tokens``, ``ngram_entries``, ``rss_bytes``) and
``distinct_1``..``distinct_4`` of the segment's tokens.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from vllm_tokenswift.core import figures as counters


def _delta(a: dict | None, b: dict | None) -> dict:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return {}
    return counters.counter_delta(a, b)


def segments_from_snapshots(snaps: Sequence[dict], token_ids: Sequence[int], k: int | None) -> list[dict]:
    """One row per pair of consecutive snapshots (see the module doc).

    Args:
        snaps: from :func:`vllm_tokenswift.bench.harness.snapshot`, in time order (the first at the first token).
        token_ids: the request's output token ids (for Distinct-n per segment).
        k: ``num_speculative_tokens`` (None for AR).
    """
    rows = []
    for a, b in zip(snaps, snaps[1:]):
        n = b["tokens"] - a["tokens"]
        wall = b["t"] - a["t"]
        steps = b["steps"] - a["steps"]
        acc = counters.acceptance_from_counters(_delta(a["spec"], b["spec"]), k)
        row: dict[str, Any] = {
            "start": a["tokens"], "end": b["tokens"], "tokens": n, "wall_s": wall, "steps": steps,
            "tokens_per_s": n / wall if wall > 0 else None,
            "tokens_per_step": n / steps if steps > 0 else None,
            "acceptance_rate": acc.get("acceptance_rate"),
            "ngram_acceptance": None, "steps_by_kind": None, "proposer_ms_per_step": None,
            "history_tokens": None, "ngram_entries": None, "rss_bytes": None}
        pa, pb = a.get("plugin"), b.get("plugin")
        if isinstance(pa, dict) and isinstance(pb, dict):
            d = _delta(pa, pb)
            chains = d.get("verified_drafts") or 0
            nst = pb.get("num_speculative_tokens") or k or 1
            row["ngram_acceptance"] = d.get("accepted_ngram", 0) / (nst * chains) if chains else None
            row["steps_by_kind"] = d.get("steps_by_kind")
            row["proposer_ms_per_step"] = 1e3 * d.get("time_draft_s", 0.0) / steps if steps > 0 else None
            # the final snapshot comes after the request finished and its state was freed:
            # its memory is the one read a step before (harness.timed_run_segments)
            mem = b.get("memory_before_finish") or pb.get("memory") or {}
            row.update(history_tokens=mem.get("history_tokens"), ngram_entries=mem.get("ngram_entries"),
                       rss_bytes=mem.get("rss_bytes"))
        row.update(counters.distinct_scores([list(token_ids[a["tokens"]: b["tokens"]])]))
        rows.append(row)
    return rows


def paired_segments(records: list[dict]) -> None:
    """Set ``speedup_vs_ar`` on every segment of every record, in place: its
    ``tokens_per_s`` over that of the segment at the same index in the AR run of the same
    setting and round (``gen_len``, ``batch_size``, ``sampling``, ``repeat``). Segment
    ends are the first snapshot at or past each multiple of the segment length, so a
    speculative run's bounds lie up to ``k`` tokens past AR's: the index pairs them."""
    ar = {(r["gen_len"], r["batch_size"], r["sampling"], r["repeat"]): r for r in records
          if r.get("method") == "ar" and r.get("status") == "ok" and r.get("segments")}
    for r in records:
        base = ar.get((r.get("gen_len"), r.get("batch_size"), r.get("sampling"), r.get("repeat")))
        ref_segs = (base or {}).get("segments") or []
        for i, seg in enumerate(r.get("segments") or []):
            ref = ref_segs[i] if i < len(ref_segs) else None
            seg["speedup_vs_ar"] = (seg["tokens_per_s"] / ref["tokens_per_s"]
                                    if ref and ref.get("tokens_per_s") and seg.get("tokens_per_s") else None)


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(records: list[dict]) -> str:
    """A table per (sampling, method): one row per segment (tokens are the output's, the
    prefix not counted)."""
    out = []
    keys = sorted({(r["sampling"], r["method"]) for r in records if r.get("segments")},
                  key=lambda t: (t[0], t[1] != "ar", t[1]))
    for sampling, method in keys:
        runs = [r for r in records if (r["sampling"], r["method"]) == (sampling, method) and r.get("segments")]
        out += [f"### {method}, {sampling}" + (f" ({len(runs)} runs; each row their median)" if len(runs) > 1 else ""),
                "", "| tokens | tok/s | × AR | tokens/step | α | β | decision mix % fwd/fused/ngram/none[/chain] "
                "| proposer ms/step | history tokens | n-gram entries | RSS MB | distinct-1..4 |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, seg in enumerate(runs[0]["segments"]):
            col = [r["segments"][i] for r in runs if len(r["segments"]) > i]

            def med(key):
                vals = [s.get(key) for s in col if s.get(key) is not None]
                return statistics.median(vals) if vals else None

            mix = counters.decision_mix_fractions(counters._sum_dicts([s.get("steps_by_kind") for s in col]))
            mix_s = "/".join(f"{100 * mix.get(k, 0):.0f}" for k in ("forward", "fused", "ngram", "none")) \
                if mix else "-"
            rss = med("rss_bytes")
            dist = "/".join(_f(med(f"distinct_{n}")) for n in range(1, 5))
            out.append(f"| {seg['start']:,}-{seg['end']:,} | {_f(med('tokens_per_s'), '{:.1f}')} | "
                       f"{_f(med('speedup_vs_ar'))} | {_f(med('tokens_per_step'))} | "
                       f"{_f(med('acceptance_rate'), '{:.3f}')} | {_f(med('ngram_acceptance'), '{:.3f}')} | "
                       f"{mix_s} | {_f(med('proposer_ms_per_step'))} | {_f(med('history_tokens'), '{:,.0f}')} | "
                       f"{_f(med('ngram_entries'), '{:,.0f}')} | {_f(rss / 2**20 if rss else None, '{:.0f}')} | "
                       f"{dist} |")
        out.append("")
    return "\n".join(out)


def plot(records: list[dict], path: str) -> str | None:
    """Speedup over AR and α / β per segment (paper Figure 3 layout), one line per method
    and sampling; ``None`` without matplotlib or segments."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = sorted({(r["sampling"], r["method"]) for r in records if r.get("segments")})
    if not keys:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for sampling, method in keys:
        runs = [r for r in records if (r["sampling"], r["method"]) == (sampling, method) and r.get("segments")]
        segs = runs[0]["segments"]
        x = [s["end"] / 1024 for s in segs]

        def med(i, key):
            vals = [r["segments"][i].get(key) for r in runs if len(r["segments"]) > i
                    and r["segments"][i].get(key) is not None]
            return statistics.median(vals) if vals else None

        style = "-" if sampling == "greedy" else "--"
        if method != "ar":
            ax1.plot(x, [med(i, "speedup_vs_ar") for i in range(len(segs))], style + "o",
                     label=f"{method}, {sampling}")
            ax2.plot(x, [med(i, "acceptance_rate") for i in range(len(segs))], style + "o",
                     label=f"α {method}, {sampling}")
            if method.startswith("tokenswift"):
                ax2.plot(x, [med(i, "ngram_acceptance") for i in range(len(segs))], style + "x",
                         label=f"β {method}, {sampling}")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xlabel("generated tokens (K), segment end")
    ax1.set_ylabel("speedup vs AR (same segment)")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("generated tokens (K), segment end")
    ax2.set_ylabel("acceptance")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
