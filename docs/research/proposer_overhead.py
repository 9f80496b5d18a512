"""The proposer's own milliseconds per engine step (chain selection, n-grams, views,
penalties, draft-probability buffers), excluding the target's draft forward, at several
batch sizes. Runs vLLM in-process so the proposer object can be timed directly.

    python docs/research/proposer_overhead.py --batch-sizes 1,8,32 --json out.json \\
        [--tokenswift '{"policy": "paper"}']

Run it from another checkout (``PYTHONPATH=/path/to/old/checkout``) to compare versions;
``--tokenswift`` passes settings through (an older version needs its own keys, e.g.
``{"skip_draft_conf": 1.01}`` for "always draft"). ``--model smollm2 --k 8`` times it on
SmolLM2-135M with its trained heads at the benchmark's k; ``--profile N`` adds cProfile's
N costliest functions.

    python docs/research/proposer_overhead.py --plot out.png before.json after.json ...

draws the ``own_ms_per_step`` of several saved runs side by side (one bar group per
sampling and batch size; labels from the file names) without starting vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target: smollm2, tiny (the bundled 12.6M demo model, default) or a folder")
    ap.add_argument("--heads", default=None)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--sampling", default="greedy,paper")
    ap.add_argument("--tokenswift", default="{}")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile the proposer (cProfile) and print its N costliest functions "
                         "per run, by own time (profiling slows the proposer: the ms figures of a "
                         "profiled run are not comparable with an unprofiled one)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="plot the saved runs given as arguments instead of measuring")
    ap.add_argument("runs", nargs="*", help="with --plot: JSON files written by --json")
    args = ap.parse_args()
    if args.plot:
        plot(args.runs, args.plot)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm_tokenswift
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_tokenswift.cli.models import resolve_target

    assets = os.path.join(os.path.dirname(vllm_tokenswift.__file__), "assets")
    model, heads = resolve_target(args.model or "tiny", args.heads)   # "smollm2", "tiny" or a folder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = open(os.path.join(assets, "prompts", "1342.txt")).read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    bss = [int(x) for x in args.batch_sizes.split(",")]
    ts = {"kv_budget": 1024, **json.loads(args.tokenswift)}
    llm = LLM(model=model, dtype="float32", max_model_len=args.prefix_len + args.new_tokens + 64,
              enforce_eager=True, kv_cache_memory_bytes=4 * 2**30, enable_prefix_caching=False,
              speculative_config={"method": "tokenswift", "model": heads, "num_speculative_tokens": args.k,
                                  "tokenswift": ts})
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    prop = runner.drafter
    calls = {"n": 0, "t": 0.0}
    # the runner patch looks ``propose_step`` up on the proposer every step, so an instance
    # attribute wraps it (older checkouts: ``propose_with_runner``)
    entry = "propose_step" if hasattr(prop, "propose_step") else "propose_with_runner"
    orig = getattr(prop, entry)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            calls["t"] += time.perf_counter() - t
            calls["n"] += 1

    setattr(prop, entry, timed)
    prof = None
    if args.profile:
        import cProfile

        def profiled(*a, _inner=timed, **k):
            return _inner(*a, **k) if prof is None else prof.runcall(_inner, *a, **k)

        setattr(prop, entry, profiled)
    results = []
    for samp in args.sampling.split(","):
        if samp == "greedy":
            sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        else:
            sp = SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, max_tokens=args.new_tokens,
                                ignore_eos=True, extra_args={"repetition_penalty_window": 1024})
        for bs in bss:
            # each request starts 97 tokens further into the book (wrapping around), so no two
            # prompts are the same and none is short
            reps = -(-(bs * 97 + args.prefix_len) // len(ids))
            book = ids * reps
            prompts = [TokensPrompt(prompt_token_ids=book[i * 97: i * 97 + args.prefix_len]) for i in range(bs)]
            prof = None                      # the warm-up is neither timed nor profiled
            llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            prop.stats.reset() if hasattr(prop.stats, "reset") else prop.stats.__init__()
            calls.update(n=0, t=0.0)
            if args.profile:
                prof = cProfile.Profile()
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            st = prop.stats
            fused = getattr(st, "time_fused_s", 0.0)
            own = calls["t"] - st.time_draft_forward_s - fused
            row = {"sampling": samp, "batch": bs, "steps": calls["n"], "wall_s": wall,
                   "proposer_ms_per_step": 1000 * calls["t"] / max(calls["n"], 1),
                   "draft_forward_ms_per_step": 1000 * st.time_draft_forward_s / max(calls["n"], 1),
                   "own_ms_per_step": 1000 * own / max(calls["n"], 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.profile:
                print_profile(prof, calls["n"], args.profile)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tokenswift": ts, "k": args.k, "results": results}, fh, indent=1)


def print_profile(prof, steps: int, top: int) -> None:
    """The ``top`` functions with the most own time (``tottime``) in the proposer, as
    microseconds per engine step and share of the profiled proposer time."""
    import pstats

    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values()) or 1.0
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    print(f"  {'us/step':>8} {'share':>6} {'calls/step':>10}  function")
    for (path, line, name), (_cc, nc, tt, _ct, _callers) in rows:
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        print(f"  {1e6 * tt / max(steps, 1):8.1f} {100 * tt / total:5.1f}% {nc / max(steps, 1):10.1f}  {where}")


def plot(paths: list[str], out: str) -> None:
    """Grouped bars: the proposer's own ms per engine step, per (sampling, batch), one bar per
    saved run (``--json`` output). Raises ValueError without runs."""
    if not paths:
        raise ValueError("--plot needs at least one JSON file written by --json")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for p in paths:
        with open(p) as fh:
            res = json.load(fh)["results"]
        runs.append((os.path.splitext(os.path.basename(p))[0],
                     {(r["sampling"], r["batch"]): r["own_ms_per_step"] for r in res}))
    keys = sorted({k for _, d in runs for k in d}, key=lambda k: (k[0], k[1]))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(keys), 3.6))
    for i, (label, d) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
        vals = [d.get(k, float("nan")) for k in keys]
        bars = ax.bar(xs, vals, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(keys)), [f"{s}\nbatch {b}" for s, b in keys])
    ax.set_ylabel("proposer's own ms per engine step")
    ax.set_title("TokenSwift proposer overhead (draft forward excluded)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
