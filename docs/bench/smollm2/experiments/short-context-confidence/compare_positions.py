"""Experiment tool: TokenSwift's n-gram chain against suffix decoding at every position of
a saved greedy output, and the acceptance of ``NGramTable.recent_next`` by matched context
length and confidence bin (what led to ``NGramTable.level_rate``; see README.md here).

Both drafters depend only on the tokens so far (the n-gram table, the chain builder and
Arctic Inference's suffix tree; not the policy's cut), so each can be asked at every
position of the same output and its draft compared with what followed.

    python compare_positions.py greedy-bench-2k.json [--list]    # a file of docs/bench/smollm2/replay

Prints: accepted drafts summed over all positions for both, the positions where either
accepted more, and why TokenSwift accepted fewer (``ts-empty``: no chain; ``ts-short``: its
whole chain was accepted but suffix decoding's was longer; ``ts-wrong``: a token was
wrong); ``--list`` prints each such position with its text (needs the SmolLM2 tokenizer).
Then, per matched length and confidence bin, how often ``recent_next``'s token was right.
Needs ``arctic_inference`` (see vllm_tokenswift/bench/harness.py for the CPU build).
"""
import collections
import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../..")
spec = importlib.util.spec_from_file_location("gr", os.path.join(ROOT, "docs/research/greedy_replay.py"))
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)
from vllm_tokenswift.core.chain import ngram_chain  # noqa: E402
from vllm_tokenswift.core.ngram import NGramTable  # noqa: E402
from vllm_tokenswift.core.chain import NGRAM_FLOOR  # noqa: E402


def main():
    name, show = sys.argv[1], "--list" in sys.argv
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    tok = None
    if show:
        from transformers import AutoTokenizer

        from vllm_tokenswift.cli.models import resolve_target
        tok = AutoTokenizer.from_pretrained(resolve_target("smollm2")[0])
    tot = collections.Counter()
    why = collections.Counter()
    by_level = collections.defaultdict(lambda: [0, 0])
    for sq in gr.load_sequences(os.path.join(ROOT, "docs/bench/smollm2/replay", name)):
        prompt, seq = sq["prompt"], list(sq["prompt"]) + list(sq["out"])
        table = NGramTable(4)
        p = len(prompt)
        table.extend(seq[: p + 1])
        cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=0)
        cache.start_request("r", np.asarray(prompt, dtype=np.int32))
        cache.add_active_response("r", [seq[p]])
        while p < len(seq) - 2:
            room = min(8, len(seq) - 2 - p)
            ctx = seq[max(0, p + 1 - table.context_len): p + 1]
            ch = ngram_chain(ctx, table, room, NGRAM_FLOOR)
            pattern = np.asarray(seq[max(0, p + 1 - 24): p + 1], dtype=np.int32)
            sf = list(cache.speculate("r", pattern, max_spec_tokens=room, max_spec_factor=1.0,
                                      min_token_prob=0.1).token_ids)
            a_ts, a_sf = gr._accepted(seq, p, ch.tokens), gr._accepted(seq, p, sf)
            tot["ts accepted"] += a_ts
            tot["suffix accepted"] += a_sf
            if a_sf > a_ts:
                tot["suffix more"] += 1
                kind = "ts-empty" if not ch.tokens else ("ts-short" if len(ch.tokens) == a_ts else "ts-wrong")
                why[kind] += 1
                if show:
                    print(f"{p - len(prompt)} {kind} ts {len(ch.tokens)}/{a_ts} suffix {len(sf)}/{a_sf} "
                          f"confs {[round(c, 2) for c in ch.confs]} ctx {tok.decode(seq[p - 8:p + 1])!r} "
                          f"ts {tok.decode(ch.tokens)!r} suffix {tok.decode(sf)!r}")
            elif a_ts > a_sf:
                tot["ts more"] += 1
            ans = table.recent_next(ctx)
            if ans is not None:   # which length matched: the longest that occurred before
                lev = next((m for m, d in zip(table.longer_lens, table.longer_after)
                            if len(ctx) >= m and hash(tuple(ctx[-m:])) in d), table.long_n)
                rec = by_level[(lev, min(9, int(ans[1] * 10)))]
                rec[0] += 1
                rec[1] += ans[0] == seq[p + 1]
            table.extend([seq[p + 1]])
            cache.add_active_response("r", [seq[p + 1]])
            p += 1
    print(name, dict(tot), dict(why))
    print("recent_next by matched length and confidence bin: positions, share right")
    for (lev, b), (n, ok) in sorted(by_level.items()):
        if n >= 10:
            print(f"  length {lev:>2} conf [{b / 10:.1f}, {(b + 1) / 10:.1f}): {n:>6} {ok / n:.3f}")


if __name__ == "__main__":
    main()
