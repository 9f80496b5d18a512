"""Where does the run-to-run spread of a plain-decoding run come from on this machine?

Starts one plain-decoding (AR) engine on SmolLM2-135M-Instruct (fp32, eager), takes a
2,048-token book prompt, and times ``--runs`` greedy generations of ``--new-tokens``
tokens. For each run it prints

* wall milliseconds per generated token (the run's whole time, the prompt's prefill included);
* CPU milliseconds per generated token of this process's child processes (vLLM's engine
  core and its worker): if other guests' vCPUs took the time, CPU time would stay flat
  while wall time rises;
* the machine's steal time over the run (``/proc/stat``), as a share of the wall time.

Run it several times, alternating any environment change, to see whether the change moves
the figures by more than they move on their own, e.g. transparent huge pages for PyTorch's
CPU allocations::

    python docs/research/noise_probe.py
    THP_MEM_ALLOC_ENABLE=1 python docs/research/noise_probe.py

On 2026-12-02 (README, Benchmark): 138-161 ms per token over 3 engines x 3 runs, child
CPU time 1.57-1.64x the wall time in every run and moving with it, steal time 1-6% of
the wall time; THP_MEM_ALLOC_ENABLE=1 made no difference beyond that spread (4 engines
alternating off/on: 137-150 ms per token off, 133-141 on).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def steal_seconds(stat_text: str, clk_tck: int) -> float:
    """Seconds of steal time in the aggregate ``cpu`` line of ``/proc/stat`` text (its 8th
    value, in clock ticks). Raises ValueError if the first line is not the ``cpu`` line."""
    first = stat_text.splitlines()[0].split()
    if not first or first[0] != "cpu" or len(first) < 9:
        raise ValueError("not /proc/stat: the first line must be the aggregate 'cpu' line")
    return int(first[8]) / clk_tck


def _children_cpu_s() -> float:
    import psutil

    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


def _steal_now() -> float:
    with open("/proc/stat", encoding="ascii") as f:
        return steal_seconds(f.read(), os.sysconf("SC_CLK_TCK"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--books", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                                                    "pg-books", "train.jsonl"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM, SamplingParams

    from vllm_tokenswift.cli.models import fetch_model

    llm = LLM(model=str(fetch_model()), dtype="float32", max_model_len=args.prefix_len + args.new_tokens + 64,
              enforce_eager=True, kv_cache_memory_bytes=int(0.5 * (1 << 30)), enable_prefix_caching=False,
              seed=0)
    with open(args.books, encoding="utf-8") as f:
        text = json.loads(f.readline())["text"]
    ids = llm.get_tokenizer()(text)["input_ids"][:args.prefix_len]
    llm.generate([{"prompt_token_ids": ids[:256]}], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r}")
    for r in range(args.runs):
        c0, s0, t0 = _children_cpu_s(), _steal_now(), time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        cpu, steal = _children_cpu_s() - c0, _steal_now() - s0
        n = args.new_tokens
        print(f"run {r}: wall {wall / n * 1e3:.2f} ms/token, child CPU {cpu / n * 1e3:.2f} ms/token "
              f"({cpu / wall:.2f} CPU-s per wall-s), steal {100 * steal / wall:.1f}% of the wall time", flush=True)


if __name__ == "__main__":
    main()
