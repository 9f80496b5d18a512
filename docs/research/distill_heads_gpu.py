"""Self-distilled SmolLM2 heads on one GPU, without vLLM: data, training and evaluation in one run.

The bundled SmolLM2 heads were trained on 86K tokens on a 2-core CPU. When a GPU is lent,
this script does the same recipe (``--targets distill``: soft targets from the model's own
distribution, Medusa-2's objective; README "Training heads") at about 16 times the data:

``prepare`` (here, on the CPU; needs the tokenizer)
    Cuts the prompts from the books and writes them as token ids to one ``.npz``:
    ``train_prompts`` ``[N, P]`` (256-token windows at seeded offsets of the first 101 books,
    the rule of ``docs/research/generate_distill_data.py``), ``heldout_prompts`` ``[M, P]`` (the
    two held-out books, seed 1) and ``heldout_windows`` ``[W, 2048]`` (book text, the first
    windows of the held-out books, as ``eval-heads --windows-per-doc 4`` cuts them).
    All ``uint16`` (SmolLM2's vocabulary has 49,152 tokens).

``run`` (on the GPU machine; needs torch, transformers and the ``gguf`` package)
    1. dequantises the GGUF (optionally given in parts, concatenated and checked against
       its sha256) with transformers' GGUF loader into a float32 folder;
    2. continues every prompt for ``--gen-len`` tokens under the paper's sampling
       (temperature 1.0, min_p 0.1, repetition penalty 1.2 over the last 1,024 tokens;
       :func:`vllm_tokenswift.training.evaluate.sampling_probs`, the rule the heads are
       evaluated under), batched, with the KV cache, ignoring EOS;
    3. trains the heads on the training samples (:func:`vllm_tokenswift.training.train_heads`,
       ``targets="distill"``);
    4. evaluates zero heads, the bundled heads and the new heads on the held-out generated
       samples and on the held-out book windows (:func:`evaluate_heads`).
    Writes ``heads.safetensors`` + ``tokenswift_heads.json`` (load with ``"model": DIR``),
    ``metrics.jsonl``, ``training_curves.png``, ``eval.json``, ``ids.npz`` (every generated
    sample, ``uint16``) and ``summary.json`` to ``--out``.

``run --smoke`` builds a random 2-layer Llama and runs every stage in seconds (checks the
machine's transformers/torch before the real run).

    python docs/research/distill_heads_gpu.py prepare --books ../shared/data/pg-books/train.jsonl \\
        --num 768 --out .gpub/prompts.npz
    python docs/research/distill_heads_gpu.py run --gguf-parts .gpua/part0 .gpub/part1 \\
        --gguf-sha256 HEX --prompts .gpub/prompts.npz --out $OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]    # docs/research/ -> the checkout
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ prepare (CPU, tokenizer)
def prepare(args) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.books) as fh:
        books = [json.loads(line) for line in fh if line.strip()]
    train, held = books[:args.train_books], books[-args.heldout_books:]
    cache: dict[int, list[int]] = {}

    def ids_of(book_list, i):
        key = id(book_list[i])
        if key not in cache:
            cache[key] = tok(book_list[i]["text"][:200_000], add_special_tokens=False)["input_ids"]
        return cache[key]

    def prompts(book_list, num, seed):
        rng = random.Random(seed)
        out = []
        for i in range(num):
            ids = ids_of(book_list, i % len(book_list))
            off = rng.randrange(512, max(513, len(ids) - args.prefix_len))
            out.append(ids[off: off + args.prefix_len])
        return np.asarray(out, dtype=np.uint16)

    tr = prompts(train, args.num, args.seed)
    hp = prompts(held, args.heldout_num, args.seed + 1)
    from vllm_tokenswift.training.data import build_sequences

    # the windows `eval-heads --seq-len 2048 --windows-per-doc 4` evaluates on these books
    wn = build_sequences((b["text"] for b in held), tok, args.window_len, pack=False,
                         windows_per_doc=args.windows_per_doc).numpy().astype(np.uint16)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, train_prompts=tr, heldout_prompts=hp, heldout_windows=wn,
                        heldout_books=np.asarray([str(b.get("id")) for b in held]))
    log(f"train prompts {tr.shape}, held-out prompts {hp.shape}, held-out windows {wn.shape} -> {args.out}")


# ------------------------------------------------------------------ run (GPU)
def assemble_gguf(parts: list[str], sha256: str | None, dest: Path) -> Path:
    """Concatenate the GGUF parts into ``dest`` and check the sha256 (raises ``SystemExit``)."""
    h = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for p in parts:
            if not Path(p).is_file():
                raise SystemExit(f"GGUF part {p!r} is missing (was the machine given back between calls?)")
            data = Path(p).read_bytes()
            h.update(data)
            out.write(data)
    if sha256 and h.hexdigest() != sha256:
        raise SystemExit(f"GGUF sha256 {h.hexdigest()} != expected {sha256}")
    return dest


def convert(gguf_path: Path, folder: Path) -> Path:
    """Dequantise with transformers' GGUF loader and save a float32 HF folder, model and
    tokenizer (:func:`vllm_tokenswift.cli.models.convert_gguf`, as ``--model smollm2`` does)."""
    from vllm_tokenswift.cli.models import convert_gguf

    convert_gguf(gguf_path, folder)
    return folder


def smoke_model(folder: Path, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder


def generate(model, prompts, gen_len: int, batch: int, seed: int, progress: bool = True, spec=None):
    """Continue ``prompts`` (``[N, P]`` long) for ``gen_len`` tokens under ``spec`` (default: the
    paper's sampling, :data:`vllm_tokenswift.training.evaluate.PAPER_SAMPLING`).

    Every step samples from :func:`~vllm_tokenswift.training.evaluate.sampling_probs` of the
    last position's logits, with the repetition penalty on the tokens of the last
    ``spec.window`` tokens of prompt + output (the history
    :func:`~vllm_tokenswift.training.evaluate.window_presence` gives), kept as per-row token
    counts on the device. EOS is not special. Rows run in batches of ``batch`` with the KV cache.

    Returns:
        ``[N, P + gen_len]`` long on the CPU (the prompts, then the samples).
    """
    import torch

    from vllm_tokenswift.training.evaluate import PAPER_SAMPLING, sampling_probs

    spec = spec or PAPER_SAMPLING

    dev = next(model.parameters()).device
    V = int(model.config.vocab_size)
    N, P = prompts.shape
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    outs = []
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    for s in range(0, N, batch):
        ids = prompts[s: s + batch].to(dev)
        b = ids.shape[0]
        seq = torch.empty((b, P + gen_len), dtype=torch.long, device=dev)
        seq[:, :P] = ids
        counts = torch.zeros((b, V), dtype=torch.int32, device=dev)
        hist = ids[:, -spec.window:] if spec.window > 0 else ids
        counts.scatter_add_(1, hist, torch.ones_like(hist, dtype=torch.int32))
        one = torch.ones((b, 1), dtype=torch.int32, device=dev)
        with torch.no_grad():
            o = model.model(input_ids=ids, use_cache=True)
            cache = o.past_key_values
            logits = model.lm_head(o.last_hidden_state[:, -1])
            bar = tqdm(range(gen_len), desc=f"generate {s}-{s + b}", mininterval=10,
                       disable=not progress) if tqdm else range(gen_len)
            for i in bar:
                n = P + i
                probs = sampling_probs(logits, counts > 0, spec)
                tok = torch.multinomial(probs, 1, generator=g)
                seq[:, n] = tok[:, 0]
                counts.scatter_add_(1, tok, one)
                if spec.window > 0 and n - spec.window >= 0:
                    counts.scatter_add_(1, seq[:, n - spec.window: n - spec.window + 1], -one)
                if i == gen_len - 1:
                    break
                o = model.model(input_ids=tok, past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                logits = model.lm_head(o.last_hidden_state[:, -1])
        outs.append(seq.cpu())
        del cache, o, counts, seq
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return torch.cat(outs)


def evaluate_sets(model_dir: Path, heads_dirs: dict, sets: dict, device, dtype, chunk: int) -> dict:
    import torch

    from vllm_tokenswift.core.heads import load_heads, zero_heads
    from vllm_tokenswift.training.evaluate import evaluate_heads
    from vllm_tokenswift.training.trainer import inspect_base_model, load_base_model

    config = inspect_base_model(model_dir, None)
    model, _ = load_base_model(model_dir, device=device, dtype=dtype, load_tokenizer=False)
    eps = float(getattr(config, "rms_norm_eps", 1e-6) or 1e-6)
    res = {}
    for name, path in heads_dirs.items():
        if path == "zero":
            heads = zero_heads(model, 3, dtype=dtype)
        else:
            heads = load_heads(path, hidden_size=int(config.hidden_size), eps=eps, dtype=dtype, device=device)
        for sname, ids in sets.items():
            t0 = time.perf_counter()
            r = evaluate_heads(model, heads, ids, chunk_size=chunk)
            res[f"{name}/{sname}"] = r
            log(f"eval {name} on {sname}: {time.perf_counter() - t0:.0f} s")
        del heads
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return res


def summarise(ev: dict) -> list[str]:
    """One line per (heads, set): top-1 and q-accept per distribution, expected accepted drafts."""
    lines = []
    for key, r in ev.items():
        d = r["distributions"]
        parts = [f"{key:<18}", "top-1 " + " ".join(f"{x['top1']:.3f}" for x in d)]
        if "sampling" in r:
            parts.append("q-accept " + " ".join(f"{x['q_acceptance']:.3f}" for x in d))
            parts.append(f"fused {r['sampling']['expected_accepted_fused']:.3f}")
            parts.append(f"forward {r['sampling']['expected_accepted_forward']:.3f}")
        lines.append(" | ".join(parts))
    return lines


def run(args) -> None:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}"
        + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    if args.smoke:
        vocab = 512
        model_dir = smoke_model(work / "smoke-model", vocab)
        gen = torch.Generator().manual_seed(0)
        tr = torch.randint(0, vocab, (12, 16), generator=gen)
        hp = torch.randint(0, vocab, (4, 16), generator=gen)
        wn = torch.randint(0, vocab, (2, 64), generator=gen)
        bundled = None
    else:
        data = np.load(args.prompts)
        tr = torch.from_numpy(data["train_prompts"].astype(np.int64))
        hp = torch.from_numpy(data["heldout_prompts"].astype(np.int64))
        wn = torch.from_numpy(data["heldout_windows"].astype(np.int64))
        if args.num:
            tr = tr[:args.num]
        if args.eval_limit:
            hp, wn = hp[:args.eval_limit], wn[:args.eval_limit]
        model_dir = work / "model"
        if args.model:
            model_dir = Path(args.model)
        else:
            gguf = assemble_gguf(args.gguf_parts, args.gguf_sha256, work / "gguf" / args.gguf_name)
            log(f"GGUF assembled ({gguf.stat().st_size} bytes); converting")
            convert(gguf, model_dir)
        bundled = str(REPO / "vllm_tokenswift" / "assets" / "smollm2-heads")
    log(f"model folder {model_dir} ready ({time.perf_counter() - t_start:.0f} s); "
        f"{tr.shape[0]} training + {hp.shape[0]} held-out prompts of {tr.shape[1]} tokens")

    # 2. generation (one batch stream: the held-out prompts ride along with the training ones)
    from transformers import AutoModelForCausalLM

    gdt = torch.bfloat16 if (dev.type == "cuda" and args.gen_dtype == "bfloat16") else torch.float32
    gm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=gdt).to(dev).eval()
    gen_len = args.gen_len if not args.smoke else 48
    t0 = time.perf_counter()
    allp = torch.cat([tr, hp])
    ids = generate(gm, allp, gen_len, args.gen_batch, args.seed, progress=not args.no_progress)
    dt = time.perf_counter() - t0
    n_gen = ids.shape[0] * gen_len
    log(f"generated {ids.shape[0]} x {gen_len} = {n_gen} tokens in {dt:.0f} s ({n_gen / dt:.0f} tok/s)")
    del gm
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    train_ids, held_ids = ids[: tr.shape[0]], ids[tr.shape[0]:]
    np.savez_compressed(out / "ids.npz", train=train_ids.numpy().astype(np.uint16),
                        heldout=held_ids.numpy().astype(np.uint16))

    # 3. training
    from vllm_tokenswift.training import train_heads

    seq_len = int(train_ids.shape[1])
    t0 = time.perf_counter()
    res = train_heads(str(model_dir), train_ids, work / "heads", seq_len=seq_len,
                      steps=args.steps if not args.smoke else 3, batch_size=args.batch_size,
                      lr=args.lr, warmup=args.warmup if not args.smoke else 1, device=str(dev),
                      dtype=args.train_dtype, seed=args.seed, targets="distill",
                      chunk_size=args.chunk_size, save_every=0, progress=False, overwrite=True,
                      log=lambda m: log(m))
    t_train = time.perf_counter() - t0
    log(f"trained {res.steps_done} steps in {t_train:.0f} s, final loss {res.final_loss}")
    heads_dir = Path(res.heads_dir)
    for f in ("heads.safetensors", "tokenswift_heads.json"):
        if (heads_dir / f).exists():
            (out / f).write_bytes((heads_dir / f).read_bytes())
    for f in (res.metrics_path, res.plot_path):
        if f and Path(f).exists():
            (out / Path(f).name).write_bytes(Path(f).read_bytes())

    # 4. evaluation
    edt = torch.float32 if args.eval_dtype == "float32" else torch.bfloat16
    heads_dirs = {"zero": "zero", "new": str(heads_dir)}
    if bundled:
        heads_dirs["bundled"] = bundled
    sets = {"generated": held_ids, "books": wn}
    ev = evaluate_sets(model_dir, heads_dirs, sets, dev, edt, args.chunk_size)
    with open(out / "eval.json", "w") as fh:
        json.dump(ev, fh, indent=1)
    summary = {"generated_tokens": n_gen, "gen_seconds": dt, "train_seconds": t_train,
               "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seq_len": seq_len,
               "train_sequences": int(train_ids.shape[0]), "heldout_sequences": int(held_ids.shape[0]),
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "total_seconds": time.perf_counter() - t_start, "final_loss": res.final_loss}
    with open(out / "summary.json", "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
    for line in summarise(ev):
        print(line)
    log(f"done in {time.perf_counter() - t_start:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="cut the prompts (CPU, tokenizer)")
    pp.add_argument("--model", default=os.path.expanduser("~/.cache/vllm-tokenswift/models/SmolLM2-135M-Instruct"))
    pp.add_argument("--books", required=True)
    pp.add_argument("--train-books", type=int, default=101)
    pp.add_argument("--heldout-books", type=int, default=2)
    pp.add_argument("--num", type=int, default=768)
    pp.add_argument("--heldout-num", type=int, default=16)
    pp.add_argument("--prefix-len", type=int, default=256)
    pp.add_argument("--window-len", type=int, default=2048)
    pp.add_argument("--windows-per-doc", type=int, default=4)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--out", required=True)
    rp = sub.add_parser("run", help="generate, train and evaluate (GPU)")
    rp.add_argument("--smoke", action="store_true")
    rp.add_argument("--gguf-parts", nargs="+", default=[])
    rp.add_argument("--gguf-sha256", default=None)
    rp.add_argument("--gguf-name", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    rp.add_argument("--model", default=None, help="an already converted model folder instead of the GGUF")
    rp.add_argument("--prompts", default=None)
    rp.add_argument("--num", type=int, default=0, help="use the first N training prompts (0: all)")
    rp.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N held-out samples/windows")
    rp.add_argument("--gen-len", type=int, default=1792)
    rp.add_argument("--gen-batch", type=int, default=392)
    rp.add_argument("--gen-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    rp.add_argument("--steps", type=int, default=300)
    rp.add_argument("--batch-size", type=int, default=8)
    rp.add_argument("--lr", type=float, default=5e-3)
    rp.add_argument("--warmup", type=int, default=30)
    rp.add_argument("--train-dtype", default="bfloat16")
    rp.add_argument("--eval-dtype", default="float32", choices=["bfloat16", "float32"])
    rp.add_argument("--chunk-size", type=int, default=2048)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--work", default="/tmp/distill-work")
    rp.add_argument("--no-progress", action="store_true")
    rp.add_argument("--out", required=True)
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    main()
