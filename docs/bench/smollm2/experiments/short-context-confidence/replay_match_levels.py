"""Experiment tool: where TokenSwift's greedy n-gram chains waste draft tokens, by the
context length that matched, and two variants of the policy's view of it (not shipped).

Replays saved greedy outputs as ``docs/research/greedy_replay.py`` does (the proposer's own
n-gram table, chain builder, calibration, decision and cut; a fixed cost model), and
labels every chain token with the level that produced it: ``L32``/``L16``/``L8`` (the
latest occurrence of the last 32/16/8 tokens, ``NGramTable.recent_next``), ``3g`` (the
most frequent 4-gram continuation), ``S2``/``S1`` (the short back-off,
``NGramTable.short_next``).

Prints, per corpus:

* per level: chain tokens reached (verified up to the first rejection), their acceptance,
  rejections at that level and the draft tokens those rejections wasted (the rejected
  token and every token after it);
* modelled milliseconds of three variants of the calibration's keys:
  ``shipped`` (one key per source, n-grams all alike), ``level-keyed`` (one calibration
  key per level, so e.g. short back-off tokens learn their own acceptance),
  ``suffix-cap`` (a chain whose first token comes from ``3g``, ``S2`` or ``S1`` is cut to
  3, 2 or 1 tokens: suffix decoding's ``max_spec_factor = 1``, draft length at most the
  match length).

    python replay_match_levels.py --costs "35,0.5,3;20,0.5,0.3" \\
        ../../replay/greedy-6k.json ../../replay/greedy-bench-2k.json ../../replay/greedy-books-2k.json
"""
import argparse
import collections
import importlib.util
import os

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../..")
spec = importlib.util.spec_from_file_location("gr", os.path.join(ROOT, "docs/research/greedy_replay.py"))
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)
from vllm_tokenswift.core.policy import decision as pol  # noqa: E402
from vllm_tokenswift.core.chain import ngram_chain  # noqa: E402
from vllm_tokenswift.core.ngram import NGramTable  # noqa: E402
from vllm_tokenswift.core.chain import NGRAM_FLOOR  # noqa: E402
from vllm_tokenswift.core.policy.adaptive import calibration_keys as _calibration_keys  # noqa: E402

LEVEL_KEYS = {"L32": 20, "L16": 21, "L8": 22, "3g": 23, "S2": 24, "S1": 25, "?": 26}
SUFFIX_CAP = {"3g": 3, "S2": 2, "S1": 1}


def level_of(table: NGramTable, ctx: list) -> str:
    """Which rule of ``ngram_chain`` gives the next token after ``ctx`` (the same order:
    the longest recent match, the 4-gram continuation, the short back-off)."""
    L = table.long_n
    if L and len(ctx) >= L:
        for m, d in zip(table.longer_lens, table.longer_after):
            if len(ctx) >= m and d.get(hash(tuple(ctx[-m:]))) is not None:
                return f"L{m}"
        if table.after.get(tuple(ctx[-L:])) is not None:
            return f"L{L}"
    if table.best_next(ctx) is not None:
        return "3g"
    for m, d in zip(table.short_lens, table.short_after):
        if len(ctx) >= m and d.get(tuple(ctx[-m:])) is not None:
            return f"S{m}"
    return "?"


def replay(path: str, costs: dict, variant: str, k: int = 8):
    """Returns (totals, per-level [reached, accepted, wasted])."""
    tot = collections.Counter()
    levels = collections.defaultdict(lambda: [0, 0, 0])
    for sq in gr.load_sequences(path):
        seq = list(sq["prompt"]) + list(sq["out"])
        table, calib = NGramTable(4), pol.Calibration()
        p = len(sq["prompt"])
        table.extend(seq[: p + 1])
        plain: list[int] = []
        while p < len(seq) - 1:
            room = min(k, len(seq) - 2 - p)
            ctx = seq[max(0, p + 1 - table.context_len): p + 1]
            ch = ngram_chain(ctx, table, room, NGRAM_FLOOR)
            c, lv = list(ctx), []
            for t in ch.tokens:
                lv.append(level_of(table, c))
                c.append(t)
            if variant == "suffix-cap" and lv and lv[0] in SUFFIX_CAP:
                ch.truncate(SUFFIX_CAP[lv[0]])
                lv = lv[: len(ch.tokens)]
            keys = ([LEVEL_KEYS[x] for x in lv] if variant == "level-keyed"
                    else _calibration_keys(ch.sources, False))
            cums = {pol.NONE: np.zeros(0)}
            if ch.tokens:
                cums[pol.NGRAM] = calib.chain_cum(keys, ch.confs)
            rows = [pol.RowOptions(cums)]
            dec = pol.decide(rows, costs)
            if pol.needs_plain_probe(dec, rows, costs, sum(plain)):
                dec = pol.plain_decision(rows, costs)
            n = pol.cut_length(cums[pol.NGRAM], dec.threshold) if dec.kinds[0] == pol.NGRAM else 0
            acc = gr._accepted(seq, p, ch.tokens[:n])
            if n:
                calib.update(keys[:n], ch.confs[:n], n, acc)
                for j in range(min(n, acc + 1)):
                    rec = levels[lv[j]]
                    rec[0] += 1
                    rec[1] += j < acc
                    if j == acc:
                        rec[2] += n - acc
            plain = (plain + [int(not n)])[-64:]
            tot["steps"] += 1
            tot["drafted"] += n
            tot["ms"] += costs["a"] + (costs["g"] if n else 0.0) + costs["b"] * n
            table.extend(seq[p + 1: p + 2 + acc])
            p += acc + 1
    return tot, levels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--costs", default="35,0.5,3", help="a,g,b in ms; several separated by ';'")
    args = ap.parse_args()
    for cs in args.costs.split(";"):
        a, g, b = (float(x) for x in cs.split(","))
        costs = {"a": a, "g": g, "b": b, "f0": a, "f1": 0.0, "h0": a, "h1": 0.0}
        print(f"== costs a={a} g={g} b={b} ms")
        for f in args.files:
            name = os.path.basename(f)
            base, levels = replay(f, costs, "shipped")
            print(f"{name}: shipped {base['steps']} steps, {base['drafted']} drafted, {base['ms'] / 1000:.2f} s")
            for lv in sorted(levels, key=lambda x: -levels[x][0]):
                r, acc, w = levels[lv]
                print(f"   {lv:4s} reached {r:6d}  accepted {acc / r:.3f}  rejected here {r - acc:4d}  wasted {w:5d}")
            for variant in ("level-keyed", "suffix-cap"):
                t, _ = replay(f, costs, variant)
                print(f"   {variant:11s} {t['steps']} steps, {t['drafted']} drafted, {t['ms'] / 1000:.2f} s "
                      f"({100 * (t['ms'] / base['ms'] - 1):+.2f}%)")


if __name__ == "__main__":
    main()
