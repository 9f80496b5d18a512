"""Does a TokenSwift step that drafts nothing cost what a plain decoding step costs?

Keeps one engine per mode alive in one process (each with vLLM's usual engine-core and
worker processes; an idle engine uses no CPU) and runs them **alternately**, one at
a time, on the same long prompt under the paper's sampling (T 1.0, min_p 0.1,
repetition penalty 1.2 over 1,024 tokens), so that slow drift of the machine hits
every mode alike:

* ``ar``: plain decoding;
* ``ar-sync``: plain decoding with ``async_scheduling=False``. vLLM 0.32 turns async
  scheduling off for every draft-model-free speculative method (``custom_class``,
  ``ngram``, ``suffix``: "Async scheduling not supported with ... speculative
  decoding"), so ``ar`` vs ``ar-sync`` is what any such engine loses per step before
  it proposes anything;
* ``ts-empty``: a TokenSwift engine whose proposer returns no drafts at once (the
  cost of a speculative engine's step itself: scheduler, runner, sampler);
* ``ts-nodraft``: the proposer accounts and updates its n-gram tables but never
  drafts (its ``_draft`` step is a no-op): ``ts-empty`` + the proposer's fixed work;
* ``ts``: the TokenSwift engine as shipped (adaptive policy);
* ``ar-fullpen``: plain decoding with the windowed penalty as it was before
  2026-11-26 (third session): the window found by scanning the whole output, and
  vLLM's own penalties (prompt and output masks and counts, O(prompt + output) per
  step) run after the windowed one even when they change nothing. ``ar`` vs
  ``ar-fullpen`` is what that change saved per step.

The modes other than ``ts`` are set up by replacing a method of the proposer in the
worker (``collective_rpc`` with a callable); nothing of the package is changed.
Each timed run generates ``--new-tokens`` tokens per request; the figure is decode
time per token: for each request, the engine core's time from its first token to its
last over its tokens after the first, median over the run's requests (the prompt's KV
blocks are in the prefix cache after the warm-up, so the prefill is short anyway). Before
2026-11-28 it was the run's wall time minus the first request's time to first token; at
batch > 1 that is wrong whenever the first request is not the last to start decoding (one
AR instance's first request had its first token after 3.0 s, against 0.5-0.6 s in the
other engines, and AR came out 10% faster per token by that formula while its whole runs
took no longer than theirs).
Each run also records its wall time per token. Prints ms per token per run and each mode's
median ratio to ``ar``.

    python docs/research/step_cost_ab.py --prefix-len 6000 --new-tokens 300 --repeats 4

``--batch-size B`` sends the prompt B times per run (the engines admit B requests at
once, the prompt's blocks shared through the prefix cache); the figure is then decode
time per token of each request, i.e. per engine step of plain decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

MODES = ("ar", "ar-sync", "ts-empty", "ts-nodraft", "ts", "ar-fullpen")


def _patch_fullpen(worker):
    import numpy as np
    import torch

    import vllm_tokenswift.core.penalty as pen
    from vllm_tokenswift.patches.sampling import window_state_class

    def window_tokens(prompt_row, output, window, vocab_size):   # the old O(output) version
        out = [t for t in output if t >= 0] if output and min(output) < 0 else list(output)
        if len(out) >= window:
            return out[-window:]
        pr = prompt_row.cpu().numpy() if isinstance(prompt_row, torch.Tensor) else np.asarray(prompt_row)
        pr = pr[pr != vocab_size]
        return pr[-(window - len(out)):].tolist() + out

    pen.window_tokens = window_tokens
    window_state_class().rest_needed = lambda self, rows: True
    return True


def _decode_ms_per_token(results) -> float | None:
    """Median over ``results`` (vLLM ``RequestOutput``s of one run) of each request's decode
    time per token in milliseconds: ``(last_token_ts - first_token_ts) / (n - 1)`` from the
    engine core's ``RequestStateStats`` (monotonic seconds), ``n`` its generated tokens.
    None when a request has no such timestamps (log stats off) or fewer than 2 tokens."""
    per_req = []
    for r in results:
        m = getattr(r, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        n = len(r.outputs[0].token_ids)
        if not (first and last and last > first and n > 1):
            return None
        per_req.append(1000.0 * (last - first) / (n - 1))
    return statistics.median(per_req)


def _print_ratios(runs: list[dict], modes: list[str], key: str, label: str, out) -> None:
    """One line per mode: the median of ``key`` (ms per token) over its runs and its speed
    relative to ``ar``, paired by repeat (the runs of one round are adjacent in time)."""
    ar = [r[key] for r in runs if r["mode"] == "ar"]
    for mode in modes:
        ms = [r[key] for r in runs if r["mode"] == mode]
        line = f"{mode:<11}{label} median {statistics.median(ms):7.2f} ms/token"
        if ar:
            ratios = [a / m for a, m in zip(ar, ms)]
            line += (f"  speed vs ar: median {statistics.median(ratios):.3f}x "
                     f"(per round: {', '.join(f'{x:.3f}' for x in ratios)})")
        print(line, file=out, flush=True)


def _patch_nodraft(worker):
    from vllm_tokenswift.core.step import Drafts

    d = worker.model_runner.drafter            # the TokenSwiftProposer
    d._draft = lambda step, plan: Drafts()      # its step 4 (drafting) produces no chain
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-len", type=int, default=6000)
    ap.add_argument("--new-tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--sampling", default="paper", choices=("paper", "greedy"))
    ap.add_argument("--batch-size", type=int, default=1,
                    help="requests per run (the same prompt; each run then times engine steps of this batch)")
    ap.add_argument("--model", default="smollm2",
                    help="target: smollm2 (default), tiny (the bundled 12.6M demo model) or a folder")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of the TokenSwift modes")
    ap.add_argument("--json", default=None, help="write all runs here")
    ap.add_argument("--log", default="/tmp/step_cost_ab.log", help="vLLM's own log lines go here")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if args.batch_size < 1:
        raise SystemExit("--batch-size must be at least 1")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown modes {bad}; choose from {MODES}")

    # the two diagnostic modes send a function to the worker (collective_rpc), which vLLM
    # serialises with pickle only when allowed to
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm_tokenswift.bench.harness import book_prompts, empty_proposer, engine_output_to, teardown_engine

    with engine_output_to(args.log) as (out, _err):
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_tokenswift.cli.models import resolve_target

        model, heads = resolve_target(args.model)
        try:
            ids = book_prompts(AutoTokenizer.from_pretrained(model), 1, args.prefix_len)[0]
        except ValueError as e:
            raise SystemExit(f"{e}; pass a smaller --prefix-len") from None
        prompt = TokensPrompt(prompt_token_ids=ids)
        if args.sampling == "paper":
            sp = SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, max_tokens=args.new_tokens,
                                ignore_eos=True, extra_args={"repetition_penalty_window": 1024})
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        engines = {}
        for mode in modes:
            spec = None
            if mode not in ("ar", "ar-sync", "ar-fullpen"):
                spec = {"method": "tokenswift", "model": heads, "num_speculative_tokens": args.k,
                        "tokenswift": {"kv_budget": 1024, "log_interval_s": 0}}
            print(f"starting {mode} ...", file=out, flush=True)
            llm = LLM(model=model, dtype="float32", max_model_len=args.prefix_len + args.new_tokens + 64,
                      enforce_eager=True, enable_prefix_caching=True, kv_cache_memory_bytes=2**30, seed=0,
                      speculative_config=spec, max_num_seqs=args.batch_size, disable_log_stats=False,
                      **({"async_scheduling": False} if mode == "ar-sync" else {}))
            if mode == "ts-empty":
                llm.collective_rpc(empty_proposer)
            elif mode == "ts-nodraft":
                llm.collective_rpc(_patch_nodraft)
            elif mode == "ar-fullpen":
                llm.collective_rpc(_patch_fullpen)
            # warm-up; it also puts the prompt's KV blocks in the prefix cache, so the timed
            # runs' prefill is short and their time is decode
            llm.generate([prompt], SamplingParams(max_tokens=16), use_tqdm=False)
            engines[mode] = llm
        runs = []
        for rep in range(args.repeats):
            for mode in modes:
                t = time.perf_counter()
                results = engines[mode].generate([prompt] * args.batch_size, sp, use_tqdm=False)
                wall = time.perf_counter() - t
                res = results[0]
                n = len(res.outputs[0].token_ids)
                if any(len(r.outputs[0].token_ids) != n for r in results):
                    raise SystemExit("requests of one run generated different lengths (ignore_eos is set)")
                ttft = getattr(getattr(res, "metrics", None), "first_token_latency", None) or 0.0
                # decode time per token of one request = per engine step of a plain decoder
                ms = _decode_ms_per_token(results)
                if ms is None:   # vLLM recorded no timestamps: the earlier, batch-1 formula
                    ms = 1000 * (wall - ttft) / max(n - 1, 1)
                runs.append({"mode": mode, "repeat": rep, "tokens": n, "batch_size": args.batch_size,
                             "wall_s": wall, "ttft_s": ttft, "decode_ms_per_tok": ms,
                             "wall_ms_per_tok": 1000 * wall / n})
                unit = "ms/token" if args.batch_size == 1 else f"ms/token of each of {args.batch_size} requests"
                print(f"repeat {rep}  {mode:<11} {ms:7.2f} {unit} (ttft {ttft:.2f} s, "
                      f"wall {1000 * wall / n:.2f} ms per token)", file=out, flush=True)
        _print_ratios(runs, modes, "decode_ms_per_tok", "", out)
        _print_ratios(runs, modes, "wall_ms_per_tok", " whole run (prefill included):", out)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"model": args.model, "prefix_len": args.prefix_len, "new_tokens": args.new_tokens,
                           "batch_size": args.batch_size,
                           "sampling": args.sampling, "runs": runs}, fh, indent=1)
        for llm in engines.values():
            teardown_engine(llm)


if __name__ == "__main__":
    main()
