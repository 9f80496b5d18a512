"""``vllm-tokenswift probe``: what one decode step costs at long context, part by part.

For each context length it prefills one book prefix (prefix caching on, so every later
request over the same prompt skips the prefill) and times steps of one known shape
(the probe's own drafting policy, :mod:`vllm_tokenswift.bench.probe_policy`: every step of a
request verifies exactly ``k`` draft tokens, or runs the draft forward):

* the plain decode step (``k = 0``) and verifying steps with ``k`` = 1, 2, 4, 8 draft
  tokens, with the plugin's verification attention (``verify_attention="auto"``) and,
  in an engine of its own, with vLLM's CPU kernel (``"vllm"``): before and after in
  one invocation;
* the draft forward at each ``kv_budget`` (one engine per budget);
* self-speculative chain steps (``--chains``: ``m`` draft forwards over the middle budget's
  view, then verifying the ``m`` drafted tokens: the TriForce* step), plugin kernel.

A shape's steps are those of a ``--tokens`` request minus those of a 16-token request
of the same shape (:func:`decode_steps`), so the first step of each, which prefills the
prompt's uncached tail, cancels out. Each is split with the worker's profile (the timers
:mod:`vllm_tokenswift.bench.profiler` installs in the probe's engines only) into the attention layers, the rest of the target's forward, sampling / rejection sampling, the
proposer (the draft forward included) and the remainder (scheduling, the engine-core
round trip, input preparation, the LM head). Beside it, a micro-benchmark of the
attention op alone (vLLM's ``cpu_attention_with_kv_cache`` and the plugin's kernel)
at query lengths 1, 2, 5 and 9 over a paged cache of the same heads and length shows
which part of a verifying step is the kernel's.

Writes ``probe.json``, ``probe.md`` and ``probe.png`` to ``--out``; vLLM's log lines go
to ``OUT/vllm.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Sequence

# the attention micro-benchmark (re-exported: probe.attention_microbench, ...)
from vllm_tokenswift.bench.attention_op import (MICRO_Q, attention_microbench,  # noqa: F401
                                                synthetic_cache, vllm_attention)

DEFAULT_CONTEXTS = {"tiny": [8192, 32768, 65536, 98304], "smollm2": [8192, 16384]}
DEFAULT_DRAFTS = (0, 1, 2, 4, 8)
DEFAULT_BUDGETS = (512, 1024, 4096)
DEFAULT_CHAINS = (1, 2)
#: tokens of the short request whose steps are subtracted from every timed one
#: (:func:`decode_steps`)
SHORT_TOKENS = 16
#: profile parts a step is split into (ms per step), in plot order
PARTS = ("attention", "forward_rest", "sample", "propose", "other")


# ----------------------------------------------------------------- step breakdown (engine-free)
def profile_delta(before: dict | None, after: dict) -> dict:
    """``after - before`` of two ``profile`` snapshots (``{"seconds": {}, "counts": {}}``)."""
    out = {"seconds": dict(after.get("seconds") or {}), "counts": dict(after.get("counts") or {})}
    for key in ("seconds", "counts"):
        for k, v in ((before or {}).get(key) or {}).items():
            out[key][k] = out[key].get(k, 0) - v
    return out


def decode_steps(short: dict, long: dict) -> dict:
    """The decode steps of ``long`` alone: ``long - short`` of two requests of one shape
    over the same cached prompt (``{"wall_s", "steps", "profile"}`` each, as
    :func:`_run_shape` returns them).

    Each request's first step prefills the prompt's tail that prefix caching cannot
    serve (up to a block, 127 tokens at block size 128: about 235 ms of attention at a
    16K context on the demo model) on vLLM's kernel; spread over the request's steps it
    inflated every shape's per-step cost, and verifying shapes (fewer steps per token)
    more than the plain one. The difference keeps only the ``long`` request's extra
    decode steps.

    Raises:
        ValueError: ``long`` has no more steps than ``short``.
    """
    steps = int(long["steps"]) - int(short["steps"])
    if steps < 1:
        raise ValueError(f"the long request ({long['steps']} steps) needs more steps than the short one "
                         f"({short['steps']})")
    return {"wall_s": float(long["wall_s"]) - float(short["wall_s"]), "steps": steps,
            "profile": profile_delta(short["profile"], long["profile"])}


def step_breakdown(profile: dict, wall_s: float, steps: int) -> dict:
    """Per-step milliseconds of a run whose ``steps`` engine steps all had one shape.

    Args:
        profile: the run's profile (:func:`profile_delta`): ``seconds`` of ``forward``,
            ``attention``, ``sample``, ``propose``, ``draft_forward``, ``draft_attention``;
            ``counts`` of ``draft_forwards``.
        wall_s: the run's wall time seen by the front end.
        steps: engine steps in the run.

    Returns:
        ``step`` (wall / steps), ``attention``, ``forward_rest`` (the verification
        forward minus its attention), ``sample``, ``propose``, ``other`` (the remainder,
        never below 0) in ms per step, and per draft forward call ``draft_forward`` and
        ``draft_attention`` (ms; None without draft forwards). No part is below 0.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError("a run needs at least one step")
    s = profile.get("seconds") or {}
    # never below 0: a part that is ~0 per step can come out slightly negative as the
    # difference of two requests (decode_steps)
    per = {k: max(0.0, 1e3 * float(s.get(k, 0.0)) / steps) for k in ("forward", "attention", "sample", "propose")}
    step = 1e3 * wall_s / steps
    out = {"step": step, "attention": per["attention"], "forward_rest": max(0.0, per["forward"] - per["attention"]),
           "sample": per["sample"], "propose": per["propose"],
           "other": max(0.0, step - per["forward"] - per["sample"] - per["propose"])}
    n_fwd = int((profile.get("counts") or {}).get("draft_forwards", 0))
    out["draft_forwards"] = n_fwd
    out["draft_forward"] = 1e3 * float(s.get("draft_forward", 0.0)) / n_fwd if n_fwd else None
    out["draft_attention"] = 1e3 * float(s.get("draft_attention", 0.0)) / n_fwd if n_fwd else None
    return out


