"""Experiment (not shipped): the confidence of the n-gram table's short-context back-off
(``NGramTable.short_next``) for a context seen once before, replayed engine-free over saved
greedy outputs against suffix decoding (``examples/greedy_replay.py``).

    python replay_short_confidence.py ['{"a": 35, "g": 0.5, "b": 3.0, ...}']   # costs in ms

Prints per corpus and output length: steps and modelled seconds for suffix decoding and
for each variant of the confidence formula (``current``: hits / (repeats + 1), 0 until the
context recurred)."""
import os, sys, importlib.util
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../..")
spec = importlib.util.spec_from_file_location("gr", os.path.join(ROOT, "examples/greedy_replay.py"))
gr = importlib.util.module_from_spec(spec); spec.loader.exec_module(gr)
from vllm_tokenswift.ngram import NGramTable
orig = NGramTable.short_next
def make(fn):
    def short_next(self, context):
        for m, d, rec in zip(self.short_lens, self.short_after, self.short_record):
            if len(context) < m: continue
            key = tuple(context[-m:]); j = d.get(key)
            if j is None: continue
            seen, hits = rec.get(key, (0, 0))
            return self.tokens[j], fn(seen, hits, m)
        return None
    return short_next
variants = {
 "current": None,
 "laplace": lambda s,h,m: (h+1)/(s+2),
 "first0.3": lambda s,h,m: h/(s+1) if s else 0.3,
 "first0.15": lambda s,h,m: h/(s+1) if s else 0.15,
 "laplace-m2only": lambda s,h,m: (h+1)/(s+2) if m==2 else h/(s+1),
}
import json; costs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"a": 35, "g": 0.5, "b": 3.0, "f0": 35, "f1": 0.0, "h0": 35, "h1": 0.0}
for path, ns in ((os.path.join(ROOT, "docs/bench/smollm2/replay/greedy-books-2k.json"),(512,2048)),(os.path.join(ROOT, "docs/bench/smollm2/replay/greedy-6k.json"),(1024,6144))):
    seqs = gr.load_sequences(path)
    for n in ns:
        sfx = {"steps":0,"ms":0}
        for sq in seqs:
            r = gr.replay_suffix(sq["prompt"], sq["out"][:n], 8, costs); sfx["steps"]+=r["steps"]; sfx["ms"]+=r["ms"]
        line=[f"{path.split('/')[-1]} n={n} suffix {sfx['steps']} {sfx['ms']/1000:.1f}s |"]
        for name, fn in variants.items():
            NGramTable.short_next = orig if fn is None else make(fn)
            tot={"steps":0,"ms":0}
            for sq in seqs:
                r = gr.replay_tokenswift(sq["prompt"], sq["out"][:n], 8, costs); tot["steps"]+=r["steps"]; tot["ms"]+=r["ms"]
            line.append(f"{name} {tot['steps']} {tot['ms']/1000:.1f}s")
        NGramTable.short_next = orig
        print(" ".join(line), flush=True)
