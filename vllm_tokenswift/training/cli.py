"""``vllm-tokenswift train-heads`` and ``vllm-tokenswift eval-heads``.

Heavy imports (torch, transformers) happen inside the handlers so that
building the top-level parser stays cheap. Bad input is reported as
``error: ...`` on stderr with exit code 2, before any training starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_tokenswift.cli.models import add_target_args

_DATA_HELP = ("training text: JSON Lines file with a \"text\" field per line, a .txt file, or a folder "
              "of .txt files. Each document is cut to its first --seq-len tokens")
_PACK_HELP = ("documents shorter than --seq-len are packed (concatenated, EOS-separated, cut into "
              "--seq-len-token sequences; an incomplete last one is dropped) with --pack (default), "
              "or skipped with --no-pack (the paper's recipe; PG-19 books are all longer than 8K)")


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_parser(subparsers) -> None:
    """Add the ``train-heads`` and ``eval-heads`` sub-parsers (each sets ``func``)."""
    tr = subparsers.add_parser(
        "train-heads",
        help="train the 3 dependent TokenSwift draft heads on a frozen base model",
        description=(
            "Train TokenSwift's dependent draft heads (paper Sec 3.2; recipe of Sec 4.1: first 8K "
            "tokens per document, lr 5e-3, cosine, 200 steps) on a frozen Hugging Face causal LM "
            "(Llama/Qwen2 layout). Head i predicts token t+1+i from the base model's pre-final-norm "
            "hidden state at t. Writes OUT/tokenswift_heads.json + OUT/heads.safetensors, "
            "OUT/metrics.jsonl (one JSON line per step), OUT/training_curves.png and a resumable "
            "OUT/checkpoint/."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_target_args(tr, heads=None, yarn_note=" (the same overrides as generate/bench --yarn); the "
                                              "base model is frozen")
    tr.add_argument("--data", required=True, help=_DATA_HELP)
    tr.add_argument("--out", required=True, help="output folder for the heads, logs and checkpoint")
    tr.add_argument("--seq-len", type=_positive_int, default=8192,
                    help="tokens per training sequence (<= the model's max_position_embeddings)")
    tr.add_argument("--steps", type=_positive_int, default=200, help="optimizer updates")
    tr.add_argument("--batch-size", type=_positive_int, default=1, help="sequences per forward")
    tr.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per update")
    tr.add_argument("--lr", type=float, default=5e-3, help="peak AdamW learning rate")
    tr.add_argument("--weight-decay", type=float, default=0.1,
                    help="AdamW weight decay on the head matrices (not on norm weights)")
    tr.add_argument("--warmup", type=int, default=50, help="linear warm-up updates before cosine decay")
    tr.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    tr.add_argument("--num-heads", type=_positive_int, default=3, help="number of draft heads (gamma)")
    tr.add_argument("--chunk-size", type=_positive_int, default=1024,
                    help="positions per loss chunk; bounds logits memory to 3 x chunk x vocab")
    tr.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    tr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="base model dtype (auto: bfloat16 on CUDA, float32 on CPU; heads stay float32)")
    tr.add_argument("--seed", type=int, default=0, help="seed for RNGs and the data order")
    tr.add_argument("--max-docs", type=_positive_int, default=None, help="read at most N documents")
    tr.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True, help=_PACK_HELP)
    tr.add_argument("--windows-per-doc", type=_positive_int, default=1, metavar="W",
                    help="take each document's first W x --seq-len tokens as W sequences (the paper's "
                         "first 8K tokens per book at --seq-len 2048: W = 4)")
    tr.add_argument("--tokenizer", default=None, help="tokenizer folder/id (unset: the model's)")
    tr.add_argument("--export-tokenswift", metavar="DIR", default=None,
                    help="also write the published TokenSwift layout (model.medusa_layers.{i}.*) to DIR")
    tr.add_argument("--targets", choices=["tokens", "distill"], default="tokens",
                    help="tokens: cross-entropy against the true token t+1+i (the paper); distill: "
                         "self-distillation against the base model's own distribution of that token")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/")
    tr.add_argument("--overwrite", action="store_true",
                    help="start over even though OUT/checkpoint/ exists")
    tr.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    tr.add_argument("--stop-after", type=_positive_int, default=None,
                    help="stop after N steps in this invocation (checkpoint saved; continue with --resume)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=run_train)

    ev = subparsers.add_parser(
        "eval-heads",
        help="per-head accuracy and greedy-chain acceptance of draft heads on held-out text (no vLLM)",
        description=(
            "Evaluate draft heads on held-out text without vLLM: top-1/top-k accuracy of l_0 (the base "
            "model, predicts t+1) and of every head l_i (predicts t+1+i), and the acceptance of the "
            "greedy chain [argmax l_0, ..., argmax l_3] drafted at every position from hidden states "
            "computed with FULL attention (no draft KV budget, no n-grams): accepted length = longest "
            "prefix equal to the true tokens t+1..t+4; acceptance rate = mean accepted / 4."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_target_args(ev, heads="heads folder (project format or TokenSwift layout; default: the heads "
                              "bundled for --model), or 'zero' for untrained heads (W_i = 0), which "
                              "repeat the base model's prediction at every depth",
                    yarn_note=" (the same overrides as generate/bench --yarn)")
    ev.add_argument("--num-heads", type=_positive_int, default=3, help="number of heads with --heads zero")
    ev.add_argument("--data", required=True, help=_DATA_HELP.replace("training", "held-out"))
    ev.add_argument("--seq-len", type=_positive_int, default=8192, help="tokens per evaluated sequence")
    ev.add_argument("--max-docs", type=_positive_int, default=None, help="read at most N documents")
    ev.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True, help=_PACK_HELP)
    ev.add_argument("--windows-per-doc", type=_positive_int, default=1, metavar="W",
                    help="evaluate each document's first W x --seq-len tokens as W sequences")
    ev.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    ev.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="model and heads dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ev.add_argument("--topk", type=_positive_int, default=3, help="k of the top-k accuracy")
    ev.add_argument("--chunk-size", type=_positive_int, default=1024, help="positions per LM-head chunk")
    ev.add_argument("--tokenizer", default=None, help="tokenizer folder/id (unset: the model's)")
    ev.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=run_eval)


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _resolve(args: argparse.Namespace, want_heads: bool) -> dict | None:
    """``--model`` names -> folders (``smollm2`` is converted on first use); ``--heads``
    defaults to the model's bundled heads; ``--yarn`` -> config overrides.

    Raises:
        TrainHeadsError: the model cannot be fetched or YaRN does not apply.
    """
    from vllm_tokenswift.cli.models import ModelFetchError, resolve_target, yarn_overrides
    from vllm_tokenswift.training.data import TrainHeadsError

    try:
        model, heads = resolve_target(args.model, getattr(args, "heads", None) if want_heads else None)
        args.model = model
        if want_heads:
            if heads is None:
                raise TrainHeadsError(f"no heads bundled for {model}: pass --heads FOLDER (or 'zero')")
            args.heads = heads
        return yarn_overrides(model, args.yarn) if args.yarn else None
    except (ModelFetchError, ValueError) as e:
        raise TrainHeadsError(str(e)) from None


def run_train(args: argparse.Namespace) -> int:
    """Handler of ``train-heads``; returns the exit code (0 ok, 2 bad input, 130 interrupted)."""
    from vllm_tokenswift.core.heads import HeadsLoadError
    from vllm_tokenswift.training.data import TrainHeadsError
    from vllm_tokenswift.training.trainer import train_heads

    try:
        overrides = _resolve(args, want_heads=False)
        res = train_heads(
            args.model, args.data, args.out, seq_len=args.seq_len, steps=args.steps,
            batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
            weight_decay=args.weight_decay, warmup=args.warmup, max_grad_norm=args.max_grad_norm,
            num_heads=args.num_heads, chunk_size=args.chunk_size, device=args.device, dtype=args.dtype,
            seed=args.seed, max_docs=args.max_docs, pack=args.pack, tokenizer_path=args.tokenizer,
            export_tokenswift=args.export_tokenswift, resume=args.resume, overwrite=args.overwrite,
            save_every=args.save_every, stop_after=args.stop_after, progress=not args.no_progress,
            targets=args.targets, config_overrides=overrides, windows_per_doc=args.windows_per_doc,
        )
    except (TrainHeadsError, HeadsLoadError) as e:
        return _err(str(e))
    except KeyboardInterrupt:
        print(f"interrupted; continue from the last checkpoint with --resume (--out {args.out})",
              file=sys.stderr)
        return 130
    print(f"sequences: {res.num_sequences} x {res.seq_len} tokens; steps {res.steps_done}/{res.steps_total}; "
          f"{res.elapsed_s:.1f} s")
    if res.final_loss is not None:
        print(f"final loss {res.final_loss:.4f}  per-head loss "
              + " ".join(f"{x:.4f}" for x in res.final_head_loss)
              + "  per-head top-1 " + " ".join(f"{x:.4f}" for x in res.final_head_acc))
    if not res.completed:
        print(f"stopped early; checkpoint in {res.checkpoint_dir}; continue with --resume")
        return 0
    print(f"heads: {res.heads_dir}")
    if res.export_dir:
        print(f"TokenSwift layout: {res.export_dir}")
    print(f"metrics: {res.metrics_path}")
    if res.plot_path:
        print(f"plot: {res.plot_path}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Handler of ``eval-heads``; returns the exit code (0 ok, 2 bad input)."""
    from vllm_tokenswift.core.heads import HeadsLoadError, load_heads
    from vllm_tokenswift.training.data import TrainHeadsError, check_data_path, load_token_sequences
    from vllm_tokenswift.training.evaluate import evaluate_heads, format_report
    from vllm_tokenswift.training.trainer import (inspect_base_model, load_base_model, resolve_device,
                                                  resolve_dtype)

    try:
        check_data_path(args.data)
        overrides = _resolve(args, want_heads=True)
        dev = resolve_device(args.device)
        dt = resolve_dtype(args.dtype, dev)
        config = inspect_base_model(args.model, args.seq_len, overrides)
        model, tok = load_base_model(args.model, device=dev, dtype=dt, tokenizer_path=args.tokenizer,
                                     config_overrides=overrides)
        eps = float(getattr(config, "rms_norm_eps", 1e-6) or 1e-6)
        if args.heads == "zero":  # untrained heads: every head repeats the base prediction
            from vllm_tokenswift.core.heads import zero_heads

            heads = zero_heads(model, args.num_heads, dtype=dt)
        else:
            heads = load_heads(args.heads, hidden_size=int(config.hidden_size), eps=eps, dtype=dt, device=dev)
        seqs = load_token_sequences(args.data, tok, args.seq_len, pack=args.pack, max_docs=args.max_docs,
                                    windows_per_doc=args.windows_per_doc)
    except (TrainHeadsError, HeadsLoadError) as e:
        return _err(str(e))
    res = evaluate_heads(model, heads, seqs, chunk_size=args.chunk_size, topk=args.topk,
                         progress=not args.no_progress)
    res.update({"model": str(args.model), "heads": str(args.heads), "data": str(args.data),
                "seq_len": args.seq_len, "dtype": str(dt).replace("torch.", ""), "device": str(dev)})
    print(format_report(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}")
    return 0
