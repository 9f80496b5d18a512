"""``vllm-tokenswift generate`` and ``vllm-tokenswift demo``: long generation inside vLLM
with TokenSwift, optionally side by side with plain decoding (same engine settings).

Both run vLLM offline (``vllm.LLM``), show a progress bar in generated tokens, and
report tokens/s, the acceptance rate α (paper Eq. 4: accepted / ((γ+1)·steps)), the
mean accepted length per step (bonus token included), the speedup over plain decoding
and, under greedy decoding, whether the two outputs are token-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_tokenswift.assets_cli import DEMO_HEADS, DEMO_MODEL, default_prompt
from vllm_tokenswift.bench.harness import teardown_engine


def engine_kwargs(model: str, max_model_len: int, seed: int, kv_cache_gb: float | None) -> dict:
    """vLLM engine arguments that work on this CPU build and on a CUDA GPU unchanged."""
    import torch

    kw: dict[str, Any] = dict(model=model, max_model_len=max_model_len, seed=seed,
                              disable_log_stats=False, enable_prefix_caching=False)
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = 0.85
    else:
        kw.update(dtype="float32", kv_cache_memory_bytes=int((kv_cache_gb or 2.0) * 2**30))
    return kw


def _spec_counters(llm) -> dict:
    from vllm_tokenswift.bench.report import spec_counters_from_metrics

    return spec_counters_from_metrics(llm.get_metrics())


def run_one(llm, prompt_ids: list[int], params, label: str, progress: bool = True) -> dict:
    """Generate one continuation step by step (progress bar in tokens); return figures."""
    from tqdm import tqdm

    from vllm_tokenswift.bench.report import acceptance_from_counters, counter_delta

    engine = llm.llm_engine
    before = _spec_counters(llm)
    rid = f"{label}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params)
    bar = tqdm(total=params.max_tokens, unit="tok", desc=label, disable=not progress, file=sys.stderr)
    done, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            n = len(out.outputs[0].token_ids)
            bar.update(n - done)
            done = n
            if out.finished:
                final = out
    wall = time.perf_counter() - t0
    bar.close()
    toks = list(final.outputs[0].token_ids)
    acc = acceptance_from_counters(counter_delta(before, _spec_counters(llm)),
                                   getattr(llm.llm_engine.vllm_config.speculative_config,
                                           "num_speculative_tokens", None))
    return {"token_ids": toks, "text": final.outputs[0].text, "num_tokens": len(toks),
            "wall_s": wall, "tokens_per_s": len(toks) / wall if wall > 0 else None,
            "acceptance_rate": acc["acceptance_rate"],
            "mean_accepted_length": acc["mean_accepted_length"],
            "acceptance_per_pos": acc["acceptance_per_pos"]}


def sampling_params(args):
    from vllm import SamplingParams

    extra = {}
    if args.penalty_window:
        extra["repetition_penalty_window"] = args.penalty_window
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                          ignore_eos=True, extra_args=extra or None)


def run_generate(args) -> dict:
    """The whole job: optional plain-decoding run, then the TokenSwift run."""
    from transformers import AutoTokenizer

    from vllm import LLM

    from vllm_tokenswift.metrics import get_engine_stats

    if args.prompt is None and args.prompt_file is None:
        args.prompt_file = str(default_prompt())
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    tok = AutoTokenizer.from_pretrained(args.model)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    if args.max_prompt_tokens and len(prompt_ids) > args.max_prompt_tokens:
        prompt_ids = prompt_ids[-args.max_prompt_tokens:]
    max_len = len(prompt_ids) + args.max_tokens + 16
    params = sampling_params(args)
    kw = engine_kwargs(args.model, max_len, args.seed, args.kv_cache_gb)
    result: dict[str, Any] = {"model": args.model, "heads": args.heads, "prompt_tokens": len(prompt_ids),
                              "max_tokens": args.max_tokens, "sampling": {
                                  "temperature": args.temperature, "top_p": args.top_p,
                                  "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
                                  "penalty_window": args.penalty_window}}
    ar = None
    if args.compare_ar:
        llm = LLM(**kw)
        run_one(llm, prompt_ids[:32], _short(params), "warm-up", progress=False)
        ar = run_one(llm, prompt_ids, params, "plain decoding")
        teardown_engine(llm)
    ts_cfg = {"kv_budget": args.kv_budget, "sink_tokens": args.sink_tokens}
    if args.tokenswift_config:
        ts_cfg.update(json.loads(args.tokenswift_config))
    spec = {"method": "tokenswift", "model": args.heads, "num_speculative_tokens": args.num_spec_tokens,
            "tokenswift": ts_cfg}
    llm = LLM(speculative_config=spec, **kw)
    run_one(llm, prompt_ids[:32], _short(params), "warm-up", progress=False)
    ts = run_one(llm, prompt_ids, params, "TokenSwift")
    ts_stats = get_engine_stats(llm)
    teardown_engine(llm)
    result.update({k: ts[k] for k in ("text", "num_tokens", "wall_s", "tokens_per_s", "acceptance_rate",
                                      "mean_accepted_length", "acceptance_per_pos")})
    result["tokenswift_stats"] = ts_stats
    result["speculative_config"] = spec
    if ar is not None:
        result.update(ar_tokens_per_s=ar["tokens_per_s"], ar_wall_s=ar["wall_s"],
                      speedup=(ts["tokens_per_s"] / ar["tokens_per_s"]) if ar["tokens_per_s"] else None)
        result["identical"] = (ar["token_ids"] == ts["token_ids"]) if args.temperature == 0 else None
        if args.temperature == 0 and not result["identical"]:
            first = next((i for i, (a, b) in enumerate(zip(ar["token_ids"], ts["token_ids"])) if a != b),
                         min(len(ar["token_ids"]), len(ts["token_ids"])))
            result["first_difference_at"] = first
    return result


def _short(params):
    p = params.clone()
    p.max_tokens = 8
    return p


def print_report(res: dict, lines: int = 0) -> None:
    def f(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    print()
    print(f"prompt tokens: {res['prompt_tokens']}   generated: {res['num_tokens']} tokens")
    if "ar_tokens_per_s" in res:
        print(f"{'':22}{'plain decoding':>16}{'TokenSwift':>14}")
        print(f"{'tokens/s':22}{f(res['ar_tokens_per_s']):>16}{f(res['tokens_per_s']):>14}")
        print(f"{'wall time (s)':22}{f(res['ar_wall_s'], '{:.1f}'):>16}{f(res['wall_s'], '{:.1f}'):>14}")
        print(f"speedup: {f(res['speedup'])}x")
    else:
        print(f"tokens/s: {f(res['tokens_per_s'])}")
    print(f"acceptance rate (Eq. 4): {f(res['acceptance_rate'], '{:.3f}')}   "
          f"mean accepted length: {f(res['mean_accepted_length'])} tokens/step")
    st = res.get("tokenswift_stats") or {}
    if st:
        print(f"n-gram acceptance beta (Eq. 6): {f(st.get('ngram_acceptance'), '{:.3f}')}   "
              f"view re-selections: {st.get('view_selections')}   "
              f"draft time share: {f(st.get('draft_time_share'), '{:.2f}')}")
    if "identical" in res:
        ident = res["identical"]
        print("identical: " + ("n/a (sampling)" if ident is None else ("yes" if ident else
              f"no (first difference at token {res.get('first_difference_at')})")))
    if lines:
        print("\n--- continuation (first lines) ---")
        for line in [ln for ln in res["text"].splitlines() if ln.strip()][:lines]:
            print(line)
        print("---")


def _add_common(p: argparse.ArgumentParser, demo: bool) -> None:
    p.add_argument("--model", default=str(DEMO_MODEL), help="target model folder or id (default: bundled demo model)")
    p.add_argument("--heads", default=str(DEMO_HEADS), help="draft heads folder (default: bundled demo heads)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--penalty-window", type=int, default=0, help="repetition penalty window W in tokens (0: whole context)")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument("--kv-budget", type=int, default=2048, help="TokenSwift draft KV budget (tokens)")
    p.add_argument("--sink-tokens", type=int, default=16)
    p.add_argument("--num-spec-tokens", type=int, default=4, help="longest draft chain per step")
    p.add_argument("--tokenswift-config", default=None, help="extra TokenSwift settings as JSON")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="keep only the last N prompt tokens (0: all)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="CPU only: KV cache size (default 2)")
    p.add_argument("--json", default=None, help="write all figures and the text to this JSON file")
    p.add_argument("--no-progress", action="store_true")


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate with TokenSwift in vLLM (optionally vs plain decoding)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text")
    src.add_argument("--prompt-file", default=None, help="file with the prompt text (default: a bundled prompt)")
    g.add_argument("--compare-ar", action="store_true", help="also run plain decoding and compare")
    _add_common(g, demo=False)
    g.set_defaults(func=_cmd_generate)
    d = sub.add_parser("demo", help="bundled model + heads + book prompt: plain decoding vs TokenSwift, 4,096 tokens")
    d.add_argument("--lines", type=int, default=8, help="continuation lines to print")
    d.add_argument("--prompt-file", default=None)
    _add_common(d, demo=True)
    d.set_defaults(func=_cmd_demo)


def _check(args) -> None:
    for name in ("model", "heads"):
        path = getattr(args, name)
        if os.path.sep in path and not Path(path).exists():
            raise SystemExit(f"error: --{name} {path} does not exist")
    if args.max_tokens < 1:
        raise SystemExit("error: --max-tokens must be >= 1")


def _cmd_generate(args) -> int:
    _check(args)
    res = run_generate(args)
    print_report(res, lines=0)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0 if res.get("identical", True) in (True, None) else 1


def _cmd_demo(args) -> int:
    _check(args)
    args.prompt = None
    args.compare_ar = True
    args.max_tokens = max(args.max_tokens, 4096)
    res = run_generate(args)
    print_report(res, lines=args.lines)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res.get("identical", True) in (True, None) else 1
