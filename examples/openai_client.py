"""A TokenSwift server through the OpenAI client: a streamed completion under the paper's
sampling, then the speculative-decoding lines of ``/metrics``.

Start the server first. ``vllm-tokenswift serve`` is vLLM's own ``vllm serve`` with the
plugin loaded (every ``vllm serve`` flag works); on the CPU, with the default target:

    vllm-tokenswift serve "$(vllm-tokenswift paths --model)" --served-model-name smollm2 \\
        --dtype float32 --max-model-len 8192 --enforce-eager \\
        --speculative-model tokenswift --tokenswift-heads "$(vllm-tokenswift paths --heads)" \\
        --tokenswift-config '{"kv_budget": 1024, "num_speculative_tokens": 8}'

(a GPU model with published heads: ``vllm-tokenswift serve Qwen/Qwen2.5-7B --speculative-model
tokenswift --tokenswift-heads /models/TokenSwift-Qwen2.5-7B --tokenswift-config
'{"kv_budget": 4096}'``), then

    python examples/openai_client.py --max-tokens 1024

The windowed repetition penalty (paper Eq. 3) goes per request in ``extra_body``:
``"repetition_penalty"`` and, in ``"vllm_xargs"``, ``"repetition_penalty_window"``;
``min_p`` also goes there (the OpenAI API has no such field).
"""

from __future__ import annotations

import argparse
import urllib.request

#: metric name prefixes of speculative decoding: TokenSwift's own and vLLM's
SPEC_PREFIXES = ("vllm_tokenswift:", "vllm:spec_decode")


def spec_metric_lines(text: str) -> list[str]:
    """The samples of ``/metrics`` (Prometheus text) whose name starts with
    :data:`SPEC_PREFIXES`; ``# HELP``/``# TYPE`` comments and the counters' ``_created``
    timestamps left out."""
    return [line for line in text.splitlines()
            if line.startswith(SPEC_PREFIXES) and "_created" not in line.split("{")[0].split(" ")[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://localhost:8000", help="the server, without /v1")
    ap.add_argument("--prompt", default="It is a truth universally acknowledged, that")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")    # vLLM needs no key by default
    model = client.models.list().data[0].id                              # the --served-model-name
    stream = client.completions.create(
        model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=1.0, stream=True,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2,
                    "vllm_xargs": {"repetition_penalty_window": 1024}})   # penalty over the last 1,024 tokens
    for chunk in stream:
        print(chunk.choices[0].text, end="", flush=True)
    print()

    # acceptance: vllm:spec_decode_num_accepted_tokens_total / ..._num_draft_tokens_total;
    # TokenSwift's counters by source (heads, ngram, fused) and by drafting decision
    with urllib.request.urlopen(f"{args.base_url}/metrics") as r:
        print("\n".join(spec_metric_lines(r.read().decode())))


if __name__ == "__main__":
    main()
