"""Replay a greedy generation to compare TokenSwift's n-gram drafting with suffix decoding,
without an engine.

Greedy decoding is deterministic and speculative decoding is lossless, so the output of
any drafter is the same token sequence; how many steps it takes only depends on which
drafts it proposes. Given that sequence (prompt + greedy output), this script replays,
step by step:

* **TokenSwift's n-gram path** with the proposer's own code: the request's
  :class:`~vllm_tokenswift.core.ngram.NGramTable`, :func:`~vllm_tokenswift.core.chain.ngram_chain`,
  the engine-wide :class:`~vllm_tokenswift.core.policy.decision.Calibration`,
  :func:`~vllm_tokenswift.core.policy.decision.decide` (with its plain-step probe) and the policy's cut.
  The cost model is fixed (``--costs``) instead of learnt, and the forced exploration
  tries of the draft forward and the fused heads are left out (on SmolLM2's 6K greedy run
  they were 8 of 775 steps);
* **suffix decoding** with Arctic Inference's ``SuffixDecodingCache``, called as vLLM
  0.32's ``SuffixDecodingProposer`` calls it (tree depth 24, spec factor 1, min token
  probability 0.1, no cached requests), if ``arctic_inference`` is installed.

A step that verifies ``D`` draft tokens is charged ``a + g·[D > 0] + b·D`` milliseconds
(the policy's cost model; the defaults are the fit to per-step timings of SmolLM2-135M on
the 2-core CPU at 2-3.5K tokens of context: a 35 ms step, g about 0, 3 ms per draft
token). Prints, for each prefix of the output, steps, draft tokens, accepted tokens and
the modelled time of both, and plots steps against generated tokens (``--plot``).

    python docs/research/greedy_replay.py --tokens docs/bench/smollm2/replay/greedy-6k.json \\
        --lengths 1024,2048,6144 --plot replay.png

``--generate N --tokens FILE`` first writes FILE: SmolLM2's greedy outputs of N tokens for
``--num-prompts`` book prompts of ``--prefix-len`` tokens (plain vLLM decoding, one batch).
A FILE holds one ``{"prompt", "out"}`` sequence or a ``"sequences"`` list; figures are
summed over the sequences.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def replay_tokenswift(prompt: list[int], out: list[int], k: int, costs: dict,
                      calibration=None, observe_past_cut: bool = True, charge: dict | None = None,
                      ngram_escape: bool = False) -> dict:
    """TokenSwift's n-gram drafting replayed over ``prompt + out`` (greedy, one request).

    As the proposer does, a step whose drafts were all accepted (or that drafted none)
    books whether the chain's first token past the cut would have been accepted
    (``Calibration.observe``; ``observe_past_cut=False``: not, as the proposer with
    ``policy_tuning.observe_past_cut`` false). ``calibration``: start from this one
    (default: a fresh ``Calibration(positions=k)``, as the proposer's; it is updated in
    place). ``charge``: the costs each step is charged (default ``costs``, the ones the
    policy decides with): a policy that misprices a draft token, replayed.
    ``ngram_escape``: as ``policy_tuning.ngram_escape`` true (a 3-token context's most
    frequent continuation scored ``c / (t + 1)``); False (the default, as the proposer
    does for greedy requests by default): ``c / t``.

    Returns:
        ``{"steps", "drafted", "accepted", "ms", "steps_at"}``: engine steps after the
        prefill (each yields its accepted drafts plus one token, so ``steps + accepted ==
        len(out) - 1``), draft tokens verified, drafts accepted, modelled milliseconds, and
        per output token the steps taken when it was generated (0 for the prefill's).
    """
    from vllm_tokenswift.core.policy import decision as pol
    from vllm_tokenswift.core.chain import ngram_chain
    from vllm_tokenswift.core.ngram import NGramTable
    from vllm_tokenswift.core.chain import NGRAM_FLOOR
    from vllm_tokenswift.core.policy.adaptive import calibration_keys as _calibration_keys

    seq = list(prompt) + list(out)
    table = NGramTable(4)
    calib = calibration if calibration is not None else pol.Calibration(positions=k)
    p = len(prompt)                 # the prefill samples seq[p]; the first proposer call sees it
    table.extend(seq[: p + 1])
    plain_window: list[int] = []    # the cost model's window of draft-free steps (for the probe)
    res = {"steps": 0, "drafted": 0, "accepted": 0, "ms": 0.0, "steps_at": [0]}
    while p < len(seq) - 1:
        room = min(k, len(seq) - 2 - p)   # the bonus token of a wholly accepted chain fits
        ch = ngram_chain(seq[max(0, p + 1 - table.context_len): p + 1], table, room, NGRAM_FLOOR,
                         ngram_escape)
        cums = {pol.NONE: np.zeros(0)}
        if ch.tokens:
            cums[pol.NGRAM] = calib.chain_cum(_calibration_keys(ch.sources, False), ch.confs)
        rows = [pol.RowOptions(cums)]
        dec = pol.decide(rows, costs)
        if pol.needs_plain_probe(dec, rows, costs, sum(plain_window)):
            dec = pol.plain_decision(rows, costs)
        n = pol.cut_length(cums[pol.NGRAM], dec.threshold) if dec.kinds[0] == pol.NGRAM else 0
        toks = ch.tokens[:n]
        acc = _accepted(seq, p, toks)
        if toks:
            calib.update(_calibration_keys(ch.sources[:n], False), ch.confs[:n], n, acc)
        if observe_past_cut and acc == n < len(ch.tokens):    # the output tells the token past the cut
            calib.observe(_calibration_keys(ch.sources[n:n + 1], False)[0], n, ch.confs[n],
                          seq[p + 1 + n] == ch.tokens[n])
        plain_window = (plain_window + [int(not toks)])[-64:]
        _charge(res, charge or costs, len(toks), acc)
        table.extend(seq[p + 1: p + 2 + acc])
        p += acc + 1
        res["steps_at"].extend([res["steps"]] * (acc + 1))
    return res


def replay_suffix(prompt: list[int], out: list[int], k: int, costs: dict, depth: int = 24,
                  factor: float = 1.0, min_prob: float = 0.1) -> dict:
    """Suffix decoding (Arctic Inference) replayed as vLLM 0.32's proposer calls it.

    Raises:
        ImportError: ``arctic_inference`` is not installed.
    """
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    seq = list(prompt) + list(out)
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=0)
    cache.start_request("r", np.asarray(prompt, dtype=np.int32))
    p = len(prompt)
    new = [seq[p]]
    res = {"steps": 0, "drafted": 0, "accepted": 0, "ms": 0.0, "steps_at": [0]}
    while p < len(seq) - 1:
        cache.add_active_response("r", new)
        pattern = np.asarray(seq[max(0, p + 1 - depth): p + 1], dtype=np.int32)
        toks = list(cache.speculate("r", pattern, max_spec_tokens=min(k, len(seq) - 2 - p),
                                    max_spec_factor=factor, min_token_prob=min_prob).token_ids)
        acc = _accepted(seq, p, toks)
        _charge(res, costs, len(toks), acc)
        new = seq[p + 1: p + 2 + acc]
        p += acc + 1
        res["steps_at"].extend([res["steps"]] * (acc + 1))
    return res


def _accepted(seq: list[int], p: int, toks: list[int]) -> int:
    """Greedy verification: the drafts that equal the output, up to the first mismatch."""
    a = 0
    for j, t in enumerate(toks):
        if seq[p + 1 + j] != t:
            break
        a += 1
    return a


def _charge(res: dict, costs: dict, drafted: int, accepted: int) -> None:
    res["steps"] += 1
    res["drafted"] += drafted
    res["accepted"] += accepted
    res["ms"] += costs["a"] + (costs["g"] if drafted else 0.0) + costs["b"] * drafted


def _generate(path: str, n: int, prefix_len: int, num_prompts: int, bench_prompt: bool = False,
              model_name: str = "smollm2") -> None:
    """Write ``path``: the greedy output of ``model_name`` (``smollm2``, ``tiny`` or a
    folder) of ``n`` tokens (plain vLLM decoding, one batch) for ``num_prompts`` prompts of ``prefix_len`` tokens, each from a different
    Project Gutenberg book (the tokens after the book's first 2,000, past its front matter),
    or, with ``bench_prompt``, for the prompt that ``vllm-tokenswift bench`` gives a
    batch-1 run of ``n`` tokens at that ``prefix_len`` (the bundled prompts' first file,
    the prefix capped as the benchmark caps it to fit the model's window)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from vllm_tokenswift.bench.harness import (book_prompts, build_prompts, effective_prefix_len, engine_output_to,
                                                load_prompt_tokens, model_max_len)
    from vllm_tokenswift.cli.models import resolve_target

    model, _ = resolve_target(model_name)
    if bench_prompt:   # as the harness builds it: prefix capped to fit the window with n tokens
        cfg = SimpleNamespace(random_prompts=False, prompt_files=None, model=model, tokenizer=None, seed=0)
        prefix = effective_prefix_len(prefix_len, [n], model_max_len(model, None))
        prompts = build_prompts(load_prompt_tokens(cfg), 1, prefix)
        num_prompts = 1
    else:
        try:
            prompts = book_prompts(AutoTokenizer.from_pretrained(model), num_prompts, prefix_len, skip=2000)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    with engine_output_to("/tmp/greedy_replay_vllm.log") as (out, _err):
        from functools import partial

        from tqdm import tqdm
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype="float32", max_model_len=prefix_len + n + 64, enforce_eager=True,
                  kv_cache_memory_bytes=2**30, seed=0, max_num_seqs=num_prompts)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           use_tqdm=partial(tqdm, file=out))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"model": "SmolLM2-135M-Instruct" if model_name == "smollm2" else model_name, "sequences": [
            {"prompt": p, "out": list(r.outputs[0].token_ids)} for p, r in zip(prompts, res)]}, f)


