#!/usr/bin/env python
"""Train the small demo target model that vllm-tokenswift ships, from scratch and deterministically.

What it builds (defaults = the shipped model in ``vllm_tokenswift/assets/demo-model/``):

* a byte-level BPE tokenizer (``tokenizers`` library, vocab 8192, special token
  ``<|endoftext|>`` used as BOS/EOS/PAD) trained on the training books;
* a Llama-architecture causal LM with grouped-query attention: 6 layers, hidden 384,
  6 query heads / 2 KV heads (head_dim 64), SwiGLU intermediate 1024, tied embeddings,
  RoPE theta 10000 (about 12.6M parameters, stored as float32 safetensors);
* next-token LM training on random windows of the public-domain books in
  ``/work/shared/data/pg-books/train.jsonl`` (the last two books of the file are held out
  for validation), AdamW with a warmup-stable-decay learning rate, and a sequence-length
  curriculum 512 -> 1024 -> 2048 -> 4096 (the last two during the LR cool-down) at a
  constant 4096 tokens per step.

The saved ``config.json`` has ``max_position_embeddings = 20480`` (no ``rope_scaling``):
the model is trained on windows of at most 4096 tokens and RoPE is simply extrapolated
beyond that, so that vLLM accepts ``max_model_len`` up to 20480 for long-generation demos
(4K prefix + 16K generated). The bundled model was trained with the earlier default 16384
and its limit raised to 20480 afterwards (config files only; see its PROVENANCE.md).
The end-of-run evaluation reports the validation loss per position bucket up to 16K.

Everything is deterministic for a fixed ``--seed`` and ``--threads``: model init comes
from ``torch.manual_seed``, the windows of step ``s`` from ``numpy.random.default_rng([seed, s])``
(so ``--resume`` continues bit-for-bit), and the CPU kernels run with a fixed thread
count (different thread counts can change float summation order).

Usage::

    # the shipped model (about 62 min of training compute on a shared 2-core CPU, plus ~8 min
    # for the tokenizer; see vllm_tokenswift/assets/demo-model/PROVENANCE.md)
    python docs/research/train_demo_model.py
    # 2-minute smoke test
    python docs/research/train_demo_model.py --quick --out /tmp/demo-smoke --work /tmp/demo-smoke-work
    # continue after a crash from the last checkpoint in --work
    python docs/research/train_demo_model.py --resume
    # shorten a run that is too slow: allowed from a checkpoint taken before the cool-down
    # (step < steps - cooldown); the result equals a fresh run with --steps 600
    python docs/research/train_demo_model.py --resume --steps 600

Checkpoints (model + optimizer state) go to ``--work`` (default ``runs/demo-model-work``),
never into ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]    # docs/research/ -> the checkout
DEFAULT_DATA = "/work/shared/data/pg-books/train.jsonl"
DEFAULT_OUT = str(REPO / "vllm_tokenswift" / "assets" / "demo-model")
DEFAULT_WORK = str(REPO / "runs" / "demo-model-work")
EOT = "<|endoftext|>"

# Sequence-length curriculum, in absolute step counts so that the part of a run before the
# cool-down does not depend on --steps (see build_schedule). Batch = tokens_per_step // seq_len.
SEQ_LENS = (512, 1024, 2048, 4096)
QUICK_SEQ_LENS = (256, 512, 1024, 1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=DEFAULT_DATA, help="pg-books train.jsonl ({id,title,text} per line)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output HF model folder")
    p.add_argument("--work", default=DEFAULT_WORK, help="scratch folder: token cache, checkpoints")
    p.add_argument("--steps", type=int, default=660, help="total optimizer steps")
    p.add_argument("--short-steps", type=int, default=300, help="first steps, at seq len 512")
    p.add_argument("--cooldown", type=int, default=140,
                   help="last steps: LR decays to --min-lr while training at seq len 2048 then 4096")
    p.add_argument("--long-steps", type=int, default=50, help="last steps of the cool-down at seq len 4096")
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (part of determinism)")
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1.5e-4)
    p.add_argument("--warmup", type=int, default=40, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-books", type=int, default=2, help="hold out the last N books of --data")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=20480)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and exit after this step (train in chunks / check determinism)")
    p.add_argument("--no-long-eval", action="store_true", help="skip the final 16K-position eval")
    p.add_argument("--quick", action="store_true",
                   help="~2 min smoke run: 8 books, small tokenizer, 30 short steps")
    args = p.parse_args(argv)
    if args.quick:
        # Only override what the user did not set explicitly.
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for flag, val in (("--steps", 30), ("--short-steps", 12), ("--cooldown", 10),
                          ("--long-steps", 4), ("--tokens-per-step", 2048)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), val)
        if "--vocab-size" not in given:
            args.vocab_size = 2048
        if "--warmup" not in given:
            args.warmup = 5
        if "--eval-every" not in given:
            args.eval_every = 15
        if "--ckpt-every" not in given:
            args.ckpt_every = 20
    return args


# --------------------------------------------------------------------------- data

def load_books(path: str, quick: bool):
    books = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                books.append({"id": str(d["id"]), "title": d["title"], "text": d["text"]})
    if quick:
        books = books[:6] + books[-2:]
    return books


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_settings(vocab_size: int) -> dict:
    return {
        "library": "tokenizers",
        "model": "BPE (byte-level)",
        "pre_tokenizer": "ByteLevel(add_prefix_space=False, use_regex=True) (GPT-2 split regex)",
        "decoder": "ByteLevel",
        "vocab_size": vocab_size,
        "min_frequency": 2,
        "special_tokens": [EOT],
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT,
        "add_bos_token": False,
        "trained_on": "texts of the training books only (validation books excluded)",
    }


def save_hf_tokenizer(tok, out: Path, max_len: int):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    # Portability across transformers 4.x/5.x and vLLM: name the generic fast-tokenizer class
    # (transformers 5 writes its internal "TokenizersBackend") and write special_tokens_map.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.setdefault("add_bos_token", False)
    cfg.setdefault("add_eos_token", False)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}, indent=2) + "\n")
    return fast


def patch_model_config(out: Path, rope_theta: float):
    """Also write the transformers-4.x spellings (``rope_theta``, ``torch_dtype``) next to
    transformers 5's ``rope_parameters``/``dtype`` so older loaders read the same model."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", rope_theta)
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def encode_books(tok, books, eot_id: int) -> list[np.ndarray]:
    """Token ids per book, each followed by one <|endoftext|>."""
    encs = tok.encode_batch([b["text"] for b in books], add_special_tokens=False)
    return [np.asarray(e.ids + [eot_id], dtype=np.uint16) for e in encs]


