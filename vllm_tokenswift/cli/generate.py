"""``vllm-tokenswift generate`` and ``vllm-tokenswift demo``: long generation inside vLLM
with TokenSwift, optionally side by side with plain decoding (same engine settings).

Both run vLLM offline (``vllm.LLM``) on SmolLM2-135M-Instruct and its heads by default
(``--model tiny``: the bundled 12.6M demo model), show a progress bar in generated
tokens, and report tokens/s, the acceptance rate α (paper Eq. 4: accepted /
((γ+1)·steps)), the mean accepted length per step (bonus token included), the speedup
over plain decoding and, under greedy decoding, whether the outputs are token-identical.

vLLM's own log lines (start-up, warnings, metrics) go to a log file, whose path is
printed; ``--verbose`` shows them instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from vllm_tokenswift.cli.assets import default_prompt
from vllm_tokenswift.cli.engine_helpers import engine_output_to, teardown_engine

#: TokenSwift settings of the demo and ``generate`` for SmolLM2 on CPU (KV blocks of 128
#: tokens on vLLM's CPU backend, so a 1,024-token budget is 8 blocks).
DEFAULT_K = 8
DEFAULT_KV_BUDGET = 1024

#: The paper's sampling (Sec 4.1): temperature 1.0, min-p 0.1, repetition penalty 1.2 over
#: the last 1,024 tokens (Eq. 3).
PAPER_SAMPLING = {"temperature": 1.0, "min_p": 0.1, "repetition_penalty": 1.2,
                  "extra_args": {"repetition_penalty_window": 1024}}


def default_log_path(command: str) -> Path:
    """``<cache root>/logs/<command>-<timestamp>.log`` (see
    :func:`vllm_tokenswift.cli.models.cache_root`), or the same name under the system's
    temporary folder when the cache is not writable (e.g. a read-only cache in a container)."""
    import tempfile

    from vllm_tokenswift.cli.models import cache_root

    name = f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    logs = cache_root() / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        if os.access(logs, os.W_OK):
            return logs / name
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "vllm-tokenswift-logs" / name


def engine_kwargs(model: str, max_model_len: int, seed: int, kv_cache_gb: float | None,
                  hf_overrides: dict | None = None) -> dict:
    """vLLM engine arguments that work on this CPU build and on a CUDA GPU unchanged.

    Args:
        model: model folder or id.
        max_model_len: tokens per sequence (prompt + generation).
        seed: engine seed.
        kv_cache_gb: CPU only, KV cache size in GiB (default 2).
        hf_overrides: model config overrides (YaRN, :func:`vllm_tokenswift.cli.models.yarn_overrides`).
    """
    import torch

    kw: dict[str, Any] = dict(model=model, max_model_len=max_model_len, seed=seed,
                              disable_log_stats=False, enable_prefix_caching=False)
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = 0.85
    else:
        kw.update(dtype="float32", enforce_eager=True,
                  kv_cache_memory_bytes=int((kv_cache_gb or 2.0) * 2**30))
    if hf_overrides:
        kw["hf_overrides"] = hf_overrides
    return kw


def _spec_counters(llm) -> dict:
    from vllm_tokenswift.core.figures import spec_counters_from_metrics

    return spec_counters_from_metrics(llm.get_metrics())


def run_one(llm, prompt_ids: list[int], params, label: str, progress: bool = True,
            bar_file: TextIO | None = None) -> dict:
    """Generate one continuation step by step (progress bar in tokens) and measure it.

    Args:
        llm: a ``vllm.LLM``.
        prompt_ids: prompt token ids.
        params: ``SamplingParams`` (``max_tokens`` sets the bar's length).
        label: progress-bar label.
        progress: show the bar.
        bar_file: stream of the bar (default stderr).

    Returns:
        ``token_ids``, ``text``, ``num_tokens``, ``wall_s`` (seconds), ``tokens_per_s``,
        ``ttft_s`` (time to the first token: the prefill), ``decode_tokens_per_s`` (the
        tokens after the first over the time after it),
        ``acceptance_rate`` (α, Eq. 4), ``mean_accepted_length`` (tokens per step,
        bonus included), ``acceptance_per_pos``, and for TokenSwift engines the plugin's
        ``ngram_acceptance`` (β), ``steps_by_kind`` and ``accepted_by_kind`` of this run
        (None elsewhere).
    """
    from tqdm import tqdm

    from vllm_tokenswift.cli.engine_helpers import plugin_stats_after, plugin_stats_before
    from vllm_tokenswift.core.figures import acceptance_from_counters, counter_delta
    from vllm_tokenswift.plugin import is_tokenswift_spec

    engine = llm.llm_engine
    spec = engine.vllm_config.speculative_config
    k = getattr(spec, "num_speculative_tokens", None)
    is_ts = is_tokenswift_spec(spec)
    before = _spec_counters(llm)
    was_reset, pbefore = plugin_stats_before(llm) if is_ts else (False, None)
    rid = f"{label}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params)
    bar = tqdm(total=params.max_tokens, unit="tok", desc=label, disable=not progress,
               file=bar_file or sys.stderr, dynamic_ncols=True)
    done, final, t_first = 0, None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            n = len(out.outputs[0].token_ids)
            if n and t_first is None:
                t_first = time.perf_counter()
            bar.update(n - done)
            done = n
            if out.finished:
                final = out
    wall = time.perf_counter() - t0
    bar.close()
    toks = list(final.outputs[0].token_ids)
    acc = acceptance_from_counters(counter_delta(before, _spec_counters(llm)), k)
    decode_s = (t0 + wall - t_first) if t_first is not None else None
    res = {"token_ids": toks, "text": final.outputs[0].text, "num_tokens": len(toks),
           "wall_s": wall, "tokens_per_s": len(toks) / wall if wall > 0 else None,
           "ttft_s": (t_first - t0) if t_first is not None else None,
           "decode_tokens_per_s": (len(toks) - 1) / decode_s if decode_s and len(toks) > 1 else None,
           "acceptance_rate": acc["acceptance_rate"],
           "mean_accepted_length": acc["mean_accepted_length"],
           "acceptance_per_pos": acc["acceptance_per_pos"],
           "ngram_acceptance": None, "steps_by_kind": None, "accepted_by_kind": None}
    if is_ts:
        ps = plugin_stats_after(llm, was_reset, pbefore, k or 0)
        st = ps.get("plugin_stats") or {}
        res.update(ngram_acceptance=ps.get("ngram_acceptance"), steps_by_kind=st.get("steps_by_kind"),
                   accepted_by_kind=st.get("accepted_by_kind"), view_selections=st.get("view_selections"),
                   draft_time_share=ps.get("draft_time_share"))
    return res


def sampling_params(args):
    """``SamplingParams`` of ``generate`` from its arguments (``ignore_eos``: exactly
    ``--max-tokens`` tokens)."""
    from vllm import SamplingParams

    extra = {}
    if args.penalty_window:
        extra["repetition_penalty_window"] = args.penalty_window
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                          ignore_eos=True, extra_args=extra or None)


def book_prefix(text: str, tokenizer, max_tokens: int) -> tuple[list[int], str]:
    """The longest run of whole paragraphs (split at blank lines) from the start of
    ``text`` that fits in ``max_tokens`` tokens, ending with a paragraph break, so the
    continuation starts a new paragraph. Falls back to the first ``max_tokens`` tokens
    when even the first paragraph is longer.

    Returns:
        ``(token ids, prefix text)``.
    """
    paras = text.split("\n\n")
    best = ""
    for i in range(1, len(paras) + 1):
        cand = "\n\n".join(paras[:i]).rstrip() + "\n\n"
        if len(tokenizer(cand, add_special_tokens=False)["input_ids"]) > max_tokens:
            break
        best = cand
    if not best:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        return ids, tokenizer.decode(ids)
    return tokenizer(best, add_special_tokens=False)["input_ids"], best


def _resolve(args, out: TextIO, err: TextIO) -> None:
    """Fill ``args.model``/``args.heads`` with folders (fetching SmolLM2 if needed) and
    check them, the heads unless ``use_heads`` is off. Raises ``SystemExit`` on errors."""
    from vllm_tokenswift.cli.models import ModelFetchError, resolve_target

    try:
        args.model, args.heads = resolve_target(args.model, args.heads,
                                                log=lambda s: print(s, file=err, flush=True))
    except ModelFetchError as e:
        raise SystemExit(f"error: {e}") from None
    if os.path.sep in args.model and not Path(args.model).exists():
        raise SystemExit(f"error: --model {args.model} does not exist")
    try:
        ts_cfg = json.loads(args.tokenswift_config) if args.tokenswift_config else {}
    except ValueError as e:
        raise SystemExit(f"error: --tokenswift-config is not valid JSON: {e}") from None
    if not isinstance(ts_cfg, dict):
        raise SystemExit("error: --tokenswift-config must be a JSON object")
    args.ts_cfg = ts_cfg
    if ts_cfg.get("use_heads", True):
        if args.heads is None:
            raise SystemExit(f"error: no heads are bundled for {args.model}: pass --heads FOLDER "
                             "(or --tokenswift-config '{\"use_heads\": false}')")
        if not (Path(args.heads) / "tokenswift_heads.json").is_file() and not (
                Path(args.heads) / "config.json").is_file():
            raise SystemExit(f"error: heads folder {args.heads} does not exist or holds no heads "
                             "(tokenswift_heads.json); pass --heads FOLDER, or "
                             "--tokenswift-config '{\"use_heads\": false}' to draft without heads")
    if args.max_tokens < 1:
        raise SystemExit("error: --max-tokens must be >= 1")


def _window(args, needed: int) -> tuple[int, dict | None]:
    """``(max_model_len, hf_overrides)`` for ``needed`` tokens, with ``--yarn`` applied.

    ``max_model_len`` is at least the TokenSwift draft KV budget (the plugin refuses a
    budget above it; a larger limit costs no memory: the KV cache size is set separately),
    within the model's window. Raises ``SystemExit`` when the window is too small."""
    from vllm_tokenswift.cli.models import model_window, yarn_overrides

    overrides = None
    if args.yarn:
        try:
            overrides = yarn_overrides(args.model, args.yarn)
        except ValueError as e:
            raise SystemExit(f"error: --yarn: {e}") from None
    window = model_window(args.model, args.yarn)
    if window is not None and needed > window:
        base = model_window(args.model)
        raise SystemExit(
            f"error: prompt + --max-tokens = {needed} tokens exceed the model's window of {window} "
            f"tokens{f' (with --yarn {args.yarn:g})' if args.yarn else ''}; generate fewer tokens or "
            f"extend the window with --yarn FACTOR (here at least --yarn {-(-needed // base)})")
    ts_cfg = getattr(args, "ts_cfg", None) or {}
    budget = int(ts_cfg.get("kv_budget", args.kv_budget))
    mml = needed
    if ts_cfg.get("draft_kv", "dynamic") != "full" and budget > needed:
        if window is not None and budget > window:
            raise SystemExit(f"error: the draft KV budget ({budget} tokens) exceeds the model's window "
                             f"({window} tokens); use a smaller --kv-budget")
        mml = budget
    return mml, overrides


def _spec(args) -> dict:
    ts_cfg = {"kv_budget": args.kv_budget, "sink_tokens": args.sink_tokens, **args.ts_cfg}
    spec = {"method": "tokenswift", "num_speculative_tokens": args.num_spec_tokens, "tokenswift": ts_cfg}
    if args.heads:
        spec["model"] = args.heads
    return spec


def _start(label: str, out: TextIO, **kw):
    from vllm import LLM

    t0 = time.perf_counter()
    print(f"starting the {label} engine ...", file=out, flush=True)
    llm = LLM(**kw)
    print(f"  ready in {time.perf_counter() - t0:.0f} s", file=out, flush=True)
    return llm


def _warm(llm, prompt_ids: list[int], params) -> None:
    p = params.clone()
    p.max_tokens = 8
    run_one(llm, prompt_ids[:32], p, "warm-up", progress=False)


def run_generate(args, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> dict:
    """The whole ``generate`` job: optional plain-decoding run, then the TokenSwift run.

    ``args.model``/``args.heads`` must already be resolved (:func:`_resolve`). Returns the
    figures (see :func:`print_report`)."""
    from transformers import AutoTokenizer

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    if args.prompt is None and args.prompt_file is None:
        args.prompt_file = str(default_prompt())
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    tok = AutoTokenizer.from_pretrained(args.model)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    if args.max_prompt_tokens and len(prompt_ids) > args.max_prompt_tokens:
        prompt_ids = prompt_ids[-args.max_prompt_tokens:]
    max_len, overrides = _window(args, len(prompt_ids) + args.max_tokens + 16)
    params = sampling_params(args)
    kw = engine_kwargs(args.model, max_len, args.seed, args.kv_cache_gb, overrides)
    result: dict[str, Any] = {"model": args.model, "heads": args.heads, "yarn": args.yarn,
                              "prompt_tokens": len(prompt_ids),
                              "max_tokens": args.max_tokens, "sampling": {
                                  "temperature": args.temperature, "top_p": args.top_p,
                                  "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
                                  "penalty_window": args.penalty_window}}
    ar = None
    if args.compare_ar:
        llm = _start("plain-decoding", out, **kw)
        try:
            _warm(llm, prompt_ids, params)
            ar = run_one(llm, prompt_ids, params, "plain decoding", not args.no_progress, err)
        finally:
            teardown_engine(llm)
    spec = _spec(args)
    llm = _start("TokenSwift", out, speculative_config=spec, **kw)
    try:
        _warm(llm, prompt_ids, params)
        ts = run_one(llm, prompt_ids, params, "TokenSwift", not args.no_progress, err)
        ts_stats = get_engine_stats(llm)
    finally:
        teardown_engine(llm)
    result.update({k: ts.get(k) for k in ("text", "num_tokens", "wall_s", "tokens_per_s", "ttft_s",
                                          "decode_tokens_per_s", "acceptance_rate",
                                          "mean_accepted_length", "acceptance_per_pos", "steps_by_kind",
                                          "accepted_by_kind", "ngram_acceptance", "view_selections",
                                          "draft_time_share")})
    result["tokenswift_stats"] = ts_stats
    result["speculative_config"] = spec
    if ar is not None:
        result.update(ar_tokens_per_s=ar["tokens_per_s"], ar_wall_s=ar["wall_s"],
                      ar_decode_tokens_per_s=ar["decode_tokens_per_s"],
                      speedup=(ts["tokens_per_s"] / ar["tokens_per_s"]) if ar["tokens_per_s"] else None,
                      decode_speedup=(ts["decode_tokens_per_s"] / ar["decode_tokens_per_s"])
                      if ts["decode_tokens_per_s"] and ar["decode_tokens_per_s"] else None)
        result["identical"] = (ar["token_ids"] == ts["token_ids"]) if args.temperature == 0 else None
        if args.temperature == 0 and not result["identical"]:
            result["first_difference_at"] = _first_difference(ar["token_ids"], ts["token_ids"])
    return result


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _f(x, fmt="{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def decision_mix(steps_by_kind: dict | None) -> str | None:
    """``"forward 61% · fused 27% · ngram 12%"`` from a ``steps_by_kind`` dict (kinds
    with no steps left out), or None without steps."""
    from vllm_tokenswift.core.figures import decision_mix_fractions

    frac = decision_mix_fractions(steps_by_kind)
    if not frac:
        return None
    return " · ".join(f"{k} {100 * v:.0f}%" for k, v in frac.items() if v > 0)


def print_report(res: dict, out: TextIO = sys.stdout) -> None:
    """Print the ``generate`` figures (plain decoding next to TokenSwift when compared)."""
    print(file=out)
    print(f"prompt tokens: {res['prompt_tokens']}   generated: {res['num_tokens']} tokens", file=out)
    if "ar_tokens_per_s" in res:
        print(f"{'':22}{'plain decoding':>16}{'TokenSwift':>14}", file=out)
        print(f"{'tokens/s':22}{_f(res['ar_tokens_per_s']):>16}{_f(res['tokens_per_s']):>14}", file=out)
        print(f"{'wall time (s)':22}{_f(res['ar_wall_s'], '{:.1f}'):>16}{_f(res['wall_s'], '{:.1f}'):>14}",
              file=out)
        print(f"{'decode tokens/s':22}{_f(res.get('ar_decode_tokens_per_s')):>16}"
              f"{_f(res.get('decode_tokens_per_s')):>14}", file=out)
        print(f"speedup: {_f(res['speedup'])}x (whole run, prefill included)   decode-phase speedup: "
              f"{_f(res.get('decode_speedup'))}x", file=out)
    else:
        print(f"tokens/s: {_f(res['tokens_per_s'])}", file=out)
    print(f"acceptance rate (Eq. 4): {_f(res['acceptance_rate'], '{:.3f}')}   "
          f"mean accepted length: {_f(res['mean_accepted_length'])} tokens/step", file=out)
    if res.get("tokenswift_stats"):  # this run's figures (the engine's totals include the warm-up)
        print(f"n-gram acceptance beta (Eq. 6): {_f(res.get('ngram_acceptance'), '{:.3f}')}   "
              f"view re-selections: {res.get('view_selections')}   "
              f"draft time share: {_f(res.get('draft_time_share'), '{:.2f}')}", file=out)
    mix = decision_mix(res.get("steps_by_kind"))
    if mix:
        print(f"drafting decisions: {mix}", file=out)
    if "identical" in res:
        ident = res["identical"]
        print("identical: " + ("n/a (sampling)" if ident is None else ("yes" if ident else
              f"no (first difference at token {res.get('first_difference_at')})")), file=out)


# ---------------------------------------------------------------- demo
def run_demo(args, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> dict:
    """The demo: a book prefix, plain decoding vs TokenSwift under greedy decoding and
    under the paper's sampling; one engine per method, reused for both samplings.

    Returns ``{"prompt_tokens", "prompt_file", "max_tokens", "runs": {(method, sampling):
    run_one() result}, "identical", ...}`` (see :func:`print_demo`)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    prompt_file = args.prompt_file or str(default_prompt())
    tok = AutoTokenizer.from_pretrained(args.model)
    prompt_ids, prefix_text = book_prefix(Path(prompt_file).read_text(), tok, args.prefix_tokens)
    max_len, overrides = _window(args, len(prompt_ids) + args.max_tokens + 16)
    kw = engine_kwargs(args.model, max_len, args.seed, args.kv_cache_gb, overrides)
    samplings = {"greedy": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                 "sampling": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **PAPER_SAMPLING)}
    spec = _spec(args)
    res: dict[str, Any] = {"model": args.model, "heads": args.heads, "prompt_file": prompt_file,
                           "prompt_tokens": len(prompt_ids), "prefix_text": prefix_text,
                           "max_tokens": args.max_tokens, "speculative_config": spec,
                           "paper_sampling": PAPER_SAMPLING, "runs": {}}
    for method, label in (("plain", "plain-decoding"), ("tokenswift", "TokenSwift")):
        llm = _start(label, out, **kw, **({"speculative_config": spec} if method == "tokenswift" else {}))
        try:
            _warm(llm, prompt_ids, samplings["greedy"])
            for s, params in samplings.items():
                desc = f"{'plain' if method == 'plain' else 'TokenSwift'} · {s}"
                res["runs"][(method, s)] = run_one(llm, prompt_ids, params, desc, not args.no_progress, err)
        finally:
            teardown_engine(llm)
    a, b = res["runs"][("plain", "greedy")]["token_ids"], res["runs"][("tokenswift", "greedy")]["token_ids"]
    res["identical"] = a == b
    if not res["identical"]:
        res["first_difference_at"] = _first_difference(a, b)
    return res


def _wrapped_lines(text: str, width: int = 100) -> list[str]:
    lines: list[str] = []
    for ln in text.splitlines():
        if ln.strip():
            lines.extend(textwrap.wrap(ln.strip(), width) or [""])
    return lines


def print_demo(res: dict, out: TextIO = sys.stdout, lines: int = 8) -> None:
    """Print the demo's table (tokens/s, wall time, speedup, α, mean accepted length,
    drafting decisions, identity) and the first ``lines`` lines of the greedy and the
    sampled TokenSwift continuations."""
    runs = res["runs"]
    name = Path(res["model"]).name
    print(file=out)
    print(f"{name} + TokenSwift (k={res['speculative_config']['num_speculative_tokens']}, "
          f"kv_budget {res['speculative_config']['tokenswift'].get('kv_budget')}); prompt: "
          f"{res['prompt_tokens']} tokens from {Path(res['prompt_file']).name}; "
          f"{res['max_tokens']} new tokens per run", file=out)
    w = 13
    print(f"{'':24}{'greedy':^{2 * w}}  {'sampling (paper)':^{2 * w}}", file=out)
    print(f"{'':24}{'plain':>{w}}{'TokenSwift':>{w}}  {'plain':>{w}}{'TokenSwift':>{w}}", file=out)

    def row(label, fn, fmt):
        cells = []
        for s in ("greedy", "sampling"):
            cells.append("".join(f"{_f(fn(runs[(m, s)], m), fmt):>{w}}" for m in ("plain", "tokenswift")))
        print(f"{label:24}{cells[0]}  {cells[1]}", file=out)

    row("tokens/s", lambda r, m: r["tokens_per_s"], "{:.1f}")
    row("wall time (s)", lambda r, m: r["wall_s"], "{:.1f}")
    sp = {s: runs[("tokenswift", s)]["tokens_per_s"] / runs[("plain", s)]["tokens_per_s"]
          for s in ("greedy", "sampling")}
    res["speedup"] = sp
    print(f"{'speedup':24}{'':>{w}}{_f(sp['greedy'], '{:.2f}x'):>{w}}  {'':>{w}}"
          f"{_f(sp['sampling'], '{:.2f}x'):>{w}}", file=out)
    row("acceptance rate α", lambda r, m: r["acceptance_rate"] if m == "tokenswift" else None, "{:.3f}")
    row("mean accepted length", lambda r, m: r["mean_accepted_length"] if m == "tokenswift" else None,
        "{:.2f}")
    ident = "yes" if res["identical"] else f"NO (first difference at token {res.get('first_difference_at')})"
    print(f"{'identical to plain':24}{'':>{w}}{ident:>{w}}  {'':>{w}}{'n/a (sampled)':>{w}}", file=out)
    for s in ("greedy", "sampling"):
        mix = decision_mix(runs[("tokenswift", s)].get("steps_by_kind"))
        if mix:
            print(f"drafting decisions, {s}: {mix}", file=out)
    print("sampling (paper): temperature 1.0, min_p 0.1, repetition penalty 1.2 over the last 1,024 tokens; "
          "α = accepted / (k × steps); mean accepted length = tokens per target forward", file=out)
    if lines:
        for s, title in (("greedy", "greedy continuation (plain decoding and TokenSwift)"),
                         ("sampling", "sampled continuation (TokenSwift)")):
            print(f"\n--- {title}, first lines ---", file=out)
            for ln in _wrapped_lines(runs[("tokenswift", s)]["text"])[:lines]:
                print(ln, file=out)
        print("---", file=out)


def _demo_json(res: dict) -> dict:
    d = {k: v for k, v in res.items() if k != "runs"}
    d["runs"] = {f"{m}/{s}": {k: v for k, v in r.items() if k != "token_ids"}
                 for (m, s), r in res["runs"].items()}
    return d


# ---------------------------------------------------------------- command line
def _add_common(p: argparse.ArgumentParser) -> None:
    from vllm_tokenswift.cli.models import add_target_args

    add_target_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--penalty-window", type=int, default=0,
                   help="repetition penalty window W in tokens (0: whole context)")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument("--kv-budget", type=int, default=DEFAULT_KV_BUDGET,
                   help=f"TokenSwift draft KV budget in tokens (default {DEFAULT_KV_BUDGET})")
    p.add_argument("--sink-tokens", type=int, default=16)
    p.add_argument("--num-spec-tokens", type=int, default=DEFAULT_K,
                   help=f"longest draft chain per step (default {DEFAULT_K})")
    p.add_argument("--tokenswift-config", default=None, help="extra TokenSwift settings as JSON")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="CPU only: KV cache size (default 2)")
    p.add_argument("--json", default=None, help="write all figures and the text to this JSON file")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show vLLM's log lines instead of writing them to a file")
    p.add_argument("--log-file", default=None,
                   help="where vLLM's log lines go (default: ~/.cache/vllm-tokenswift/logs/COMMAND-TIME.log)")


def add_parser(sub) -> None:
    """Register ``generate`` and ``demo`` on an argparse ``subparsers`` object."""
    g = sub.add_parser("generate", help="generate with TokenSwift in vLLM (optionally vs plain decoding)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text")
    src.add_argument("--prompt-file", default=None, help="file with the prompt text (default: a bundled prompt)")
    g.add_argument("--compare-ar", action="store_true", help="also run plain decoding and compare")
    g.add_argument("--max-tokens", type=int, default=4096, help="tokens to generate (default 4096)")
    g.add_argument("--max-prompt-tokens", type=int, default=0, help="keep only the last N prompt tokens (0: all)")
    _add_common(g)
    g.set_defaults(func=_cmd_generate)
    d = sub.add_parser("demo", help="SmolLM2 + heads + a book opening: plain decoding vs TokenSwift, "
                                    "greedy and the paper's sampling")
    d.add_argument("--prompt-file", default=None, help="book text (default: a bundled prompt)")
    d.add_argument("--prefix-tokens", type=int, default=1024,
                   help="prompt length: whole paragraphs from the start of the book up to this many tokens "
                        "(default 1024)")
    d.add_argument("--max-tokens", type=int, default=1024, help="tokens per run (default 1024)")
    d.add_argument("--lines", type=int, default=8, help="continuation lines to print per sampling")
    _add_common(d)
    d.set_defaults(func=_cmd_demo)


def _run_quiet(args, command: str, job) -> int:
    """Run ``job(out, err) -> rc`` with vLLM's output in a log file (unless --verbose)."""
    import gc

    log = None if args.verbose else Path(args.log_file or default_log_path(command))
    with engine_output_to(log) as (out, err):
        if log is not None:
            print(f"vLLM log: {log}", file=out, flush=True)
        rc, msg = 1, None
        try:
            rc = job(out, err)
        except SystemExit as e:
            if not isinstance(e.code, str):
                raise
            rc, msg = 2, e.code
        except KeyboardInterrupt:
            rc, msg = 130, "interrupted"
        except Exception as e:
            traceback.print_exc()  # into the log
            rc, msg = 1, f"error: {type(e).__name__}: {e}" + (f"\n(full log: {log})" if log else "")
        # the exception's frames are gone now: engines they held shut down here, while
        # their log lines still go to the file
        gc.collect()
        if msg:
            print(msg, file=err)
        return rc


def _cmd_generate(args) -> int:
    def job(out, err):
        _resolve(args, out, err)
        res = run_generate(args, out, err)
        print_report(res, out)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
            print(f"figures written to {args.json}", file=out)
        return 0 if res.get("identical", True) in (True, None) else 1

    return _run_quiet(args, "generate", job)


def _cmd_demo(args) -> int:
    def job(out, err):
        _resolve(args, out, err)
        t0 = time.perf_counter()
        res = run_demo(args, out, err)
        print_demo(res, out, lines=args.lines)
        res["wall_s"] = time.perf_counter() - t0
        print(f"\ndemo wall time: {res['wall_s'] / 60:.1f} min", file=out)
        if args.json:
            Path(args.json).write_text(json.dumps(_demo_json(res), indent=2) + "\n")
            print(f"figures written to {args.json}", file=out)
        return 0 if res["identical"] else 1

    return _run_quiet(args, "demo", job)
