"""Offline batch generation with TokenSwift: ``vllm.LLM`` with a ``speculative_config``.

One engine generates continuations of a batch of book openings twice: under greedy
decoding and under the paper's sampling (temperature 1.0, min_p 0.1, repetition penalty
1.2 over the last 1,024 tokens), and prints tokens per second for each. TokenSwift is
lossless: greedy output is token-identical to vLLM without speculation, sampled output
has the same distribution; only the speed changes.

    python examples/offline_batch.py                 # SmolLM2-135M-Instruct + its bundled heads
    python examples/offline_batch.py --model tiny    # the bundled 12.6M demo model (fast on CPU)
    python examples/offline_batch.py --model /models/Qwen2.5-7B --heads /models/TokenSwift-Qwen2.5-7B

``smollm2`` is converted once on first use (``vllm-tokenswift fetch-model``);
``vllm-tokenswift paths`` prints the model and heads folders. On CPU the model runs in
float32 and eagerly. ``examples/read_metrics.py`` shows what to read after such a run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import vllm_tokenswift
from vllm_tokenswift.cli.models import resolve_target

# book openings bundled with the package, about 500 tokens each
PROMPTS = sorted((Path(vllm_tokenswift.__file__).parent / "assets" / "prompts").glob("*-short.txt"))


def main(argv: list[str] | None = None):
    """Run both samplings; returns the ``vllm.LLM`` (for ``read_metrics.print_metrics``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model folder / hub id")
    ap.add_argument("--heads", default=None, help="TokenSwift heads folder (default: the model's bundled heads)")
    ap.add_argument("--prompts", nargs="+", default=[str(p) for p in PROMPTS], help="text files, one prompt each")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens generated per prompt")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens: the longest draft chain per step")
    ap.add_argument("--kv-budget", type=int, default=1024, help="draft KV budget in tokens (paper Sec 3.3)")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, the model's own on a GPU")
    args = ap.parse_args(argv)

    # imported after the arguments, so that --help answers at once
    import torch
    from vllm import LLM, SamplingParams

    model, heads = resolve_target(args.model, args.heads)   # "smollm2" / "tiny" -> (model, heads) folders
    if heads is None:
        raise SystemExit(f"{model} has no bundled heads: pass --heads (vllm-tokenswift train-heads makes them)")
    prompts = [Path(p).read_text(encoding="utf-8") for p in args.prompts]
    on_gpu = torch.cuda.is_available()
    llm = LLM(model=model, dtype=args.dtype or ("auto" if on_gpu else "float32"),
              max_model_len=4096, seed=0,
              enforce_eager=not on_gpu,          # CPU: no graph compilation at start-up
              disable_log_stats=False,           # keeps vLLM's spec-decode counters (llm.get_metrics())
              speculative_config={"method": "tokenswift", "model": heads,
                                  "num_speculative_tokens": args.k,
                                  "tokenswift": {"kv_budget": args.kv_budget}})
    # ignore_eos: every request generates max_tokens, so the two runs do the same work
    runs = {"greedy": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
            "paper's sampling": SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2,
                                               max_tokens=args.max_tokens, ignore_eos=True,
                                               # the penalty over the last 1,024 tokens only (paper Eq. 3)
                                               extra_args={"repetition_penalty_window": 1024})}
    for name, params in runs.items():
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"{name}: {len(outputs)} prompts, {tokens} tokens in {wall:.1f} s, {tokens / wall:.1f} tokens/s")
        print(f"  first continuation: {outputs[0].outputs[0].text[:100]!r}")
    return llm


if __name__ == "__main__":
    main()
