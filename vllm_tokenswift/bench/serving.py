"""The serving benchmark's settings (``scripts/bench-serve.sh``): each method as
``vllm-tokenswift serve`` flags, each sampling preset as ``vllm bench serve`` flags, the
prompts as vLLM's custom JSONL dataset, and the request rate and TPOT target the
``poisson`` block derives from the ``smollm2`` block's results.

The methods and presets are those of ``vllm-tokenswift bench``
(:mod:`vllm_tokenswift.bench.methods`), renamed where the server differs: ``plain`` is
plain decoding (``ar`` there); ``ar-vk``, ``ngram-vk`` and ``suffix-vk`` are plain
decoding, vLLM's n-gram and suffix decoding with the plugin's CPU verification kernel
(``--additional-config '{"tokenswift_verify_attention": true}'``); ``tokenswift`` is
TokenSwift with the benchmark's k and draft KV budget.

Engine-free: vLLM is not imported (the prompts need the model's tokenizer). Command line
for the script: ``python -m vllm_tokenswift.bench.serving {server-args, client-args,
prompts, rate, tpot-target} ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Sequence

from vllm_tokenswift.bench.methods import (DEFAULT_K, DEFAULT_KV_BUDGET, BenchConfig, method_engine_args,
                                           method_unavailable, sampling_kwargs, speculative_config)

#: serving method -> method of :mod:`vllm_tokenswift.bench.methods`
METHODS: dict[str, str] = {"plain": "ar", "ar-vk": "ar-vk", "tokenswift": "tokenswift",
                           "ngram-vk": "ngram-vk", "suffix-vk": "suffix-vk", "ar-vk-sync": "ar-vk"}
#: serving method -> extra ``vllm serve`` flags: ``ar-vk-sync`` is ``ar-vk`` without
#: asynchronous scheduling, which vLLM 0.32 turns off for every speculative server but
#: EAGLE-like ones (it tells how much of a speculative server's draft-free step is that)
SERVE_FLAGS: dict[str, list[str]] = {"ar-vk-sync": ["--no-async-scheduling"]}
#: Project Gutenberg books of the pg-books corpus that no bundled model or heads saw in
#: training: the last two of the file (assets/demo-model/PROVENANCE.md, demo-heads and
#: smollm2-heads PROVENANCE.md: trained on the first 101 books)
HELDOUT_BOOKS = ("19942", "28054")


def _bench_config(heads: str | None, k: int, kv_budget: int) -> BenchConfig:
    return BenchConfig(heads=heads or "", k=k, tokenswift={"kv_budget": kv_budget})


def server_args(method: str, heads: str | None = None, k: int = DEFAULT_K,
                kv_budget: int = DEFAULT_KV_BUDGET) -> list[str]:
    """``vllm-tokenswift serve`` flags that make a server run ``method`` (none for
    ``plain``): ``--speculative-config`` with the method's speculative config and
    ``--additional-config`` with its engine's extra config (the verification-kernel
    opt-in of the ``-vk`` methods).

    Raises:
        ValueError: unknown method, or one that cannot run here (suffix decoding without
            arctic-inference, TokenSwift without a heads folder; the message says why).
    """
    if method not in METHODS:
        raise ValueError(f"unknown serving method {method!r}; one of {', '.join(METHODS)}")
    cfg = _bench_config(heads, k, kv_budget)
    base = METHODS[method]
    spec = speculative_config(base, cfg)
    why = method_unavailable(base, spec)
    if why:
        raise ValueError(f"{method}: {why}")
    args: list[str] = []
    if spec:
        args += ["--speculative-config", json.dumps(spec)]
    extra = method_engine_args(base, cfg)
    if extra.get("additional_config"):
        args += ["--additional-config", json.dumps(extra["additional_config"])]
    unknown = set(extra) - {"additional_config"}
    if unknown:
        raise ValueError(f"{method}: engine arguments {sorted(unknown)} have no serve flag here")
    return args + SERVE_FLAGS.get(method, [])


def client_args(method: str, sampling: str) -> tuple[list[str], str | None]:
    """``vllm bench serve`` sampling flags of preset ``sampling`` (``greedy``, ``paper``,
    :data:`~vllm_tokenswift.bench.methods.SAMPLING_PRESETS`) for a server running
    ``method``: ``--temperature``, ``--min-p``, ``--repetition-penalty`` and the
    penalty window as ``--extra-body '{"vllm_xargs": {"repetition_penalty_window": W}}'``
    (how the OpenAI API takes it, see tests/test_openai_server.py).

    Returns:
        ``(flags, note)``: for vLLM's n-gram and suffix decoding under ``paper``,
        ``min_p`` is left out (stock vLLM answers HTTP 400 to min_p with speculative
        decoding) and ``note`` says so; otherwise ``note`` is None.
    """
    base = METHODS.get(method, method)
    spec = speculative_config(base, _bench_config("heads", DEFAULT_K, DEFAULT_KV_BUDGET))
    kw, note = sampling_kwargs(base, sampling, spec)
    flags = ["--temperature", str(kw.pop("temperature", 1.0))]
    for key, flag in (("min_p", "--min-p"), ("repetition_penalty", "--repetition-penalty")):
        if key in kw:
            flags += [flag, str(kw.pop(key))]
    extra = kw.pop("extra_args", None)
    if extra:
        flags += ["--extra-body", json.dumps({"vllm_xargs": extra})]
    if kw:
        raise ValueError(f"sampling {sampling!r}: {sorted(kw)} have no bench serve flag here")
    return flags, note


def prompt_texts(tokenizer: Any, streams: Sequence[Sequence[int]], num: int, tokens: int) -> list[str]:
    """``num`` prompts of ``tokens`` tokens each, as text: consecutive windows taken from
    the ``streams`` in turn (window ``i`` from stream ``i % len(streams)``), decoded with
    ``tokenizer.decode``. The server tokenizes the text again, which can move a prompt's
    length by a token or two.

    Raises:
        ValueError: the streams are too short for ``num`` distinct windows.
    """
    out = []
    for i in range(num):
        s = streams[i % len(streams)]
        j = i // len(streams)
        window = s[j * tokens:(j + 1) * tokens]
        if len(window) < tokens:
            raise ValueError(f"stream {i % len(streams)} has {len(s)} tokens: too short for "
                             f"{j + 1} windows of {tokens}")
        out.append(tokenizer.decode(list(window)))
    return out


def write_dataset(path: str, prompts: Sequence[str]) -> None:
    """vLLM's custom dataset (``--dataset-name custom``): one ``{"prompt": ...}`` per line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


