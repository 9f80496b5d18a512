"""Self-distillation data for draft heads: text the target model writes itself under the
paper's sampling (temperature 1.0, min_p 0.1, repetition penalty 1.2 over 1,024 tokens).

Each sample starts from a ``--prefix-len``-token window of a training book (seeded offset)
and continues it with vLLM (plain decoding, batched) for ``--gen-len`` tokens. Output:
JSON Lines with ``{"text": prefix + continuation, "book": id, "offset": int}``, usable as
``vllm-tokenswift train-heads --data OUT --targets distill``.

    python docs/research/generate_distill_data.py --model "$(vllm-tokenswift paths --model)" \\
        --books ../shared/data/pg-books/train.jsonl --max-books 101 --num 64 --out runs/distill.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--books", required=True, help="JSON Lines with a 'text' field per book")
    ap.add_argument("--max-books", type=int, default=101, help="use the first N books (the rest are held out)")
    ap.add_argument("--num", type=int, default=64, help="samples to generate")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=1792)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    books = []
    with open(args.books) as fh:
        for i, line in enumerate(fh):
            if i >= args.max_books:
                break
            books.append(json.loads(line))
    rng = random.Random(args.seed)
    prompts, meta = [], []
    for i in range(args.num):
        b = books[i % len(books)]
        ids = tok(b["text"][:200_000], add_special_tokens=False)["input_ids"]
        off = rng.randrange(512, max(513, len(ids) - args.prefix_len))
        prompts.append({"prompt_token_ids": ids[off: off + args.prefix_len]})
        meta.append({"book": b.get("id"), "offset": off})
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.prefix_len + args.gen_len + 8,
              seed=args.seed, kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
              enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, max_tokens=args.gen_len,
                            ignore_eos=True, extra_args={"repetition_penalty_window": 1024})
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    with open(args.out, "w") as fh:
        for p, o, m in zip(prompts, outs, meta):
            ids = list(p["prompt_token_ids"]) + list(o.outputs[0].token_ids)
            fh.write(json.dumps({"text": tok.decode(ids), **m}) + "\n")
    print(f"{len(outs)} samples, {n_tok} generated tokens in {dt:.0f} s ({n_tok / dt:.1f} tok/s) -> {args.out}")


if __name__ == "__main__":
    main()
