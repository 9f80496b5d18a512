"""Reading TokenSwift's and vLLM's speculative-decoding figures after an offline run.

Two sources, both in the process that holds the ``vllm.LLM``:

* ``get_engine_stats(llm)`` (``vllm_tokenswift.engine.stats_rpc``): the proposer's own
  counters, fetched from the worker by ``collective_rpc``. Among them the acceptance rate
  α (paper Eq. 4: accepted / (k × verified chains)), the mean accepted length (tokens per
  target forward, the bonus token included), the drafting policy's decision per
  request-step (``steps_by_kind``: draft forward, fused heads, n-gram chain, none) and
  the share of wall time spent in the proposer. ``reset_engine_stats(llm)`` zeroes them.
* ``llm.get_metrics()``: vLLM's own counters (``vllm:spec_decode_*``), the same for every
  speculative method; they need ``LLM(disable_log_stats=False)``. A server exports both
  on ``/metrics`` (``examples/openai_client.py``).

    python examples/read_metrics.py --model tiny --max-tokens 1024
"""

from __future__ import annotations

import argparse


def print_metrics(llm) -> dict | None:
    """Print both sets of figures of ``llm``; returns ``get_engine_stats(llm)`` (None: the
    engine does not run TokenSwift)."""
    from vllm.v1.metrics.reader import Vector

    from vllm_tokenswift.engine.stats_rpc import get_engine_stats

    def fmt(x):  # None until a draft chain has been verified
        return "n/a" if x is None else f"{x:.3f}"

    stats = get_engine_stats(llm)
    if stats is not None:
        print(f"TokenSwift: acceptance rate {fmt(stats['acceptance_rate'])}, mean accepted length "
              f"{fmt(stats['mean_accepted_length'])}, draft time share {fmt(stats['draft_time_share'])}")
        print(f"  request-steps by decision: {stats['steps_by_kind']}")
        print(f"  accepted draft tokens by decision: {stats['accepted_by_kind']}")
    counters = {}
    for m in llm.get_metrics():    # Counter / Gauge: .value; Vector (per position): .values
        if m.name.startswith("vllm:spec_decode"):
            counters[m.name] = m.values if isinstance(m, Vector) else m.value
            print(f"  {m.name} = {counters[m.name]}")
    drafts, proposed = counters.get("vllm:spec_decode_num_drafts"), counters.get("vllm:spec_decode_num_draft_tokens")
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens")
    if drafts:   # vLLM's α is over the draft tokens proposed, TokenSwift's over k per chain
        print(f"vLLM: accepted / proposed draft tokens {accepted / proposed:.3f}, "
              f"tokens per verifying step {1 + accepted / drafts:.2f}")
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (default), smollm2, or a model folder (with --heads)")
    ap.add_argument("--heads", default=None, help="TokenSwift heads folder (default: the model's bundled heads)")
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from vllm_tokenswift.cli.models import resolve_target

    model, heads = resolve_target(args.model, args.heads)
    on_gpu = torch.cuda.is_available()
    llm = LLM(model=model, dtype="auto" if on_gpu else "float32", enforce_eager=not on_gpu, max_model_len=4096,
              disable_log_stats=False,                 # vLLM's counters (llm.get_metrics()) need it
              speculative_config={"method": "tokenswift", "model": heads, "num_speculative_tokens": 8,
                                  "tokenswift": {"kv_budget": 1024}})
    llm.generate(["It is a truth universally acknowledged, that"],
                 SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    print_metrics(llm)


if __name__ == "__main__":
    main()
