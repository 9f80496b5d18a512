"""Experiment (not shipped): the confidence of the n-gram table's short-context back-off
(``NGramTable.short_next``) for a context seen once before, replayed engine-free over saved
greedy outputs against suffix decoding (``docs/research/greedy_replay.py``).

    python replay_short_confidence.py [--own-source] ['{"a": 35, "g": 0.5, "b": 3.0, ...}']   # costs in ms

Prints per corpus and output length: steps and modelled seconds for suffix decoding and
for each variant of the confidence formula (``current``: hits / (repeats + 1), 0 until the
context recurred). ``--own-source``: the Laplace confidence with and without a calibration
source of its own for the short-context tokens (source key 3, so the policy's calibration
learns their acceptance apart from other n-gram tokens).
"""
import importlib.util
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../..")
spec = importlib.util.spec_from_file_location("gr", os.path.join(ROOT, "docs/research/greedy_replay.py"))
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)
from vllm_tokenswift.core import chain as C  # noqa: E402
from vllm_tokenswift.core.ngram import NGramTable  # noqa: E402

ORIG_SHORT, ORIG_EXTEND = NGramTable.short_next, C.extend_chain
SOURCE_SHORT = 3


def short_with(conf):
    """``NGramTable.short_next`` with the confidence ``conf(repeats, hits, context_len)``."""
    def short_next(self, context):
        for m, d, rec in zip(self.short_lens, self.short_after, self.short_record):
            if len(context) < m:
                continue
            key = tuple(context[-m:])
            j = d.get(key)
            if j is None:
                continue
            seen, hits = rec.get(key, (0, 0))
            return self.tokens[j], conf(seen, hits, m)
        return None
    return short_next


def extend_own_source(chain, context, table, max_len, min_conf, cum=1.0, prob=None, num_dists=0,
                      mix=C.DEFAULT_MIX, recent=False):
    """``chain.extend_chain`` for n-gram chains (no draft distributions), marking the
    short-context back-off's tokens with ``SOURCE_SHORT``."""
    track = len(chain.confs) == len(chain.tokens)
    keep = table.context_len if recent else table.n - 1
    ext_ctx = list(context[-keep:]) + chain.tokens
    while len(chain.tokens) < max_len:
        src = C.SOURCE_NGRAM
        nxt = (table.recent_next(ext_ctx) if recent else None) or table.best_next(ext_ctx)
        if nxt is None and recent:
            nxt, src = table.short_next(ext_ctx), SOURCE_SHORT
        if nxt is None:
            break
        tok, f = nxt
        if cum * f < min_conf:
            break
        cum *= f
        chain.expected_len += cum
        chain.tokens.append(tok)
        chain.sources.append(src)
        if track:
            chain.confs.append(f)
        ext_ctx.append(tok)
    return chain


def laplace(s, h, m):
    return (h + 1) / (s + 2)


VARIANTS = {   # name -> (short_next, extend_chain)
    "current": (ORIG_SHORT, ORIG_EXTEND),
    "laplace": (short_with(laplace), ORIG_EXTEND),
    "first0.3": (short_with(lambda s, h, m: h / (s + 1) if s else 0.3), ORIG_EXTEND),
    "first0.15": (short_with(lambda s, h, m: h / (s + 1) if s else 0.15), ORIG_EXTEND),
    "laplace-m2only": (short_with(lambda s, h, m: laplace(s, h, m) if m == 2 else h / (s + 1)), ORIG_EXTEND),
}
OWN_SOURCE_VARIANTS = {
    "current": (ORIG_SHORT, ORIG_EXTEND),
    "laplace": (short_with(laplace), ORIG_EXTEND),
    "laplace+own-source": (short_with(laplace), extend_own_source),
    "own-source": (ORIG_SHORT, extend_own_source),
}


def total(replay, seqs, n, costs):
    tot = {"steps": 0, "ms": 0.0}
    for sq in seqs:
        r = replay(sq["prompt"], sq["out"][:n], 8, costs)
        tot["steps"] += r["steps"]
        tot["ms"] += r["ms"]
    return tot


def main():
    args = sys.argv[1:]
    variants = OWN_SOURCE_VARIANTS if "--own-source" in args else VARIANTS
    args = [a for a in args if a != "--own-source"]
    costs = json.loads(args[0]) if args else {"a": 35, "g": 0.5, "b": 3.0, "f0": 35, "f1": 0.0,
                                             "h0": 35, "h1": 0.0}
    for name, ns in (("greedy-books-2k.json", (512, 2048)), ("greedy-6k.json", (1024, 6144))):
        seqs = gr.load_sequences(os.path.join(ROOT, "docs/bench/smollm2/replay", name))
        for n in ns:
            sfx = total(gr.replay_suffix, seqs, n, costs)
            line = [f"{name} n={n} suffix {sfx['steps']} {sfx['ms'] / 1000:.2f}s |"]
            for label, (short_next, extend) in variants.items():
                NGramTable.short_next, C.extend_chain = short_next, extend
                try:
                    tot = total(gr.replay_tokenswift, seqs, n, costs)
                finally:
                    NGramTable.short_next, C.extend_chain = ORIG_SHORT, ORIG_EXTEND
                line.append(f"{label} {tot['steps']} {tot['ms'] / 1000:.2f}s")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
