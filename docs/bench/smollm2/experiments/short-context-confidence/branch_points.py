"""Experiment tool: at a branch point of a matched long context (a context followed by
different tokens before), is the latest continuation or the most frequent one right
more often? What led ``NGramTable.recent_next`` to answer with the most frequent.

At every position of a saved greedy output where ``recent_next`` matches a 32-, 16- or
8-token context (the longest that occurred before, as the n-gram chain does), counts how
often the token that followed the context's latest occurrence was the next token, and
how often the context's most frequent continuation so far was (the latest among equals;
prompt included). The two differ only at branch points ("multi": positions whose context
had more than one continuation).

    python branch_points.py ../../replay/tiny-greedy-16k.json ../../replay/greedy-books-2k.json \\
        ../../replay/greedy-6k.json ../../replay/greedy-bench-2k.json
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay_match_levels as rml  # noqa: E402

from vllm_tokenswift.core.ngram import NGramTable  # noqa: E402

LEVELS = (8, 16, 32)


def main() -> None:
    for path in sys.argv[1:]:
        res = collections.defaultdict(collections.Counter)
        for sq in rml.gr.load_sequences(path):
            seq = list(sq["prompt"]) + list(sq["out"])
            P = len(sq["prompt"])
            counts = {m: collections.defaultdict(collections.Counter) for m in LEVELS}
            latest = {m: {} for m in LEVELS}

            def index(i):   # the token at i follows the m tokens before it
                for m in LEVELS:
                    if i >= m:
                        key = tuple(seq[i - m: i])
                        counts[m][key][seq[i]] += 1
                        latest[m][key] = seq[i]

            table = NGramTable(4)
            table.extend(seq[: P + 1])
            for i in range(P + 1):
                index(i)
            for p in range(P, len(seq) - 1):
                lv = rml.level_of(table, seq[max(0, p + 1 - table.context_len): p + 1])
                if lv in ("L8", "L16", "L32"):
                    m = int(lv[1:])
                    key = tuple(seq[p + 1 - m: p + 1])
                    c, last = counts[m][key], latest[m][key]
                    best = max(c.items(), key=lambda kv: (kv[1], kv[0] == last))[0]
                    r = res[lv]
                    r["n"] += 1
                    r["multi"] += len(c) > 1
                    r["latest"] += last == seq[p + 1]
                    r["frequent"] += best == seq[p + 1]
                table.extend([seq[p + 1]])
                index(p + 1)
        print(os.path.basename(path))
        for lv in ("L32", "L16", "L8"):
            r = res.get(lv)
            if r:
                print(f"  {lv:4s} positions {r['n']:6d}  at branch points {r['multi']:5d}  "
                      f"latest right {r['latest'] / r['n']:.3f}  most frequent right {r['frequent'] / r['n']:.3f}")


if __name__ == "__main__":
    main()