def markdown(rows: list[dict], micro: list[dict]) -> str:
    """The probe's tables: step shapes per context (ms and × the plain step of the same
    engine kind), then the attention micro-benchmark."""
    lines = ["| context | step | kernel | ms | × plain | × AR | attention | rest of forward | sampling | proposer "
             "| other |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {(r["context"], r["kernel"]): r["step"] for r in rows if r["shape"] == "plain"}
    for r in rows:
        base = plain.get((r["context"], r["kernel"] if r["kernel"] != "ar" else "plugin")) \
            or plain.get((r["context"], "plugin"))
        ar = plain.get((r["context"], "ar"))
        ms = r["draft_forward"] if r["shape"].startswith("draft forward") else r["step"]
        ratio = f"{ms / base:.2f}x" if base and ms is not None else "-"
        ratio += f" | {ms / ar:.2f}x" if ar and ms is not None else " | -"
        if r["shape"].startswith("draft forward"):
            parts = [r.get("draft_attention"), (r["draft_forward"] or 0) - (r.get("draft_attention") or 0),
                     None, None, None]
        else:
            parts = [r[p] for p in PARTS]
        cells = " | ".join("-" if v is None else f"{v:.1f}" for v in parts)
        lines.append(f"| {r['context']:,} | {r['shape']} | {r['kernel']} | {ms:.1f} | {ratio} | {cells} |")
    chains = [r for r in rows if r["shape"].startswith("chain") and r.get("draft_forward") is not None]
    if chains:
        lines += ["", "Chain steps: the proposer column holds their draft forwards (per call, over the "
                      "budgeted view plus the chain so far):", ""]
        for r in chains:
            per_step = r["draft_forwards"] / r["steps"] if r.get("steps") else float("nan")
            lines.append(f"- {r['context']:,}, {r['shape']}: {per_step:.2f} draft forwards per step, "
                         f"{r['draft_forward']:.1f} ms each ({r['draft_attention'] or 0:.1f} ms attention)")
    if micro:
        n_layers = micro[0].get("layers", 1)
        lines += ["", f"Attention op alone (one request, ms per layer, median; {n_layers} layers' caches "
                      "attended in turn" + (", cold as in the engine" if n_layers > 1 else ", cache-warm") + "):", "",
                  "| context | q | vLLM | plugin | vLLM / plugin | vLLM q / vLLM q=1 | plugin q / vLLM q=1 |",
                  "|---|---|---|---|---|---|---|"]
        one = {m["context"]: m["vllm_ms"] for m in micro if m["q"] == 1}
        for m in micro:
            b = one.get(m["context"])
            lines.append(f"| {m['context']:,} | {m['q']} | {m['vllm_ms']:.2f} | {m['plugin_ms']:.2f} | "
                         f"{m['vllm_ms'] / m['plugin_ms']:.2f}x | "
                         + (f"{m['vllm_ms'] / b:.2f}x | {m['plugin_ms'] / b:.2f}x |" if b else "- | - |"))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], micro: list[dict], path: str) -> str | None:
    """Stacked bars of the step parts per context and shape, and the micro-benchmark
    (ms against query length, per context); ``None`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    contexts = sorted({r["context"] for r in rows}) or sorted({m["context"] for m in micro})
    fig, axes = plt.subplots(1, len(contexts) + (1 if micro else 0),
                             figsize=(4.2 * (len(contexts) + (1 if micro else 0)), 4.2), squeeze=False)
    colors = dict(zip(PARTS, ("#4c72b0", "#8da0cb", "#55a868", "#dd8452", "#bbbbbb")))
    for ax, c in zip(axes[0], contexts):
        sel = [r for r in rows if r["context"] == c and not r["shape"].startswith("draft forward")]
        labels = [f"{r['shape']}\n{r['kernel']}" for r in sel]
        bottom = [0.0] * len(sel)
        for part in PARTS:
            vals = [r[part] or 0.0 for r in sel]
            ax.bar(range(len(sel)), vals, bottom=bottom, color=colors[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, r in enumerate(sel):
            if r["attention"] is None:   # no parts: the step's time as one bar
                ax.bar(i, r["step"], color="#999999")
        fwd = [r for r in rows if r["context"] == c and r["shape"].startswith("draft forward")]
        for i, r in enumerate(fwd):
            ax.bar(len(sel) + i, r["draft_forward"], color="#c44e52", label="draft forward" if i == 0 else None)
            labels.append(r["shape"].replace("draft forward ", "fwd\n"))
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=6, rotation=90)
        ax.set_title(f"context {c:,}")
        ax.set_ylabel("ms per step")
    axes[0][0].legend(fontsize=7)
    if micro:
        ax = axes[0][-1]
        for c in sorted({m["context"] for m in micro}):
            ms = [m for m in micro if m["context"] == c]
            ax.plot([m["q"] for m in ms], [m["vllm_ms"] for m in ms], "o--", label=f"vLLM {c // 1024}K")
            ax.plot([m["q"] for m in ms], [m["plugin_ms"] for m in ms], "s-", label=f"plugin {c // 1024}K")
        ax.set_yscale("log")
        ax.set_xlabel("query tokens")
        ax.set_ylabel("ms per layer")
        ax.set_title("attention op alone")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------- per-step work (engine-free)
STEP_WORK_HISTORIES = (1024, 10240, 102400)


def history_tokens(n: int) -> list[int]:
    """``n`` tokens of book text for :func:`step_work_bench`: *The Brothers Karamazov*
    from the pg-books corpus with the demo model's tokenizer when the corpus is there,
    else the bundled book openings repeated (repeated text makes smaller n-gram tables)."""
    from transformers import AutoTokenizer

    from vllm_tokenswift.cli.assets import DEMO_MODEL, PROMPTS_DIR
    from vllm_tokenswift.bench.harness import book_streams

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    try:
        ids = book_streams(tok, ["28054"])[0]
    except (OSError, ValueError):
        text = "\n\n".join(p.read_text() for p in sorted(PROMPTS_DIR.glob("*.txt")))
        ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return list(ids[:n])


def step_work_bench(histories: Sequence[int] = STEP_WORK_HISTORIES, steps: int = 400,
                    tokens: list[int] | None = None) -> list[dict]:
    """Microseconds per decode step of the proposer's per-request work after ``h`` tokens
    of history, for each ``h``: the n-gram table update (one new token), the n-gram chain
    (:func:`~vllm_tokenswift.core.chain.ngram_chain`, 8 tokens), the penalty window's count
    update (one token in, one out, 1,024-token window, as the proposer keeps it), and the
    policy (calibration of the chain, :func:`~vllm_tokenswift.core.policy.decision.decide` for one row);
    with the table's size (:meth:`~vllm_tokenswift.core.ngram.NGramTable.num_entries`) and the
    Python memory it holds (``tracemalloc``, MB). Flat in ``h`` means a step at 100K tokens
    costs the proposer what it costs at 1K."""
    import tracemalloc

    import numpy as np
    import torch

    from vllm_tokenswift.core.policy import decision as pol
    from vllm_tokenswift.core.chain import ngram_chain
    from vllm_tokenswift.core.ngram import NGramTable

    need = max(histories) + steps + 1
    toks = tokens if tokens is not None else history_tokens(need)
    vocab = max(toks) + 1
    costs = pol.CostModel()
    for i in range(64):
        costs.observe_step(0.02 + 0.001 * (i % 3), 1, i % 5)
    cost = costs.costs()
    calib = pol.Calibration(positions=8)
    rows = []
    for h in histories:
        tracemalloc.start()
        table = NGramTable(4)
        table.extend(toks[:h])
        mem = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        counts = torch.zeros(vocab, dtype=torch.int32)
        window = torch.as_tensor(toks[max(0, h - 1024):h], dtype=torch.long)
        counts.index_add_(0, window, torch.ones_like(window, dtype=torch.int32))
        ctx_len = table.context_len
        t_upd = t_chain = t_pen = t_pol = 0.0
        for i in range(steps):
            pos = h + i
            a = time.perf_counter()
            table.extend([toks[pos]])
            b = time.perf_counter()
            ch = ngram_chain(toks[pos + 1 - ctx_len: pos + 1], table, 8, 0.05, True)
            c = time.perf_counter()
            add = torch.as_tensor([toks[pos]], dtype=torch.long)
            sub = torch.as_tensor([toks[pos - 1024]], dtype=torch.long)
            counts.index_add_(0, add, torch.ones(1, dtype=torch.int32))
            counts.index_add_(0, sub, torch.full((1,), -1, dtype=torch.int32))
            _ = counts > 0
            d = time.perf_counter()
            cum = calib.chain_cum(ch.sources, ch.confs) if ch.tokens else np.zeros(0)
            opts = pol.RowOptions({pol.NONE: np.zeros(0), pol.NGRAM: cum})
            pol.decide([opts], cost)
            e = time.perf_counter()
            t_upd += b - a
            t_chain += c - b
            t_pen += d - c
            t_pol += e - d
        us = 1e6 / steps
        rows.append({"history": int(h), "ngram_update_us": t_upd * us, "ngram_chain_us": t_chain * us,
                     "penalty_us": t_pen * us, "policy_us": t_pol * us,
                     "total_us": (t_upd + t_chain + t_pen + t_pol) * us,
                     "ngram_entries": table.num_entries(), "table_mb": mem})
    return rows


def step_work_markdown(rows: list[dict]) -> str:
    lines = ["| history tokens | n-gram update µs | n-gram chain µs | penalty window µs | policy µs | "
             "total µs per step | n-gram entries | table MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['history']:,} | {r['ngram_update_us']:.1f} | {r['ngram_chain_us']:.1f} | "
                     f"{r['penalty_us']:.1f} | {r['policy_us']:.1f} | {r['total_us']:.1f} | "
                     f"{r['ngram_entries']:,} | {r['table_mb']:.1f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- engines
def _book_prompt(tokenizer_dir: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from vllm_tokenswift.bench.harness import book_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return book_prompts(tok, 1, n, skip=2000)[0]


def _run_shape(llm, prompt: list[int], directive: dict, max_tokens: int, sampling: dict | None = None) -> dict:
    """One request of the shape ``directive`` over the cached ``prompt``: wall time,
    engine steps and the profile delta of the run (first worker). ``sampling``:
    ``SamplingParams`` keyword arguments (None: greedy)."""
    from vllm import SamplingParams

    from vllm_tokenswift.bench.probe_policy import PROBE_KEY

    before = worker_profile(llm)
    kw = dict(sampling or {"temperature": 0.0})
    extra = dict(kw.pop("extra_args", None) or {}, **{PROBE_KEY: directive})
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra, **kw)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    prof = profile_delta(before, worker_profile(llm))
    steps = int(prof["counts"].get("steps", 0))
    return {"wall_s": wall, "steps": steps, "profile": prof}


def worker_profile(llm) -> dict:
    """The first worker's profile sums (:class:`~vllm_tokenswift.bench.profiler.StepProfile`)."""
    res = llm.collective_rpc("tokenswift_profile")
    return res[0] if res else {"seconds": {}, "counts": {}}


