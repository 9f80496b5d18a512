"""Resumable training state and the training curves: the heads, optimiser, scheduler and
RNG states of a run saved every few updates (``checkpoint/state.pt``) and checked
against the run's settings on resume, and ``training_curves.png`` from
``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from vllm_tokenswift.training.data import TrainHeadsError

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILE = "state.pt"
CHECKPOINT_VERSION = 1
#: run settings that must match when resuming (anything else may change).
_RESUME_KEYS = ("seq_len", "steps", "batch_size", "grad_accum", "lr", "weight_decay", "warmup", "targets",
                "seed", "num_heads", "max_grad_norm", "pack", "max_docs", "num_sequences", "windows_per_doc",
                "hidden_size", "vocab_size")


def _rng_state(device: torch.device) -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: dict, device: torch.device) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def _save_checkpoint(ckpt_dir: Path, *, step: int, heads, opt, sched, device, run_config, last) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "heads": {k: v.detach().cpu() for k, v in heads.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": _rng_state(device),
        "config": run_config,
        "last_metrics": last,
    }
    tmp = ckpt_dir / (CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, ckpt_dir / CHECKPOINT_FILE)
    (ckpt_dir / "run_config.json").write_text(json.dumps(run_config, indent=2) + "\n")


def _check_resume(ckpt: dict, now: dict) -> None:
    old = ckpt.get("config", {})
    diff = [f"{k}: checkpoint {old.get(k)!r} vs now {now[k]!r}"
            for k in _RESUME_KEYS if k in now and old.get(k) != now[k]]
    if diff:
        raise TrainHeadsError("cannot resume, settings differ from the checkpoint's: " + "; ".join(diff))


def _load_checkpoint(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise TrainHeadsError(f"cannot read checkpoint {path}: {e}") from None


def plot_metrics(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """Plot loss and per-head top-1 accuracy over steps from a metrics JSONL file.

    Returns:
        the PNG path, or ``None`` if matplotlib is missing or the log is empty.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    n = len(rows[0]["head_loss"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["loss"] for r in rows], label="total (Σ heads)", color="black")
    for i in range(n):
        ax1.plot(steps, [r["head_loss"][i] for r in rows], label=f"head {i + 1} (t+{i + 2})")
        ax2.plot(steps, [r["head_acc"][i] for r in rows], label=f"head {i + 1} (t+{i + 2})")
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy (nats)")
    ax1.set_title("draft-head training loss")
    ax1.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 accuracy")
    ax2.set_ylim(0, 1)
    ax2.set_title("per-head top-1 accuracy")
    ax2.legend()
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
