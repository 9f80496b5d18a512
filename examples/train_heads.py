"""Training TokenSwift draft heads for a model, for ``LLM(speculative_config={"model": ...})``.

TokenSwift drafts with 3 small linear heads on the target's own last hidden state (paper
Sec 3.2): head i, from position t, predicts the token at t + 1 + i. The base model stays
frozen; only the heads (one ``hidden × hidden`` layer each) are trained, so a few hundred
steps on one GPU are enough for a 7B model. The output folder is what
``speculative_config["model"]`` (or ``--tokenswift-heads`` of ``vllm-tokenswift serve``) takes.

    python examples/train_heads.py --model tiny --out /tmp/my-heads       # a minute on a CPU
    python examples/train_heads.py --model /models/Qwen2.5-7B --data books.jsonl \\
        --seq-len 8192 --steps 200 --batch-size 1 --out heads-qwen          # the paper's recipe

``--data`` is a ``.jsonl`` file (``{"text": ...}`` per line), a ``.txt`` file or a folder of
them; the default is the book openings bundled with the package (a toy corpus: real heads
want thousands of long documents). The same from the shell: ``vllm-tokenswift train-heads``,
then ``vllm-tokenswift eval-heads`` for per-head accuracy on held-out text
(docs/training.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import vllm_tokenswift
from vllm_tokenswift.cli.models import resolve_target

BUNDLED_BOOKS = Path(vllm_tokenswift.__file__).parent / "assets" / "prompts"


def main(argv: list[str] | None = None):
    """Train and save the heads; returns the ``TrainResult``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (the bundled 12.6M demo model), smollm2, or a folder / hub id")
    ap.add_argument("--data", default=str(BUNDLED_BOOKS), help="training text (default: the bundled book openings)")
    ap.add_argument("--out", required=True, help="output folder: the heads, metrics.jsonl, training curves")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (paper: 8192)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer updates (paper: 200)")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per update (paper: 1)")
    args = ap.parse_args(argv)

    from vllm_tokenswift.training import train_heads   # imports torch and transformers

    model, _ = resolve_target(args.model)          # "tiny" / "smollm2" -> a model folder
    res = train_heads(model, args.data, args.out, seq_len=args.seq_len, steps=args.steps,
                      batch_size=args.batch_size, warmup=max(1, args.steps // 10),
                      lr=5e-3,                    # the paper's peak learning rate (AdamW, cosine decay)
                      overwrite=True,             # start over if --out holds an earlier run's checkpoint
                      progress=False)
    acc = ", ".join(f"head {i + 1} {a:.2f}" for i, a in enumerate(res.final_head_acc))
    print(f"trained {res.steps_done} steps on {res.num_sequences} sequences of {res.seq_len} tokens "
          f"in {res.elapsed_s:.0f} s; last step's loss {res.final_loss:.3f}, top-1 accuracy: {acc}")
    print(f"heads: {res.heads_dir}")
    # use them: the model they were trained on, these heads as the speculative "model"
    print(f'LLM(model="{model}", speculative_config={{"method": "tokenswift", "model": "{res.heads_dir}", '
          f'"num_speculative_tokens": 4, "tokenswift": {{"kv_budget": 1024}}}})')
    return res


if __name__ == "__main__":
    main()