def probe_num_spec_tokens(drafts: Sequence[int]) -> int:
    """``num_speculative_tokens`` of the probe engines: the most draft tokens a timed shape
    verifies, at least 4 (the draft forward's chain)."""
    return max(max(drafts), 4)


def probe_max_model_len(context: int, tokens: int, drafts: Sequence[int]) -> int:
    """``max_model_len`` (tokens) of a probe engine at ``context``: the prefix, ``tokens``
    timed steps of up to :func:`probe_num_spec_tokens` ``+ 1`` tokens each, and 256 of slack."""
    return context + tokens * (probe_num_spec_tokens(drafts) + 1) + 256


def check_windows(model: str, contexts: Sequence[int], yarn: float | None, tokens: int,
                  drafts: Sequence[int]) -> None:
    """Raise ``ValueError`` naming the first context whose probe engine
    (:func:`probe_max_model_len`) does not fit the model's window with rope scaling ``yarn``
    (``original_max_position_embeddings × yarn``); called for every context before the first
    engine starts, so a long invocation does not fail after its first contexts."""
    from vllm_tokenswift.cli.models import model_window

    window = model_window(model, yarn)
    for c in contexts:
        need = probe_max_model_len(c, tokens, drafts)
        if window is not None and need > window:
            raise ValueError(f"context {c} + {tokens} timed steps needs {need} positions, over the model's "
                             f"window {window}" + (f" (YaRN x{yarn:g})" if yarn else "") + "; raise --yarn")


