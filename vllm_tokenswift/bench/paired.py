"""Paired per-round ratios of a benchmark's decode speed against a baseline method.

``vllm-tokenswift bench --interleave --repeats N`` runs every method once per round, so a
method's decode tokens/s divided by the baseline's of the *same* round cancels the machine's
drift between rounds (docs/bench/long compares methods on the plugin's kernel this way, against
``ar-vk``, the kernel alone)::

    python -m vllm_tokenswift.bench.paired docs/bench/long/native-draft/context-32k/results.json \\
        --baseline ar-vk [--png ratios.png]

prints, per sampling and method, each round's ratio and their median (and draws them).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def paired_ratios(records: list[dict], baseline: str) -> dict[tuple[str, str], list[float]]:
    """``{(sampling, method): [ratio of round 0, round 1, ...]}``: each record's
    ``decode_tokens_per_s`` over the baseline's of the same sampling, gen_len, batch size and
    ``repeat`` (round). Records without a baseline in their round are left out.

    Raises:
        ValueError: no record of ``baseline`` at all.
    """
    def key(r):
        return (r.get("sampling"), r.get("gen_len"), r.get("batch_size"), r.get("repeat"))

    base = {key(r): r["decode_tokens_per_s"] for r in records
            if r.get("method") == baseline and r.get("decode_tokens_per_s")}
    if not base:
        raise ValueError(f"no records of the baseline method {baseline!r}")
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (str(r.get("sampling")), r.get("repeat") or 0)):
        b = base.get(key(r))
        if b and r.get("decode_tokens_per_s"):
            out[(r.get("sampling"), r["method"])].append(r["decode_tokens_per_s"] / b)
    return dict(out)


def table(ratios: dict[tuple[str, str], list[float]], baseline: str) -> str:
    """A Markdown table: sampling, method, per-round ratios, median."""
    lines = [f"| sampling | method | × {baseline}, rounds | median |", "|---|---|---|---|"]
    for (samp, meth), rs in ratios.items():
        lines.append(f"| {samp} | {meth} | {', '.join(f'{x:.3f}' for x in rs)} | {statistics.median(rs):.2f} |")
    return "\n".join(lines)


def plot(ratios: dict[tuple[str, str], list[float]], baseline: str, path: Path, title: str = "") -> None:
    """Bars of the medians, one dot per round, one panel per sampling (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samplings = sorted({s for s, _ in ratios}, key=str)
    fig, axes = plt.subplots(1, len(samplings), figsize=(5 * len(samplings), 3.6), squeeze=False)
    for ax, samp in zip(axes[0], samplings):
        items = [(m, rs) for (s, m), rs in ratios.items() if s == samp]
        xs = range(len(items))
        ax.bar(xs, [statistics.median(rs) for _, rs in items], color="#7aa6c2")
        for x, (_, rs) in zip(xs, items):
            ax.plot([x] * len(rs), rs, "k.", ms=6)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), [m for m, _ in items], rotation=30, ha="right")
        ax.set_ylabel(f"decode tok/s × {baseline} (paired rounds)")
        ax.set_title(f"{title} {samp}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench results.json")
    p.add_argument("--baseline", default="ar-vk", help="the method every ratio divides by (default ar-vk)")
    p.add_argument("--png", type=Path, help="also draw the ratios into this PNG")
    p.add_argument("--title", default="", help="the plot's title")
    a = p.parse_args(argv)
    ratios = paired_ratios(json.loads(a.results.read_text()), a.baseline)
    print(table(ratios, a.baseline))
    if a.png:
        plot(ratios, a.baseline, a.png, a.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
