"""Experiment (not shipped): the Laplace short-context confidence of replay_short_confidence.py,
with and without a calibration source of its own for the short-context tokens (source key 3,
so the policy's calibration learns their acceptance apart from other n-gram tokens).

    python replay_own_source.py '{"a": 35, "g": 0.5, "b": 3.0, "f0": 35, "f1": 0.0, "h0": 35, "h1": 0.0}'
"""
import os, sys, json, importlib.util
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../..")
spec = importlib.util.spec_from_file_location("gr", os.path.join(ROOT, "examples/greedy_replay.py"))
gr = importlib.util.module_from_spec(spec); spec.loader.exec_module(gr)
from vllm_tokenswift import chain as C
from vllm_tokenswift.ngram import NGramTable
orig_short = NGramTable.short_next
orig_ext = C.extend_chain
def laplace_short(self, context):
    for m, d, rec in zip(self.short_lens, self.short_after, self.short_record):
        if len(context) < m: continue
        key = tuple(context[-m:]); j = d.get(key)
        if j is None: continue
        seen, hits = rec.get(key, (0, 0))
        return self.tokens[j], (hits + 1) / (seen + 2)
    return None
def ext_own_source(chain, context, table, max_len, min_conf, cum=1.0, prob=None, num_dists=0, mix=C.DEFAULT_MIX, recent=False):
    track = len(chain.confs) == len(chain.tokens)
    keep = table.context_len if recent else table.n - 1
    ext_ctx = list(context[-keep:]) + chain.tokens
    while len(chain.tokens) < max_len:
        src = C.SOURCE_NGRAM
        nxt = (table.recent_next(ext_ctx) if recent else None) or table.best_next(ext_ctx)
        if nxt is None and recent:
            nxt = table.short_next(ext_ctx); src = 3
        if nxt is None: break
        tok, f = nxt
        if cum * f < min_conf: break
        cum *= f
        chain.expected_len += cum
        chain.tokens.append(tok); chain.sources.append(src)
        if track: chain.confs.append(f)
        ext_ctx.append(tok)
    return chain
costs = json.loads(sys.argv[1])
variants = {"current": (orig_short, orig_ext), "laplace": (laplace_short, orig_ext),
            "laplace+own-source": (laplace_short, ext_own_source), "own-source": (orig_short, ext_own_source)}
for path, ns in (("docs/bench/smollm2/replay/greedy-books-2k.json",(512,2048)),("docs/bench/smollm2/replay/greedy-6k.json",(1024,6144))):
    seqs = gr.load_sequences(os.path.join(ROOT, path))
    for n in ns:
        line=[f"{path.split('/')[-1]} n={n}"]
        sfx={"steps":0,"ms":0}
        for sq in seqs:
            r=gr.replay_suffix(sq["prompt"], sq["out"][:n], 8, costs); sfx["steps"]+=r["steps"]; sfx["ms"]+=r["ms"]
        line.append(f"suffix {sfx['steps']} {sfx['ms']/1000:.2f}s |")
        for name,(sn,ex) in variants.items():
            NGramTable.short_next = sn; C.extend_chain = ex
            tot={"steps":0,"ms":0}
            for sq in seqs:
                r=gr.replay_tokenswift(sq["prompt"], sq["out"][:n], 8, costs); tot["steps"]+=r["steps"]; tot["ms"]+=r["ms"]
            line.append(f"{name} {tot['steps']} {tot['ms']/1000:.2f}s")
        NGramTable.short_next=orig_short; C.extend_chain=orig_ext
        print(" ".join(line), flush=True)