def probe_context(model: str, heads: str, context: int, *, yarn: float | None, drafts: Sequence[int],
                  budgets: Sequence[int], tokens: int, kernels: Sequence[str], bar=None,
                  sampling: dict | None = None, chains: Sequence[int] = ()) -> list[dict]:
    """All engines of one context length; rows for :func:`markdown` (see the module doc).
    The caller has checked ``context`` against the model's window (:func:`check_windows`).
    ``sampling``: ``SamplingParams`` keyword arguments of every timed request (None: greedy);
    ``chains``: chain lengths (draft forwards per step) timed in the plugin engine of the
    middle budget, each at most ``probe_num_spec_tokens(drafts)``."""
    from vllm import LLM

    from vllm_tokenswift.bench.harness import teardown_engine
    from vllm_tokenswift.bench.probe_policy import POLICY as PROBE_POLICY
    from vllm_tokenswift.bench.profiler import WORKER_EXTENSION
    from vllm_tokenswift.cli.models import yarn_overrides

    prompt = _book_prompt(model, context)
    k = probe_num_spec_tokens(drafts)
    mml = probe_max_model_len(context, tokens, drafts)
    kv_bytes = _kv_bytes_per_token(model)
    kv_gb = max(0.5, 1.3 * mml * kv_bytes / 2**30)
    rows: list[dict] = []
    # (verification kernel, kv_budget, time the verifying shapes too?): the plugin's kernel
    # at every budget (draft forwards), verifying shapes at the middle budget; vLLM's kernel
    # (the "before") at the middle budget
    arms = [("plugin", b, b == budgets[min(1, len(budgets) - 1)]) for b in budgets]
    if "vllm" in kernels:
        arms.append(("vllm", budgets[min(1, len(budgets) - 1)], True))
    if "ar" in kernels:   # plain vLLM, no speculative decoding: the baseline's decode step
        arms.insert(0, ("ar", None, True))
    for kernel, budget, verify in arms:
        spec = None if kernel == "ar" else {
            "method": "tokenswift", "model": heads, "num_speculative_tokens": k,
            "tokenswift": {"kv_budget": budget, "policy": PROBE_POLICY,
                           "verify_attention": "auto" if kernel == "plugin" else "vllm"}}
        kw = dict(model=model, dtype="float32", max_model_len=mml, enable_prefix_caching=True, seed=0,
                  enforce_eager=True, kv_cache_memory_bytes=int(kv_gb * 2**30), speculative_config=spec,
                  disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION)
        if yarn:
            kw["hf_overrides"] = yarn_overrides(model, yarn)
        if bar is not None:
            bar.set_postfix_str(f"{context:,}: {kernel} kernel, kv_budget {budget}: prefill")
        llm = LLM(**kw)
        try:
            llm.collective_rpc("tokenswift_profile_install")
            _run_shape(llm, prompt, {"kind": "ngram", "drafts": 0}, 2)       # prefill, cached after
            shapes = [("plain" if d == 0 else f"verify {d}", {"kind": "ngram", "drafts": d}) for d in drafts] \
                if verify else []
            if verify and kernel == "plugin":
                shapes += [(f"chain {m}", {"kind": "chain", "drafts": m}) for m in chains]
            if kernel == "ar":
                shapes = [("plain", {"kind": "ngram", "drafts": 0})]
            else:
                shapes.append((f"draft forward {budget}", {"kind": "forward", "drafts": k}))
            for name, directive in shapes:
                if bar is not None:
                    bar.set_postfix_str(f"{context:,}: {kernel} kernel: {name}")
                _run_shape(llm, prompt, directive, 4, sampling)                # warm this shape
                short = _run_shape(llm, prompt, directive, SHORT_TOKENS, sampling)
                long = _run_shape(llm, prompt, directive, tokens, sampling)
                res = decode_steps(short, long)
                row = {"context": context, "shape": name, "kernel": kernel, "kv_budget": budget,
                       "drafts": directive["drafts"], "wall_s": res["wall_s"], "steps": res["steps"]}
                row.update(step_breakdown(res["profile"], res["wall_s"], max(1, res["steps"])))
                if not (res["profile"].get("seconds") or {}).get("forward"):
                    # an engine whose worker keeps no profile: the step's time alone
                    row.update({part: None for part in PARTS})
                rows.append(row)
                if bar is not None:
                    bar.update(1)
        finally:
            teardown_engine(llm)
    return rows