# ------------------------------------------------------------------- from earlier results
def load_results(folder: str) -> list[dict]:
    """vLLM's ``--save-result`` JSONs in ``folder`` (one object per file, or several
    lines with ``--append-result``), each with ``_file`` set to its file name. Files that
    are not vLLM results (no ``completed``) are left out."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            text = f.read()
        for line in text.splitlines() if "\n{" in text else [text]:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and "completed" in d:
                d["_file"] = name
                out.append(d)
    return out


def _select(results: Sequence[dict], method: str, sampling: str) -> list[dict]:
    return [r for r in results if r.get("method") == method and r.get("sampling") == sampling
            and r.get("request_rate") in ("inf", None) and r.get("completed")]


def capacity(results: Sequence[dict], method: str = "plain", sampling: str = "greedy") -> float:
    """Requests per second ``method`` sustained under ``sampling``: the highest
    ``request_throughput`` over its closed-loop runs (``--max-concurrency``, all
    requests sent at once).

    Raises:
        ValueError: no such run.
    """
    runs = _select(results, method, sampling)
    if not runs:
        raise ValueError(f"no closed-loop result of {method} under {sampling}")
    return max(float(r["request_throughput"]) for r in runs)


def tpot_target_ms(results: Sequence[dict], method: str = "plain", sampling: str = "greedy",
                   factor: float = 2.0) -> float:
    """A TPOT target for ``--goodput``, in ms: ``factor`` × the median TPOT of ``method``
    at its lowest concurrency (an unloaded server) under ``sampling``.

    Raises:
        ValueError: no such run.
    """
    runs = _select(results, method, sampling)
    if not runs:
        raise ValueError(f"no closed-loop result of {method} under {sampling}")
    low = min(runs, key=lambda r: r.get("max_concurrency") or 0)
    return factor * float(low["median_tpot_ms"])


# ------------------------------------------------------------------- command line
def _print_flags(flags: Sequence[str]) -> None:
    print(" ".join(shlex.quote(f) for f in flags))


def main(argv: list[str] | None = None) -> int:
    """The script's helpers; each prints one line for the shell (flags, a number or a
    path) and exits 2 with one ``error:`` line on stderr when it cannot."""
    ap = argparse.ArgumentParser(prog="python -m vllm_tokenswift.bench.serving",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server-args", help="vllm-tokenswift serve flags of a method")
    s.add_argument("method")
    s.add_argument("--heads", default=None)
    s.add_argument("--k", type=int, default=DEFAULT_K)
    s.add_argument("--kv-budget", type=int, default=DEFAULT_KV_BUDGET)
    c = sub.add_parser("client-args", help="vllm bench serve sampling flags of a preset")
    c.add_argument("method")
    c.add_argument("sampling")
    p = sub.add_parser("prompts", help="write a custom JSONL dataset of book windows")
    p.add_argument("--model-dir", required=True, help="the model folder (its tokenizer)")
    p.add_argument("--books", default=",".join(HELDOUT_BOOKS))
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--num", type=int, required=True)
    p.add_argument("--out", required=True)
    for name, hlp in (("rate", "request rate: --fraction x the method's capacity (req/s)"),
                      ("tpot-target", "--goodput TPOT target: --factor x the unloaded median TPOT (ms)")):
        r = sub.add_parser(name, help=hlp)
        r.add_argument("folder")
        r.add_argument("--method", default="plain")
        r.add_argument("--sampling", default="greedy")
        r.add_argument("--fraction", type=float, default=0.7)
        r.add_argument("--factor", type=float, default=2.0)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "server-args":
            _print_flags(server_args(a.method, a.heads, a.k, a.kv_budget))
        elif a.cmd == "client-args":
            flags, note = client_args(a.method, a.sampling)
            if note:
                print(f"note: {a.method}: {note}", file=sys.stderr)
            _print_flags(flags)
        elif a.cmd == "prompts":
            from transformers import AutoTokenizer

            from vllm_tokenswift.bench.prompts import book_streams

            tok = AutoTokenizer.from_pretrained(a.model_dir)
            streams = book_streams(tok, [b for b in a.books.split(",") if b])
            write_dataset(a.out, prompt_texts(tok, streams, a.num, a.tokens))
            print(a.out)
        elif a.cmd == "rate":
            print(f"{a.fraction * capacity(load_results(a.folder), a.method, a.sampling):.4f}")
        elif a.cmd == "tpot-target":
            print(f"{tpot_target_ms(load_results(a.folder), a.method, a.sampling, a.factor):.1f}")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