# --------------------------------------------------------------------------- schedule

def build_schedule(steps: int, short_steps: int, cooldown: int, long_steps: int, seq_lens,
                   tokens_per_step: int):
    """List of (first_step, last_step_exclusive, seq_len, batch) covering all steps.

    seq_lens[0] for the first `short_steps`, seq_lens[1] until the cool-down, then
    seq_lens[2] and, for the last `long_steps`, seq_lens[3]. Everything before
    ``steps - cooldown`` is independent of `steps`, so a run can be shortened (``--resume
    --steps N``) from a checkpoint taken before the cool-down and still be identical to a
    fresh run with ``--steps N``.
    """
    cd_start = max(0, steps - cooldown)
    long_start = max(cd_start, steps - long_steps)
    bounds = [(0, min(short_steps, cd_start), seq_lens[0]),
              (min(short_steps, cd_start), cd_start, seq_lens[1]),
              (cd_start, long_start, seq_lens[2]),
              (long_start, steps, seq_lens[3])]
    return [(a, b, s, max(1, tokens_per_step // s)) for a, b, s in bounds if b > a]


def phase_at(phases, step):
    for ph in phases:
        if ph[0] <= step < ph[1]:
            return ph
    raise IndexError(step)


def lr_at(step: int, steps: int, peak: float, floor: float, warmup: int, cooldown: int) -> float:
    """Warmup-stable-decay: linear warm-up, constant peak, cosine decay to `floor` over the
    last `cooldown` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cd_start = steps - cooldown
    if step < cd_start:
        return peak
    t = (step - cd_start + 1) / max(1, cooldown)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * min(1.0, t)))


def sample_batch(stream: np.ndarray, seed: int, step: int, batch: int, seq: int):
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return np.stack([stream[s: s + seq + 1] for s in starts]).astype(np.int64)


# --------------------------------------------------------------------------- model / eval

def make_model(args, vocab_size: int, eot_id: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        use_cache=True,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def lm_loss(model, x, reduction="mean"):
    import torch.nn.functional as F

    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                           reduction=reduction)


def evaluate(model, val_windows):
    import torch

    model.eval()
    with torch.no_grad():
        losses = [lm_loss(model, torch.from_numpy(w[None])).item() for w in val_windows]
    model.train()
    return float(np.mean(losses))


def long_eval(model, val_stream: np.ndarray, seed: int, length: int = 16384):
    """Validation loss per position bucket on one `length`-token window (RoPE extrapolation check)
    plus the mean loss over four 4096-token windows."""
    import torch

    model.eval()
    out = {}
    with torch.no_grad():
        rng = np.random.default_rng([seed, 10**7])
        starts = rng.integers(0, len(val_stream) - 4097, size=4)
        l4 = [lm_loss(model, torch.from_numpy(val_stream[s: s + 4097].astype(np.int64)[None])).item()
              for s in starts]
        out["val_loss_4096_windows"] = float(np.mean(l4))
        if len(val_stream) > length + 1:
            x = torch.from_numpy(val_stream[: length + 1].astype(np.int64)[None])
            per_tok = lm_loss(model, x, reduction="none").numpy()
            buckets = {}
            edges = [0, 512, 1024, 2048, 4096, 8192, 12288, 16384]
            for a, b in zip(edges[:-1], edges[1:]):
                if a < len(per_tok):
                    buckets[f"{a}-{b}"] = float(per_tok[a:b].mean())
            out["val_loss_by_position_16k"] = buckets
    model.train()
    return out


# --------------------------------------------------------------------------- checkpoints

def save_checkpoint(work: Path, model, opt, step, tokens_seen, train_time, losses, steps, cooldown):
    import torch

    tmp = work / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "steps": steps, "cooldown": cooldown,
                "tokens_seen": tokens_seen, "train_time": train_time, "recent_losses": losses}, tmp)
    os.replace(tmp, work / "ckpt.pt")


def human(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


# --------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch
    import transformers
    import tokenizers
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t_start = time.time()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "train_metrics.jsonl"

    # ---- data + tokenizer (cached in --work so that --resume is quick)
    books = load_books(args.data, args.quick)
    train_books, val_books = books[: -args.val_books], books[-args.val_books:]
    data_sha = file_sha256(args.data)
    tok_key = hashlib.sha256(json.dumps([data_sha, args.vocab_size, args.quick,
                                          args.val_books]).encode()).hexdigest()[:16]
    tok_path, cache_path = work / f"tokenizer-{tok_key}.json", work / f"tokens-{tok_key}.npz"
    from tokenizers import Tokenizer

    t0 = time.time()
    if tok_path.exists() and cache_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
        cached = np.load(cache_path)
        train_stream, val_stream = cached["train"], cached["val"]
        print(f"loaded cached tokenizer + tokens from {work}", flush=True)
        tok_time = float(cached["tok_time"])
    else:
        print(f"training byte-level BPE (vocab {args.vocab_size}) on {len(train_books)} books...", flush=True)
        tok = train_tokenizer([b["text"] for b in train_books], args.vocab_size)
        eot_id = tok.token_to_id(EOT)
        print(f"  tokenizer trained in {time.time() - t0:.0f}s; encoding books...", flush=True)
        train_stream = np.concatenate(encode_books(tok, train_books, eot_id))
        val_stream = np.concatenate(encode_books(tok, val_books, eot_id))
        tok_time = time.time() - t0
        tok.save(str(tok_path))
        np.savez(cache_path, train=train_stream, val=val_stream, tok_time=tok_time)
    eot_id = tok.token_to_id(EOT)
    vocab_size = tok.get_vocab_size()
    n_chars = sum(len(b["text"]) for b in train_books)
    print(f"train tokens {human(len(train_stream))} ({n_chars / len(train_stream):.2f} chars/token), "
          f"val tokens {human(len(val_stream))}, tokenizer+encode {tok_time:.0f}s", flush=True)
    save_hf_tokenizer(tok, out, args.max_position_embeddings)

    # ---- model, optimizer, schedule
    model = make_model(args, vocab_size, eot_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    phases = build_schedule(args.steps, args.short_steps, args.cooldown, args.long_steps,
                            QUICK_SEQ_LENS if args.quick else SEQ_LENS, args.tokens_per_step)
    print("curriculum: " + ", ".join(f"steps {a}-{b - 1}: {bs}x{s}" for a, b, s, bs in phases), flush=True)
    vrng = np.random.default_rng([args.seed, 10**6])
    n_val = 8 if args.quick else 16
    val_len = 512 if args.quick else 1024
    vstarts = vrng.integers(0, len(val_stream) - val_len - 1, size=n_val)
    val_windows = [val_stream[s: s + val_len + 1].astype(np.int64) for s in vstarts]

    step, tokens_seen, train_time, recent = 0, 0, 0.0, []
    ckpt = work / "ckpt.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens_seen, train_time = state["step"], state["tokens_seen"], state["train_time"]
        old_steps, old_cd = state.get("steps", args.steps), state.get("cooldown", args.cooldown)
        if (old_steps, old_cd) != (args.steps, args.cooldown) and step > min(
                old_steps - old_cd, args.steps - args.cooldown):
            raise SystemExit(f"checkpoint at step {step} is inside the cool-down of the old "
                             f"(--steps {old_steps} --cooldown {old_cd}) or new schedule; "
                             "changing --steps/--cooldown now would not match a fresh run")
        recent = state.get("recent_losses", [])
        # drop metric lines logged after the checkpoint (the checkpoint is taken after `step`
        # updates, so the line for `step` itself stays) and any final-eval line
        if metrics_path.exists():
            recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
            keep = [json.dumps(r) for r in recs
                    if r.get("step", -1) <= step and "final_eval" not in r]
            metrics_path.write_text("".join(ln + "\n" for ln in keep))
        print(f"resumed from {ckpt} at step {step}", flush=True)
    else:
        if args.resume:
            print(f"--resume: no checkpoint in {work}, starting from scratch", flush=True)
        metrics_path.write_text("")

    def log(rec):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="train", mininterval=20, dynamic_ncols=True,
               file=sys.stdout)
    last_val = None
    while step < args.steps:
        _, _, seq, bs = phase_at(phases, step)
        lr = lr_at(step, args.steps, args.lr, args.min_lr, args.warmup, args.cooldown)
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(sample_batch(train_stream, args.seed, step, bs, seq))
        t = time.time()
        loss = lm_loss(model, x)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.time() - t
        train_time += dt
        tokens_seen += bs * seq
        step += 1
        lv = loss.item()
        recent = (recent + [lv])[-20:]
        rec = {"step": step, "seq_len": seq, "batch": bs, "lr": round(lr, 8), "loss": round(lv, 5),
               "grad_norm": round(gnorm, 4), "tokens_seen": tokens_seen,
               "tok_per_s": round(bs * seq / dt, 1), "train_time_s": round(train_time, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            last_val = evaluate(model, val_windows)
            rec["val_loss"] = round(last_val, 5)
            tqdm.write(f"step {step}: train loss (avg 20) {np.mean(recent):.4f}  val loss {last_val:.4f}",
                       file=sys.stdout)
        log(rec)
        bar.set_postfix(seq=seq, loss=f"{lv:.3f}", lr=f"{lr:.2e}", tok_s=f"{bs * seq / dt:.0f}")
        bar.update(1)
        if args.stop_at is not None and step >= args.stop_at and step < args.steps:
            save_checkpoint(work, model, opt, step, tokens_seen, train_time, recent, args.steps,
                            args.cooldown)
            bar.close()
            print(f"--stop-at {args.stop_at}: checkpoint at step {step} saved to {work}; "
                  "continue with --resume", flush=True)
            return
        if step % args.ckpt_every == 0 and step < args.steps:
            save_checkpoint(work, model, opt, step, tokens_seen, train_time, recent, args.steps,
                            args.cooldown)
    bar.close()
    save_checkpoint(work, model, opt, step, tokens_seen, train_time, recent, args.steps,
                            args.cooldown)

    # ---- final evaluation + save
    final_val = last_val if last_val is not None else evaluate(model, val_windows)
    final_train = float(np.mean(recent)) if recent else None
    model.config.use_cache = True
    model.generation_config.bos_token_id = eot_id
    model.generation_config.eos_token_id = eot_id
    model.generation_config.pad_token_id = eot_id
    model.save_pretrained(str(out), safe_serialization=True)
    patch_model_config(out, args.rope_theta)
    extra = {}
    if not (args.no_long_eval or args.quick):
        print("long-context eval (4x4096 windows, one 16384 window)...", flush=True)
        try:
            extra = long_eval(model, val_stream, args.seed)
        except Exception as e:  # never lose the saved model to an eval failure
            print(f"long-context eval failed: {e!r}", flush=True)
        if extra:
            print("long-context eval: " + json.dumps(extra), flush=True)
            log({"step": step, "final_eval": extra})
    wall = time.time() - t_start

    prov = {
        "description": "vllm-tokenswift demo target model (tiny Llama, trained from scratch on CPU)",
        "command": "python docs/research/train_demo_model.py " + " ".join(shlex.quote(a) for a in
                                                                     (argv if argv is not None else sys.argv[1:])),
        "reproduce": "python docs/research/train_demo_model.py --out vllm_tokenswift/assets/demo-model "
                     f"--seed {args.seed} --threads {args.threads} --steps {args.steps} "
                     f"--short-steps {args.short_steps} --cooldown {args.cooldown} "
                     f"--long-steps {args.long_steps} --tokens-per-step {args.tokens_per_step} "
                     f"--lr {args.lr:g} --min-lr {args.min_lr:g} --warmup {args.warmup}"
                     + (" --quick" if args.quick else ""),
        "seed": args.seed,
        "threads": args.threads,
        "quick": args.quick,
        "data": {
            "file": os.path.abspath(args.data), "sha256": data_sha,
            "source": "Project Gutenberg books (public domain), pg-books corpus",
            "train_book_ids": [b["id"] for b in train_books],
            "val_book_ids": [b["id"] for b in val_books],
            "val_book_titles": [b["title"] for b in val_books],
            "train_tokens": int(len(train_stream)), "val_tokens": int(len(val_stream)),
            "train_chars": int(n_chars),
            "sampling": "uniform random windows over the concatenation of the training books "
                        "(each book followed by <|endoftext|>); windows of step s drawn with "
                        "numpy.random.default_rng([seed, s])",
        },
        "tokenizer": tokenizer_settings(vocab_size),
        "architecture": {
            "model_type": "llama", "class": "LlamaForCausalLM",
            "vocab_size": vocab_size, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "head_dim": args.hidden // args.heads, "intermediate_size": args.intermediate,
            "hidden_act": "silu", "tie_word_embeddings": True, "rope_theta": args.rope_theta,
            "rope_scaling": None, "max_position_embeddings": args.max_position_embeddings,
            "max_trained_seq_len": max(s for _, _, s, _ in phases), "rms_norm_eps": 1e-5,
            "parameters": n_params, "dtype": "float32",
        },
        "training": {
            "steps": args.steps, "tokens_per_step": args.tokens_per_step,
            "curriculum": [{"steps": [a, b - 1], "seq_len": s, "batch": bs} for a, b, s, bs in phases],
            "optimizer": {"name": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8,
                          "weight_decay": args.weight_decay, "weight_decay_on": "2-D weights only",
                          "grad_clip_norm": 1.0},
            "lr_schedule": {"peak": args.lr, "min": args.min_lr, "warmup_steps": args.warmup,
                            "shape": "warmup-stable-decay", "cooldown_steps": args.cooldown,
                            "decay": "cosine over the cool-down"},
            "tokens_seen": tokens_seen,
            "train_compute_time_s": round(train_time, 1),
            "tokenizer_and_encode_time_s": round(tok_time, 1),
            "wall_time_s_this_invocation": round(wall, 1),
            "resumed": bool(args.resume),
        },
        "results": {
            "final_train_loss_avg_last_20_steps": final_train,
            "final_val_loss": final_val,
            "val_eval": f"{n_val} fixed windows of {val_len} tokens from the validation books",
            **extra,
        },
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "numpy": np.__version__, "platform": platform.platform(), "processor": platform.processor(),
        },
    }
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    (out / "PROVENANCE.md").write_text(provenance_md(prov))
    print(f"saved model to {out} (train compute {train_time / 60:.1f} min, wall {wall / 60:.1f} min, "
          f"final train loss {final_train:.4f}, val loss {final_val:.4f})", flush=True)


def provenance_md(p: dict) -> str:
    a, t, d, r, tk = p["architecture"], p["training"], p["data"], p["results"], p["tokenizer"]
    cur = "\n".join(f"| {c['steps'][0]}-{c['steps'][1]} | {c['seq_len']} | {c['batch']} |"
                    for c in t["curriculum"])
    pos = r.get("val_loss_by_position_16k")
    pos_md = ""
    if pos:
        pos_md = ("\nValidation loss per position on one 16,384-token window of the held-out books "
                  "(positions beyond the trained length rely on RoPE extrapolation):\n\n"
                  "| positions | loss |\n| --- | ---: |\n"
                  + "\n".join(f"| {k} | {v:.3f} |" for k, v in pos.items()) + "\n")
    if "val_loss_4096_windows" in r:
        pos_md += f"\nMean validation loss over four 4,096-token windows: {r['val_loss_4096_windows']:.4f}\n"
    env = p["environment"]
    return f"""# Demo model provenance

A tiny Llama-architecture causal LM trained from scratch, deterministically, on CPU by
`docs/research/train_demo_model.py`. It is a *demo target* for vllm-tokenswift (fast to run on
CPU, long context), not a useful language model: expect locally fluent but meandering
19th-century-novel pastiche.

## Reproduce

```
{p['reproduce']}
```

Command actually run: `{p['command']}` (seed {p['seed']}, {p['threads']} torch threads).
Results are bit-reproducible for the same seed, thread count and software versions
(torch {env['torch']}, transformers {env['transformers']}, tokenizers {env['tokenizers']},
numpy {env['numpy']}, Python {env['python']}, {env['platform']}).

## Data

`{d['file']}` (sha256 `{d['sha256']}`): public-domain Project Gutenberg books.

* training: {len(d['train_book_ids'])} books ({d['train_chars']:,} characters, {d['train_tokens']:,} tokens),
  ids {', '.join(d['train_book_ids'])}
* validation (held out, the last {len(d['val_book_ids'])} books of the file): ids
  {', '.join(f"{i} ({n})" for i, n in zip(d['val_book_ids'], d['val_book_titles']))},
  {d['val_tokens']:,} tokens
* sampling: {d['sampling']}

## Tokenizer

Byte-level BPE trained with the `tokenizers` library on the training books only: vocab
{tk['vocab_size']}, min_frequency {tk['min_frequency']}, GPT-2 byte-level pre-tokenizer
(`add_prefix_space=False`), one special token `{EOT}` (id 0) used as BOS, EOS and PAD.
No BOS is added when encoding (`add_bos_token` false); a book boundary in the training
stream is marked by `{EOT}`. Saved as a `PreTrainedTokenizerFast` (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`), no chat template.

## Architecture

`LlamaForCausalLM`: {a['num_hidden_layers']} layers, hidden {a['hidden_size']}, {a['num_attention_heads']} query heads /
{a['num_key_value_heads']} KV heads (GQA, head_dim {a['head_dim']}), SwiGLU intermediate {a['intermediate_size']},
RMSNorm eps {a['rms_norm_eps']}, tied input/output embeddings, RoPE theta {a['rope_theta']:g},
**{a['parameters']:,} parameters**, stored as {a['dtype']} safetensors.

**Context length.** `max_position_embeddings` is **{a['max_position_embeddings']}** in `config.json`, but the
model was trained on windows of at most **{a['max_trained_seq_len']}** tokens. There is no `rope_scaling`:
positions beyond {a['max_trained_seq_len']} use plain RoPE extrapolation. The larger value is there so that
vLLM accepts `max_model_len` up to {a['max_position_embeddings']} for long-generation (TokenSwift) demos;
quality beyond {a['max_trained_seq_len']} tokens is not guaranteed (see the per-position loss below).

## Training

Next-token cross-entropy, {t['steps']} AdamW steps (betas {t['optimizer']['betas']}, weight decay
{t['optimizer']['weight_decay']} on 2-D weights, grad-norm clip 1.0), {t['tokens_per_step']:,} tokens per step,
warmup-stable-decay learning rate: linear warm-up over {t['lr_schedule']['warmup_steps']} steps to
{t['lr_schedule']['peak']:g}, constant, then cosine decay to {t['lr_schedule']['min']:g} over the last
{t['lr_schedule']['cooldown_steps']} steps (the cool-down, trained on long windows). Sequence-length curriculum:

| steps | seq len | batch |
| --- | ---: | ---: |
{cur}

Tokens seen: {t['tokens_seen']:,}. Training compute time {t['train_compute_time_s'] / 60:.1f} min
(tokenizer training + encoding {t['tokenizer_and_encode_time_s'] / 60:.1f} min) on a shared 2-core CPU;
wall time of the final invocation {t['wall_time_s_this_invocation'] / 60:.1f} min{' (resumed from a checkpoint)' if t['resumed'] else ''}.
Per-step metrics: `train_metrics.jsonl`.

## Results

* final train loss (mean of the last 20 steps): {r['final_train_loss_avg_last_20_steps']:.4f}
* final validation loss ({r['val_eval']}): {r['final_val_loss']:.4f}
{pos_md}
"""


if __name__ == "__main__":
    main()
