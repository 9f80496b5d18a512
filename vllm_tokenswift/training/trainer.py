"""Train TokenSwift's dependent draft heads on a frozen base model (paper Sec 3.2, Sec 4.1).

What is trained (γ = ``num_heads`` = 3)::

    h_0 = last hidden state of the base model BEFORE its final norm     [B, L, H]
    h_i = h_{i-1} + W_i · RMSNorm_in_i(h_{i-1})                          i = 1..γ
    l_i = lm_head(RMSNorm_post_i(h_i))                                   [B, L, V]
    loss = Σ_i mean_t CE(l_i[t], x[t + 1 + i])

Only ``W_i`` and the two RMSNorm weights of every head are trained; the base
model (including ``lm_head``) is frozen. ``h_0`` is captured with a forward
pre-hook on ``model.model.norm`` (Hugging Face's ``hidden_states[-1]`` is
*after* the final norm for Llama/Qwen2 in transformers 5, so it is not used).

Efficiency:

* one base forward per micro-batch, under ``torch.no_grad``, shared by all heads;
* the heads + ``lm_head`` + cross-entropy run over chunks of ``chunk_size``
  positions and each chunk is back-propagated at once (``h_0`` is detached), so
  the ``[L, V]`` logits of the γ heads never exist together: peak extra memory
  is about ``γ · chunk_size · V`` floats (plus their gradients);
* bf16 base model on CUDA (heads kept in fp32, matmuls under bf16 autocast,
  cross-entropy in fp32), fp32 on CPU;
* gradient accumulation normalises by the exact number of target tokens of the
  whole update, so ``batch_size=2, grad_accum=1`` equals ``1 × 2`` up to float
  rounding.

Optimiser: AdamW (``lr`` 5e-3, weight decay 0.1 on the ``W_i`` only, not on
the norm weights), linear warm-up then half-cosine decay (paper: 200 steps,
here 50 warm-up), gradient clipping at 1.0. The data order is a pure function
of ``(seed, step)`` so a run resumed from ``out/checkpoint/`` (``resume=True``)
continues bit-for-bit like an uninterrupted one on the same device.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_tokenswift.core.heads import DraftHeads, export_tokenswift_layout, save_heads, zero_heads
from vllm_tokenswift.training.data import TrainHeadsError, check_data_path, load_token_sequences
# re-exported: the base-model helpers moved to base_model.py
from vllm_tokenswift.training.base_model import (_looks_like_hub_id, base_hidden_states,  # noqa: F401
                                                 check_base_structure, inspect_base_model, load_base_model,
                                                 resolve_device, resolve_dtype)
from vllm_tokenswift.training.checkpoint import (_RESUME_KEYS, CHECKPOINT_DIR, CHECKPOINT_FILE,  # noqa: F401
                                                 CHECKPOINT_VERSION, _check_resume, _load_checkpoint,
                                                 _rng_state, _save_checkpoint, _set_rng_state, plot_metrics)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
IGNORE_INDEX = -100


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# ================================================================== loss
@dataclass
class HeadsLossStats:
    """Sums over the positions of one call of :func:`heads_loss` (per head).

    ``loss_sum[i]``: Σ cross-entropy (nats) of head i+1; ``correct[i]``: top-1
    hits; ``count[i]``: target tokens; ``loss``: the (scaled) objective that was
    back-propagated, as a float.
    """

    loss_sum: list[float]
    correct: list[int]
    count: list[int]
    loss: float = 0.0


def head_targets(input_ids: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
    """Targets of every head: head i (1-based) at position t predicts ``x[t+1+i]``.

    Args:
        input_ids: ``torch.long`` ``[B, L]``.
    Returns:
        ``num_heads`` tensors ``[B, L]`` (long) holding ``x[t+1+i]`` or
        ``-100`` (ignored) where ``t+1+i >= L``.
    """
    B, L = input_ids.shape
    out = []
    for i in range(1, num_heads + 1):
        off = i + 1
        t = torch.full((B, L), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
        if off < L:
            t[:, : L - off] = input_ids[:, off:]
        out.append(t)
    return out


def heads_loss(heads: DraftHeads, lm_head: torch.nn.Module, h0: torch.Tensor, input_ids: torch.Tensor, *,
               chunk_size: int | None = 1024, normalizer: list[float] | None = None,
               backward: bool = True, amp_dtype: torch.dtype = torch.float32,
               distill_norm: torch.nn.Module | None = None) -> HeadsLossStats:
    """Chunked multi-head cross-entropy, back-propagated chunk by chunk (Sec 3.2).

    The objective is ``Σ_i CE_sum_i / normalizer[i]`` (``normalizer`` defaults
    to this call's target counts, i.e. the per-head mean). The ``B·L``
    positions are processed in chunks of ``chunk_size`` rows; for each chunk
    the heads, ``lm_head`` and the fp32 cross-entropy are computed and, with
    ``backward=True``, ``backward()`` is called on that chunk's share, so
    gradients accumulate into the heads' ``.grad`` while only one chunk's
    ``[chunk, V]`` logits per head are alive. Mathematically identical to the
    unchunked loss (``chunk_size=None``).

    Args:
        heads: the draft heads (trainable).
        lm_head: the base model's frozen LM head (``[V, H]`` weight).
        h0: ``[B, L, H]`` pre-final-norm hidden states (detached).
        input_ids: ``torch.long`` ``[B, L]``, the tokens ``h0`` was computed from.
        chunk_size: positions per chunk (``None``: all at once).
        normalizer: per-head divisor (e.g. the target count of the whole
            accumulated update); default: this call's counts.
        backward: call ``backward`` per chunk (else only compute the numbers).
        amp_dtype: autocast dtype for the heads/LM head (fp32: no autocast).
        distill_norm: self-distillation (the base model's final norm): head i at t is
            trained towards the base model's own distribution of token ``t+1+i``,
            ``softmax(lm_head(FinalNorm(h0[t+i])))`` (soft cross-entropy, which equals
            the KL divergence up to a constant), instead of the one-hot true token. The
            targets are the model's own predictions given the true prefix, so the heads
            learn what the target would sample, which is what a sampled draft must
            match (Medusa-2's self-distillation objective). ``None``: hard targets.
    Returns:
        :class:`HeadsLossStats` (sums, top-1 hits against the true tokens, counts,
        objective value; with ``distill_norm`` the loss sums are soft cross-entropies).
    """
    n = heads.num_heads
    B, L, H = h0.shape
    flat = h0.reshape(B * L, H).detach()
    targets = [t.reshape(B * L) for t in head_targets(input_ids, n)]
    counts = [int((t != IGNORE_INDEX).sum()) for t in targets]
    norm = list(normalizer) if normalizer is not None else [float(max(c, 1)) for c in counts]
    rows = B * L
    step = rows if not chunk_size else max(1, int(chunk_size))
    loss_sum = [0.0] * n
    correct = [0] * n
    total = 0.0
    for s in range(0, rows, step):
        e = min(rows, s + step)
        tg = [t[s:e] for t in targets]
        if all(bool((t == IGNORE_INDEX).all()) for t in tg):
            continue
        soft = None
        if distill_norm is not None:
            with torch.no_grad(), _autocast(h0.device, amp_dtype):
                # l_0 at rows s+1 .. e+n-1: the base model's prediction of t+1+i is l_0 at t+i
                ext = min(rows, e + n)
                soft = torch.softmax(lm_head(distill_norm(flat[s + 1: ext])).float(), dim=-1)
        ctx = torch.enable_grad() if backward else torch.no_grad()
        with ctx, _autocast(h0.device, amp_dtype):
            outs = heads(flat[s:e])
            chunk_obj = None
            for i in range(n):
                logits = lm_head(outs[i]).float()
                if soft is None:
                    ce = F.cross_entropy(logits, tg[i], ignore_index=IGNORE_INDEX, reduction="sum")
                else:
                    # head i+1 (0-based i) at row t predicts t+2+i: the base model's
                    # distribution of it is l_0 at row t+1+i = soft[(t - s) + i]; rows with a
                    # valid hard target (t+2+i < L, same sequence) have it
                    valid = tg[i] != IGNORE_INDEX
                    tgt = soft[i: i + (e - s)]
                    if tgt.shape[0] < e - s:
                        valid = valid.clone()
                        valid[tgt.shape[0]:] = False
                        tgt = torch.cat([tgt, tgt.new_zeros((e - s - tgt.shape[0], tgt.shape[1]))])
                    logq = torch.log_softmax(logits, dim=-1)
                    ce = -(tgt * logq).sum(-1)[valid].sum()
                with torch.no_grad():
                    valid = tg[i] != IGNORE_INDEX
                    correct[i] += int(((logits.argmax(-1) == tg[i]) & valid).sum())
                    loss_sum[i] += float(ce)
                term = ce / norm[i]
                chunk_obj = term if chunk_obj is None else chunk_obj + term
        total += float(chunk_obj.detach())
        if backward:
            chunk_obj.backward()
    return HeadsLossStats(loss_sum=loss_sum, correct=correct, count=counts, loss=total)


def lr_factor(update: int, steps: int, warmup: int) -> float:
    """Learning-rate multiplier of update ``update`` (0-based) out of ``steps``.

    Linear warm-up ``(k / warmup)`` for the first ``warmup`` updates
    (``k = update + 1``, so no update runs at lr 0), then a half cosine from 1
    towards 0 over the remaining ``steps - warmup`` updates.
    """
    k = update + 1
    if warmup > 0 and k <= warmup:
        return k / warmup
    span = steps - warmup
    if span <= 0:
        return 1.0
    prog = min(1.0, (k - warmup - 1) / span)
    return 0.5 * (1.0 + math.cos(math.pi * prog))


def batch_indices(update: int, micro: int, *, batch_size: int, grad_accum: int, num_sequences: int,
                  seed: int, _cache: dict | None = None) -> list[int]:
    """Sequence indices of micro-batch ``micro`` of update ``update`` (both 0-based).

    Sequences are visited in a fresh seeded permutation per epoch
    (``torch.randperm`` with seed ``seed * 1_000_003 + epoch``), so the data
    order depends on ``(seed, update)`` only, which makes resuming exact.
    """
    cache = _cache if _cache is not None else {}
    out = []
    base = (update * grad_accum + micro) * batch_size
    for b in range(batch_size):
        p = base + b
        epoch, pos = divmod(p, num_sequences)
        if epoch not in cache:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            cache[epoch] = torch.randperm(num_sequences, generator=g).tolist()
        out.append(cache[epoch][pos])
    return out


# ================================================================ result
@dataclass
class TrainResult:
    """Outcome of :func:`train_heads`.

    Attributes:
        out_dir: the output folder.
        heads_dir: folder of the saved heads (project format; == ``out_dir``), or
            ``None`` when the run stopped early (``stop_after``).
        export_dir: TokenSwift-layout export folder, if requested and completed.
        metrics_path: JSON-lines metrics log (one line per update).
        plot_path: PNG of loss / accuracy curves (``None`` if not written).
        checkpoint_dir: ``out_dir/checkpoint`` (resumable state).
        steps_done: updates completed so far (including resumed ones).
        steps_total: updates configured.
        completed: ``steps_done == steps_total``.
        final_loss: objective (Σ of per-head mean CE, nats) of the last update.
        final_head_loss: per-head mean CE (nats) of the last update.
        final_head_acc: per-head top-1 accuracy (0..1) of the last update.
        num_sequences: training sequences of ``seq_len`` tokens available.
        seq_len: L.
        tokens_per_step: ``batch_size · grad_accum · seq_len``.
        elapsed_s: wall time of this call's training loop (seconds).
        heads: the trained :class:`DraftHeads` (fp32, on the training device).
    """

    out_dir: Path
    heads_dir: Path | None
    export_dir: Path | None
    metrics_path: Path
    plot_path: Path | None
    checkpoint_dir: Path
    steps_done: int
    steps_total: int
    completed: bool
    final_loss: float | None
    final_head_loss: list[float]
    final_head_acc: list[float]
    num_sequences: int
    seq_len: int
    tokens_per_step: int
    elapsed_s: float
    heads: DraftHeads | None = field(default=None, repr=False)


def _read_base_config(model_path: str, model) -> dict:
    p = Path(model_path) / "config.json"
    if p.is_file():
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            pass
    return model.config.to_dict()


def _validate_args(*, seq_len, steps, batch_size, grad_accum, lr, weight_decay, warmup, chunk_size,
                   num_heads, save_every, max_grad_norm, stop_after, max_docs) -> None:
    def bad(msg):
        raise TrainHeadsError(msg)

    if num_heads < 1:
        bad(f"num_heads must be >= 1, got {num_heads}")
    if seq_len < num_heads + 2:
        bad(f"--seq-len must be at least {num_heads + 2} (head {num_heads} predicts t+{num_heads + 1}), "
            f"got {seq_len}")
    if steps < 1:
        bad(f"--steps must be >= 1, got {steps}")
    if batch_size < 1:
        bad(f"--batch-size must be >= 1, got {batch_size}")
    if grad_accum < 1:
        bad(f"--grad-accum must be >= 1, got {grad_accum}")
    if not (lr > 0 and math.isfinite(lr)):
        bad(f"--lr must be a positive number, got {lr}")
    if weight_decay < 0:
        bad(f"--weight-decay must be >= 0, got {weight_decay}")
    if warmup < 0:
        bad(f"--warmup must be >= 0, got {warmup}")
    if chunk_size is not None and chunk_size < 1:
        bad(f"--chunk-size must be >= 1, got {chunk_size}")
    if save_every < 0:
        bad(f"--save-every must be >= 0, got {save_every}")
    if max_grad_norm < 0:
        bad(f"--max-grad-norm must be >= 0, got {max_grad_norm}")
    if stop_after is not None and stop_after < 1:
        bad(f"--stop-after must be >= 1, got {stop_after}")
    if max_docs is not None and max_docs < 1:
        bad(f"--max-docs must be >= 1, got {max_docs}")


# ================================================================= train
def train_heads(model_path: str | os.PathLike, data: str | os.PathLike | torch.Tensor,
                out_dir: str | os.PathLike, *, seq_len: int = 8192, steps: int = 200,
                batch_size: int = 1, grad_accum: int = 1, lr: float = 5e-3, weight_decay: float = 0.1,
                warmup: int = 50, max_grad_norm: float = 1.0, num_heads: int = 3,
                chunk_size: int | None = 1024, device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None, seed: int = 0, max_docs: int | None = None,
                pack: bool = True, tokenizer_path: str | None = None,
                export_tokenswift: str | os.PathLike | None = None, resume: bool = False,
                overwrite: bool = False, save_every: int = 50, stop_after: int | None = None,
                progress: bool = True, log: Callable[[str], None] | None = None,
                targets: str = "tokens", config_overrides: dict | None = None,
                windows_per_doc: int = 1) -> TrainResult:
    """Train the γ dependent draft heads of TokenSwift on a frozen base model (Sec 3.2, 4.1).

    Head i (1..γ) reads the base model's pre-final-norm hidden state at
    position t and is trained with cross-entropy to predict token ``t+1+i``;
    the objective is the sum over heads of the per-head mean CE (nats).

    Args:
        model_path: HF causal LM folder (or hub id) with ``model.model.layers``,
            ``model.model.norm`` and ``lm_head`` (Llama, Qwen2, Mistral, ...).
        data: ``.jsonl`` (``{"text": ...}`` per line), ``.txt`` file or folder of
            ``.txt`` files; or a pre-tokenized ``torch.long`` tensor ``[N, seq_len]``.
        out_dir: output folder: heads (``tokenswift_heads.json`` +
            ``heads.safetensors``), ``metrics.jsonl``, ``training_curves.png``,
            ``checkpoint/``.
        seq_len: L, tokens per training sequence (paper: 8192); each document's
            first L tokens. Must be ``<= max_position_embeddings``.
        steps: optimizer updates (paper: 200).
        batch_size: sequences per forward (micro-batch).
        grad_accum: micro-batches per update (an update sees
            ``batch_size · grad_accum`` sequences).
        lr: peak AdamW learning rate (paper: 5e-3).
        weight_decay: AdamW decoupled weight decay on the ``W_i`` (norm weights
            are not decayed).
        warmup: linear warm-up updates before the cosine decay.
        max_grad_norm: gradient-norm clipping (0: off).
        num_heads: γ (3 in the paper).
        chunk_size: positions per loss chunk (memory bound, see :func:`heads_loss`).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``None``/``"auto"``.
        dtype: base-model dtype; default bf16 on CUDA, fp32 on CPU. Heads are
            always kept and saved in fp32.
        seed: seeds torch/python RNGs and the data order.
        max_docs: read at most this many documents.
        pack: pack documents shorter than L (EOS-separated) into L-token
            sequences (default) instead of skipping them (paper).
        windows_per_doc: consecutive L-token windows taken from the start of each
            document (:func:`~vllm_tokenswift.training.data.build_sequences`); the
            paper's first 8K tokens per book at L = 2048 is 4.
        tokenizer_path: tokenizer to use (default: the model's).
        export_tokenswift: also write the published TokenSwift layout
            (``model.medusa_layers.{i}.*``) to this folder.
        targets: ``"tokens"`` (the paper: cross-entropy against the true token) or
            ``"distill"`` (self-distillation: against the base model's own distribution
            of that token, see :func:`heads_loss`' ``distill_norm``).
        config_overrides: set on the base model's config before it is built (e.g. YaRN,
            :func:`vllm_tokenswift.cli.models.yarn_overrides`, to train at the extended window).
        resume: continue from ``out_dir/checkpoint`` (settings must match the
            checkpoint's; a missing checkpoint starts a fresh run).
        overwrite: allow a fresh run in an ``out_dir`` that holds a checkpoint.
        save_every: checkpoint every N updates (0: only at the end / stop).
        stop_after: stop after this many updates *in this call* (checkpoint
            saved, ``completed=False``); for pre-emptible jobs, continue with
            ``resume=True``.
        progress: show a tqdm progress bar (loss, per-head top-1 accuracy).
        log: callable for one-line status messages (default: print to stderr).
    Returns:
        :class:`TrainResult`.
    Raises:
        TrainHeadsError: before any update, for a missing/empty/unreadable data
            file, a model without the needed layers or config, ``seq_len``
            beyond ``max_position_embeddings``, an unavailable device, invalid
            numbers, an existing checkpoint without ``resume``/``overwrite``,
            or a checkpoint whose settings differ from this call's.
    """
    say = log or (lambda m: print(m, file=sys.stderr))
    _validate_args(seq_len=seq_len, steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                   weight_decay=weight_decay, warmup=warmup, chunk_size=chunk_size, num_heads=num_heads,
                   save_every=save_every, max_grad_norm=max_grad_norm, stop_after=stop_after,
                   max_docs=max_docs)
    if targets not in ("tokens", "distill"):
        raise TrainHeadsError(f"targets must be 'tokens' or 'distill', got {targets!r}")
    if not isinstance(data, torch.Tensor):
        check_data_path(data)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config = inspect_base_model(model_path, seq_len, config_overrides)

    out = Path(out_dir)
    ckpt_dir = out / CHECKPOINT_DIR
    ckpt_file = ckpt_dir / CHECKPOINT_FILE
    if ckpt_file.exists() and not resume and not overwrite:
        raise TrainHeadsError(
            f"{ckpt_file} exists: pass --resume to continue that run or --overwrite to start over")
    ckpt = None
    if resume:
        if ckpt_file.exists():
            ckpt = _load_checkpoint(ckpt_file)
            # cheap settings first, before loading the model (the rest once the data is read)
            _check_resume(ckpt, {
                "seq_len": seq_len, "steps": steps, "batch_size": batch_size, "grad_accum": grad_accum,
                "lr": lr, "weight_decay": weight_decay, "warmup": warmup, "seed": seed,
                "num_heads": num_heads, "max_grad_norm": max_grad_norm, "pack": pack, "max_docs": max_docs,
                "hidden_size": int(config.hidden_size)})
        else:
            say(f"note: no checkpoint in {ckpt_dir}, starting a fresh run")

    model, tok = load_base_model(model_path, device=dev, dtype=dt, tokenizer_path=tokenizer_path,
                                 load_tokenizer=not isinstance(data, torch.Tensor),
                                 config_overrides=config_overrides)
    hidden = int(config.hidden_size)
    vocab = int(model.lm_head.weight.shape[0])
    if isinstance(data, torch.Tensor):
        seqs = data.to(torch.long).cpu()
        if seqs.dim() != 2 or seqs.shape[1] != seq_len or seqs.shape[0] == 0:
            raise TrainHeadsError(f"token tensor must be [N>0, {seq_len}], got {tuple(seqs.shape)}")
        if int(seqs.max()) >= vocab or int(seqs.min()) < 0:
            raise TrainHeadsError(f"token ids outside the model's vocabulary [0, {vocab})")
    else:
        seqs = load_token_sequences(data, tok, seq_len, pack=pack, max_docs=max_docs,
                                    windows_per_doc=windows_per_doc)
    num_seq = int(seqs.shape[0])

    run_config = {
        "model_path": str(model_path), "data": str(data) if not isinstance(data, torch.Tensor) else "<tensor>",
        "seq_len": seq_len, "steps": steps, "batch_size": batch_size, "grad_accum": grad_accum, "lr": lr,
        "weight_decay": weight_decay, "warmup": warmup, "seed": seed, "num_heads": num_heads,
        "max_grad_norm": max_grad_norm, "pack": pack, "max_docs": max_docs, "num_sequences": num_seq,
        "windows_per_doc": windows_per_doc, "hidden_size": hidden, "vocab_size": vocab, "chunk_size": chunk_size, "device": str(dev),
        "dtype": str(dt).replace("torch.", ""), "targets": targets,
    }
    if ckpt is not None:
        _check_resume(ckpt, run_config)

    # ---------------------------------------------------------------- state
    torch.manual_seed(seed)
    random.seed(seed)
    heads = zero_heads(model, num_heads, dtype=torch.float32)  # W = 0: the base prediction
    heads.train()
    decay = [hd.linear.weight for hd in heads.heads]
    no_decay = [p for hd in heads.heads for p in (hd.input_layernorm, hd.post_layernorm)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: lr_factor(u, steps, warmup))
    start = 0
    last: dict | None = None
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILE
    if ckpt is not None:
        heads.load_state_dict(ckpt["heads"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        _set_rng_state(ckpt["rng"], dev)
        start = int(ckpt["step"])
        last = ckpt.get("last_metrics")
        kept = []
        if metrics_path.exists():
            kept = [line for line in metrics_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start]
        metrics_path.write_text("".join(line + "\n" for line in kept))
        say(f"resuming from {ckpt_file} at step {start}/{steps}")
    else:
        metrics_path.write_text("")
        if overwrite and ckpt_dir.exists():
            shutil.rmtree(ckpt_dir)

    lm_head = model.lm_head
    tokens_per_step = batch_size * grad_accum * seq_len
    # exact per-head target counts of one update -> grad-accum equals a big batch
    normalizer = [float(batch_size * grad_accum * (seq_len - (i + 2))) for i in range(num_heads)]
    perm_cache: dict = {}
    end = steps if stop_after is None else min(steps, start + stop_after)

    bar = None
    if progress and start < end:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start, desc="train-heads", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        with metrics_path.open("a") as mlog:
            for update in range(start, end):
                cur_lr = opt.param_groups[0]["lr"]
                opt.zero_grad(set_to_none=True)
                tot = HeadsLossStats([0.0] * num_heads, [0] * num_heads, [0] * num_heads)
                for micro in range(grad_accum):
                    idx = batch_indices(update, micro, batch_size=batch_size, grad_accum=grad_accum,
                                        num_sequences=num_seq, seed=seed, _cache=perm_cache)
                    ids = seqs[idx].to(dev)
                    h0 = base_hidden_states(model, ids)
                    st = heads_loss(heads, lm_head, h0, ids, chunk_size=chunk_size, normalizer=normalizer,
                                    distill_norm=model.model.norm if targets == "distill" else None,
                                    backward=True, amp_dtype=dt)
                    for i in range(num_heads):
                        tot.loss_sum[i] += st.loss_sum[i]
                        tot.correct[i] += st.correct[i]
                        tot.count[i] += st.count[i]
                    tot.loss += st.loss
                    del h0
                if max_grad_norm > 0:
                    gnorm = float(torch.nn.utils.clip_grad_norm_(heads.parameters(), max_grad_norm))
                else:
                    gnorm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in heads.parameters()
                                                if p.grad is not None)))
                opt.step()
                sched.step()
                head_loss = [tot.loss_sum[i] / max(tot.count[i], 1) for i in range(num_heads)]
                head_acc = [tot.correct[i] / max(tot.count[i], 1) for i in range(num_heads)]
                last = {"step": update + 1, "lr": cur_lr, "loss": sum(head_loss), "head_loss": head_loss,
                        "head_acc": head_acc, "grad_norm": gnorm, "tokens": tokens_per_step * (update + 1),
                        "elapsed_s": round(time.perf_counter() - t0, 3)}
                mlog.write(json.dumps(last) + "\n")
                mlog.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{last['loss']:.3f}",
                                    acc="/".join(f"{a:.2f}" for a in head_acc), lr=f"{cur_lr:.1e}")
                done = update + 1
                if save_every and done % save_every == 0 and done < end:
                    _save_checkpoint(ckpt_dir, step=done, heads=heads, opt=opt, sched=sched, device=dev,
                                     run_config=run_config, last=last)
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0
    done = max(start, end)
    if end > start or ckpt is None:
        _save_checkpoint(ckpt_dir, step=done, heads=heads, opt=opt, sched=sched, device=dev,
                         run_config=run_config, last=last)

    completed = done >= steps
    heads_dir = export_dir = plot_path = None
    if completed:
        meta = {
            "base_model": str(model_path),
            "trained_with": "vllm-tokenswift train-heads",
            "steps": steps, "seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum,
            "lr": lr, "weight_decay": weight_decay, "warmup": warmup, "seed": seed,
            "num_sequences": num_seq, "pack": pack, "windows_per_doc": windows_per_doc,
            "targets": targets, "data": run_config["data"],
            "final_loss": last["loss"] if last else None,
            "final_head_loss": last["head_loss"] if last else None,
            "final_head_acc": last["head_acc"] if last else None,
        }
        heads_dir = save_heads(heads, out, dtype=torch.float32, metadata=meta)
        if export_tokenswift is not None:
            export_dir = export_tokenswift_layout(heads, export_tokenswift,
                                                  base_config=_read_base_config(str(model_path), model),
                                                  dtype=torch.float32)
        plot_path = plot_metrics(metrics_path, out / PLOT_FILE)
    heads.eval()
    return TrainResult(
        out_dir=out, heads_dir=heads_dir, export_dir=export_dir, metrics_path=metrics_path,
        plot_path=plot_path, checkpoint_dir=ckpt_dir, steps_done=done, steps_total=steps,
        completed=completed, final_loss=last["loss"] if last else None,
        final_head_loss=list(last["head_loss"]) if last else [],
        final_head_acc=list(last["head_acc"]) if last else [], num_sequences=num_seq, seq_len=seq_len,
        tokens_per_step=tokens_per_step, elapsed_s=elapsed, heads=heads,
    )
