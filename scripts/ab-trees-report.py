"""Report of scripts/ab-trees.sh: per round, TokenSwift's tokens/s (whole run and decode
phase) of the two trees, the ratio after/before, and whether their greedy token ids are
identical; then the median and spread of the paired ratios.

    python scripts/ab-trees-report.py docs/bench/restructure-ab/<block>
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def _run(folder: str) -> tuple[dict, list]:
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
        recs = [r for r in json.load(f) if r.get("method") == "tokenswift" and r.get("status", "ok") == "ok"]
    (tok,) = sorted(glob.glob(os.path.join(folder, "tokens", "tokenswift_*.json")))
    with open(tok, encoding="utf-8") as f:
        return recs[0], json.load(f)


def main(block: str) -> int:
    rounds = sorted({int(p.rsplit("-r", 1)[1]) for p in glob.glob(os.path.join(block, "before-r*")) if os.path.isdir(p)})
    lines = [f"# {os.path.basename(block)}: after / before, greedy, TokenSwift", "",
             "| round | before tok/s | after tok/s | × | before decode tok/s | after decode tok/s | × | identical |",
             "|---|---|---|---|---|---|---|---|"]
    whole, decode, same = [], [], []
    for r in rounds:
        (b, bt), (a, at) = _run(os.path.join(block, f"before-r{r}")), _run(os.path.join(block, f"after-r{r}"))
        x, y = a["tokens_per_s"] / b["tokens_per_s"], a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
        whole.append(x)
        decode.append(y)
        same.append(at == bt)
        lines.append(f"| {r} | {b['tokens_per_s']:.2f} | {a['tokens_per_s']:.2f} | {x:.3f} | "
                     f"{b['decode_tokens_per_s']:.2f} | {a['decode_tokens_per_s']:.2f} | {y:.3f} | {at == bt} |")
    lines += ["", f"median × whole run {statistics.median(whole):.3f} ({min(whole):.3f}-{max(whole):.3f}), "
                  f"decode phase {statistics.median(decode):.3f} ({min(decode):.3f}-{max(decode):.3f}); "
                  f"token-identical in {sum(same)} of {len(same)} rounds"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(block, "ab.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