def _kv_bytes_per_token(model: str) -> int:
    from vllm_tokenswift.cli.models import read_model_config

    cfg = read_model_config(model) or {}
    heads = int(cfg.get("num_attention_heads", 8))
    d = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 512)) // heads)
    return 2 * int(cfg.get("num_hidden_layers", 12)) * int(cfg.get("num_key_value_heads", heads)) * d * 4


# ----------------------------------------------------------------- CLI
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``probe`` on an argparse ``subparsers`` object."""
    from vllm_tokenswift.bench.cli import _ints
    from vllm_tokenswift.cli.models import add_target_args

    p = subparsers.add_parser("probe", help="cost of a decode step, a verifying step and the draft forward "
                                            "at long context, split by part, plus the attention op alone",
                              description=__doc__.split("\n\n")[0])
    add_target_args(p, yarn_note="; default: the smallest factor that fits the longest context")
    p.add_argument("--contexts", type=_ints, default=None,
                   help="context lengths in tokens (default: 8192,32768,65536,98304 for tiny; "
                        "8192,16384 for smollm2)")
    p.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_DRAFTS),
                   help="draft tokens per verifying step (default 0,1,2,4,8; 0 = the plain step)")
    p.add_argument("--chains", type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   default=list(DEFAULT_CHAINS),
                   help="self-speculative chain steps to time, by draft forwards per step (default 1,2; "
                        "'' for none), at the middle kv_budget, plugin kernel")
    p.add_argument("--kv-budgets", type=_ints, default=list(DEFAULT_BUDGETS),
                   help="draft forward kv_budget values (default 512,1024,4096)")
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per timed shape (default 96, more than 32)")
    p.add_argument("--kernels", default="plugin,vllm",
                   help="engine arms: plugin (TokenSwift, the plugin's verification kernel), vllm (TokenSwift, "
                        "vLLM's kernel), ar (plain vLLM without speculative decoding: its decode step, the "
                        "baseline every × AR figure divides by); default plugin,vllm")
    p.add_argument("--micro-only", action="store_true",
                   help="only the engine-free parts: the attention op and the proposer's per-step work")
    p.add_argument("--step-work", action="store_true",
                   help="also time the proposer's per-step work (n-gram update and chain, penalty window, "
                        "policy) after 1K, 10K and 100K tokens of history (engine-free)")
    p.add_argument("--no-micro", action="store_true", help="skip the attention micro-benchmark")
    p.add_argument("--micro-layers", type=int, default=None,
                   help="caches the micro-benchmark attends in turn, one per layer (default: the model's "
                        "layer count, so the KV is read from DRAM as in a decode step; 1 = cache-warm)")
    p.add_argument("--out", default=os.path.join("runs", "probe-" + time.strftime("%Y%m%d-%H%M%S")))
    p.add_argument("--sampling", choices=("greedy", "paper"), default="greedy",
                   help="the timed requests' sampling: greedy (default) or the paper's (T 1.0, min_p 0.1, "
                        "repetition penalty 1.2 over a 1,024-token window), which adds the penalty, min_p and "
                        "the rejection sampler's draft distributions to every step")
    p.add_argument("--verbose", action="store_true", help="vLLM's log lines on the terminal")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-tokenswift probe``."""
    from tqdm import tqdm

    from vllm_tokenswift.bench.harness import engine_output_to
    from vllm_tokenswift.cli.models import model_window, read_model_config, resolve_target

    bad = [m for m in args.chains if not 1 <= m <= probe_num_spec_tokens(args.drafts)]
    if bad:
        raise SystemExit(f"probe: --chains takes 1 to {probe_num_spec_tokens(args.drafts)} draft forwards per "
                         f"step (num_speculative_tokens of the probe engines), got {bad}")
    if args.tokens <= 2 * SHORT_TOKENS:
        raise SystemExit(f"probe: --tokens must exceed {2 * SHORT_TOKENS} (the short request of "
                         f"{SHORT_TOKENS} tokens is subtracted from every timed one)")
    model, heads = resolve_target(args.model, args.heads)
    name = args.model.strip().lower()
    contexts = args.contexts or DEFAULT_CONTEXTS.get(name, [8192])
    kernels = [x.strip() for x in args.kernels.split(",") if x.strip()]
    unknown = sorted(set(kernels) - {"plugin", "vllm", "ar"})
    if unknown or "plugin" not in kernels:
        raise SystemExit(f"probe: --kernels takes plugin (required), vllm and ar; got {args.kernels!r}")
    yarn = args.yarn
    if yarn is None and not args.micro_only:
        base = model_window(model) or 0
        need = probe_max_model_len(max(contexts), args.tokens, args.drafts)
        yarn = None if need <= base else float(math.ceil(need / base))
    if not args.micro_only:
        try:
            check_windows(model, contexts, yarn, args.tokens, args.drafts)
        except ValueError as e:
            raise SystemExit(f"probe: {e}") from None
    cfg = read_model_config(model) or {}
    hq = int(cfg["num_attention_heads"])
    hkv = int(cfg.get("num_key_value_heads", hq))
    d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq)
    micro_layers = args.micro_layers or int(cfg.get("num_hidden_layers", 1))
    if micro_layers < 1:
        raise SystemExit(f"probe: --micro-layers must be >= 1, got {micro_layers}")
    os.makedirs(args.out, exist_ok=True)
    log = None if args.verbose else os.path.join(args.out, "vllm.log")
    rows: list[dict] = []
    micro: list[dict] = []
    work: list[dict] = []
    meta = {"model": model, "heads": heads, "yarn": yarn, "contexts": contexts, "drafts": args.drafts,
            "chains": args.chains,
            "kv_budgets": args.kv_budgets, "tokens": args.tokens, "kernels": kernels, "heads_q": hq,
            "heads_kv": hkv, "head_dim": d, "sampling": args.sampling, "micro_layers": micro_layers}
    sampling = None
    if args.sampling != "greedy":
        from vllm_tokenswift.bench.methods import sampling_kwargs

        sampling, _ = sampling_kwargs("tokenswift", args.sampling, {"method": "tokenswift"})

    def save():
        with open(os.path.join(args.out, "probe.json"), "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "steps": rows, "attention_op": micro, "step_work": work}, f, indent=1)

    with engine_output_to(log) as (out, err):
        if not args.no_micro:
            print(f"attention op alone: {hq} query heads on {hkv} KV heads, head_dim {d}", file=out, flush=True)
            micro = attention_microbench(contexts, hq=hq, hkv=hkv, d=d, layers=micro_layers)
            save()
        if args.step_work or args.micro_only:
            print("proposer work per step at 1K, 10K and 100K tokens of history", file=out, flush=True)
            work = step_work_bench()
            save()
        if not args.micro_only:
            per_ctx = (len(args.drafts) * (2 if "vllm" in kernels else 1) + len(args.kv_budgets) + len(args.chains)
                       + (1 if "vllm" in kernels else 0) + (1 if "ar" in kernels else 0))
            bar = tqdm(total=per_ctx * len(contexts), desc="probe", file=err, dynamic_ncols=True)
            for c in contexts:
                rows += probe_context(model, heads, c, yarn=yarn, drafts=args.drafts, budgets=args.kv_budgets,
                                      tokens=args.tokens, kernels=kernels, bar=bar, sampling=sampling,
                                      chains=args.chains)
                save()
            bar.close()
        text = markdown(rows, micro)
        if work:
            text += "\nProposer work per step (engine-free, one request):\n\n" + step_work_markdown(work)
        with open(os.path.join(args.out, "probe.md"), "w", encoding="utf-8") as f:
            f.write(f"# Cost probe: {os.path.basename(model)}" + (f", YaRN x{yarn:g}" if yarn else "")
                    + f", {args.sampling} sampling" + "\n\n")
            f.write(text)
        png = plot(rows, micro, os.path.join(args.out, "probe.png"))
        print(text, file=out)
        print(f"wrote {args.out}/probe.json, probe.md" + (", probe.png" if png else ""), file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-tokenswift")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["probe", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