def load_sequences(path: str) -> list[dict]:
    """The ``{"prompt", "out"}`` sequences of a tokens file (one, or a ``"sequences"`` list)."""
    with open(path) as f:
        data = json.load(f)
    return data["sequences"] if "sequences" in data else [data]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", required=True, help="JSON with 'prompt' and 'out' token id lists")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="first write --tokens: N greedy tokens of --model (needs vLLM)")
    ap.add_argument("--model", default="smollm2", help="with --generate: smollm2 (default), tiny or a folder")
    ap.add_argument("--prefix-len", type=int, default=2000, help="with --generate: prompt tokens")
    ap.add_argument("--num-prompts", type=int, default=8, help="with --generate: prompts (books)")
    ap.add_argument("--bench-prompt", action="store_true",
                    help="with --generate: the benchmark's own batch-1 prompt of --prefix-len tokens instead of books")
    ap.add_argument("--lengths", default="1024,2048", help="output prefixes to replay")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--costs", default="35,0.5,3.0", help="a,g,b in ms (plain step, drafting step's extra, per draft token)")
    ap.add_argument("--decide-costs", default=None, metavar="A,G,B",
                    help="the costs TokenSwift's policy decides with, in ms (default: --costs, which every step is charged)")
    ap.add_argument("--no-observe-past-cut", action="store_true",
                    help="as policy_tuning.observe_past_cut false: the calibration books verified tokens only")
    ap.add_argument("--ngram-escape", action="store_true",
                    help="as policy_tuning.ngram_escape true: a 3-token context's continuation is scored c/(t+1), not c/t "
                         "(the default \"sampled\" leaves greedy requests at c/t)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="steps against generated tokens (first sequence)")
    args = ap.parse_args()
    if args.generate:
        _generate(args.tokens, args.generate, args.prefix_len, args.num_prompts, args.bench_prompt, args.model)
    seqs = load_sequences(args.tokens)
    def parse_costs(text):
        a, g, b = (float(x) for x in text.split(","))
        return {"a": a, "g": g, "b": b, "f0": a, "f1": 0.0, "h0": a, "h1": 0.0}

    costs = parse_costs(args.costs)
    decide = parse_costs(args.decide_costs) if args.decide_costs else costs
    lengths = sorted({int(x) for x in args.lengths.split(",")})
    print(f"{len(seqs)} sequence(s); sums over them")
    print(f"{'tokens':>7} {'method':<11} {'steps':>6} {'drafted':>8} {'accepted':>9} {'model s':>8}  suffix/TS time")
    first = {}
    for n in lengths:
        tot = {"tokenswift": None, "suffix": None}
        for i, sq in enumerate(seqs):
            out = sq["out"][:n]
            rs = {"tokenswift": replay_tokenswift(sq["prompt"], out, args.k, decide, charge=costs,
                                                  observe_past_cut=not args.no_observe_past_cut,
                                                  ngram_escape=args.ngram_escape)}
            try:
                rs["suffix"] = replay_suffix(sq["prompt"], out, args.k, costs)
            except ImportError:
                pass
            for name, r in rs.items():
                if tot[name] is None:
                    tot[name] = {key: 0 for key in ("steps", "drafted", "accepted", "ms")}
                for key in tot[name]:
                    tot[name][key] += r[key]
            if i == 0:
                first[n] = rs
        for name in ("tokenswift", "suffix"):
            r = tot[name]
            if r is not None:
                ratio = f"  {r['ms'] / tot['tokenswift']['ms']:.3f}" if name == "suffix" else ""
                print(f"{n:>7} {name:<11} {r['steps']:>6} {r['drafted']:>8} {r['accepted']:>9} "
                      f"{r['ms'] / 1000:>8.2f}{ratio}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rs = first[max(first)]
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in rs.items():
            ax.plot(range(len(r["steps_at"])), r["steps_at"], label=name, ls="-" if name == "tokenswift" else "--")
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("engine steps")
        ax.set_title(f"Greedy replay of the first sequence, k = {args.k} (fewer steps = faster)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
