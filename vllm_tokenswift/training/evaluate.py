"""Offline evaluation of draft heads on held-out text, without vLLM (paper Sec 3.2, Eq. 4).

For every position t of every held-out sequence, with the base model's FULL
causal attention over the sequence (no budgeted draft KV view, no n-grams, no
sampling penalty)::

    l_0 = lm_head(FinalNorm(h_0))            predicts x[t+1]   (the base model)
    l_i = lm_head(RMSNorm_post_i(h_i))       predicts x[t+1+i] (head i = 1..γ)

Reported per distribution: top-1 and top-k (default 3, the paper's tree width)
accuracy. Reported for the chain the proposer would draft greedily,
``[argmax l_0, argmax l_1, ..., argmax l_γ]``: the accepted length, i.e. the
longest prefix equal to the true tokens ``x[t+1..t+1+γ]`` (0..γ+1), its mean,
histogram, and the acceptance rate ``mean / (γ+1)`` — Eq. 4's α for one greedy
chain per step, evaluated at every position (teacher forcing on the reference
text rather than on the model's own generation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_tokenswift.heads import DraftHeads
from vllm_tokenswift.training.trainer import base_hidden_states, check_base_structure

CHAIN_NOTE = ("greedy chain [argmax l_0..l_3] from the hidden state at t computed with FULL attention "
              "(no draft KV budget, no n-gram candidates, no penalty); accepted = longest prefix equal "
              "to the true tokens t+1..t+4")


def _as_sequences(token_ids) -> list[torch.Tensor]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 1:
            return [token_ids]
        if token_ids.dim() == 2:
            return list(token_ids)
        raise ValueError(f"token_ids must be [L] or [N, L], got {tuple(token_ids.shape)}")
    return [torch.as_tensor(s, dtype=torch.long) for s in token_ids]


def evaluate_heads(model, heads: DraftHeads, token_ids: torch.Tensor | Sequence[Sequence[int]], *,
                   chunk_size: int = 1024, topk: int = 3, progress: bool = False) -> dict:
    """Per-head accuracy and greedy-chain acceptance of draft heads (Sec 3.2, Eq. 4).

    Args:
        model: frozen HF causal LM with ``model.model.norm`` and ``lm_head``
            (see :func:`vllm_tokenswift.training.trainer.check_base_structure`).
        heads: :class:`DraftHeads` for that model (any dtype/device; inputs are
            cast to the heads' dtype and head outputs to the LM head's dtype).
        token_ids: ``torch.long`` ``[N, L]`` or ``[L]``, or a list of token-id
            sequences (lengths may differ; each needs ``> γ + 1`` tokens to
            contribute chain positions).
        chunk_size: positions per LM-head chunk (bounds memory to
            ``(γ+1) · chunk_size · V`` logits).
        topk: k of the top-k accuracy (the paper's tree uses 3 candidates per head).
        progress: tqdm bar over sequences.
    Returns:
        ``dict`` (JSON-serialisable)::

            {"num_sequences": N, "num_tokens": Σ L, "topk": k, "num_heads": γ,
             "distributions": [{"name": "l_0 (base model)", "index": 0,
                                "predicts": "t+1", "positions": int,
                                "top1": float, "top<k>": float}, ... γ+1 entries],
             "chain": {"length": γ+1, "positions": int, "mean_accepted": float,
                       "acceptance_rate": float, "accepted_hist": [γ+2 ints],
                       "attention": "full", "definition": str}}

        Accuracies and the acceptance rate are fractions in [0, 1];
        ``mean_accepted`` is in tokens (0..γ+1).
    """
    check_base_structure(model)
    seqs = _as_sequences(token_ids)
    n = heads.num_heads
    ndist = n + 1
    dev = model.lm_head.weight.device
    lm_dtype = model.lm_head.weight.dtype
    hd_dtype = next(heads.parameters()).dtype
    final_norm = model.model.norm
    pos = [0] * ndist
    top1 = [0] * ndist
    topkc = [0] * ndist
    hist = [0] * (ndist + 1)
    chain_pos = 0
    it = seqs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(seqs, desc="eval-heads", unit="seq")
    was_training = heads.training
    heads.eval()
    with torch.no_grad():
        for seq in it:
            ids = seq.to(dev, torch.long).reshape(-1)
            L = int(ids.numel())
            if L < 2:
                continue
            h0 = base_hidden_states(model, ids[None])[0]  # [L, H]
            step = max(1, int(chunk_size))
            for s in range(0, L - 1, step):
                e = min(L - 1, s + step)
                h = h0[s:e]
                dists = [model.lm_head(final_norm(h))]
                dists += [model.lm_head(o.to(lm_dtype)) for o in heads(h.to(hd_dtype))]
                am = []
                t = torch.arange(s, e, device=dev)
                for j, logits in enumerate(dists):
                    tgt_pos = t + 1 + j
                    valid = tgt_pos < L
                    tgt = ids[tgt_pos.clamp(max=L - 1)]
                    kk = min(topk, logits.shape[-1])
                    top = logits.float().topk(kk, dim=-1).indices  # [c, k]
                    hit1 = (top[:, 0] == tgt) & valid
                    hitk = (top == tgt[:, None]).any(-1) & valid
                    pos[j] += int(valid.sum())
                    top1[j] += int(hit1.sum())
                    topkc[j] += int(hitk.sum())
                    am.append(top[:, 0] == tgt)
                chain_valid = (t + ndist) < L  # all γ+1 targets exist
                if bool(chain_valid.any()):
                    match = torch.stack(am, dim=1)[chain_valid]  # [c', γ+1]
                    acc_len = match.long().cumprod(dim=1).sum(dim=1)
                    hist_t = torch.bincount(acc_len, minlength=ndist + 1)
                    for a in range(ndist + 1):
                        hist[a] += int(hist_t[a])
                    chain_pos += int(chain_valid.sum())
    if was_training:
        heads.train()
    mean_acc = sum(a * c for a, c in enumerate(hist)) / chain_pos if chain_pos else 0.0
    dist_rows = []
    for j in range(ndist):
        dist_rows.append({
            "name": "l_0 (base model)" if j == 0 else f"l_{j} (head {j})",
            "index": j,
            "predicts": f"t+{j + 1}",
            "positions": pos[j],
            "top1": top1[j] / pos[j] if pos[j] else 0.0,
            f"top{topk}": topkc[j] / pos[j] if pos[j] else 0.0,
        })
    return {
        "num_sequences": len(seqs),
        "num_tokens": int(sum(int(s.numel()) for s in seqs)),
        "topk": topk,
        "num_heads": n,
        "distributions": dist_rows,
        "chain": {
            "length": ndist,
            "positions": chain_pos,
            "mean_accepted": mean_acc,
            "acceptance_rate": mean_acc / ndist,
            "accepted_hist": hist,
            "attention": "full",
            "definition": CHAIN_NOTE.replace("l_3", f"l_{n}").replace("t+4", f"t+{ndist}"),
        },
    }


def format_report(result: dict) -> str:
    """Render :func:`evaluate_heads`' result as a plain-text table."""
    k = result["topk"]
    lines = [
        f"sequences: {result['num_sequences']}   tokens: {result['num_tokens']}",
        "",
        f"{'distribution':<18} {'predicts':>8} {'positions':>10} {'top-1':>8} {'top-' + str(k):>8}",
    ]
    for d in result["distributions"]:
        lines.append(f"{d['name']:<18} {d['predicts']:>8} {d['positions']:>10} "
                     f"{d['top1']:>8.4f} {d[f'top{k}']:>8.4f}")
    c = result["chain"]
    lines += [
        "",
        f"greedy chain of {c['length']} drafts, {c['positions']} positions (attention: {c['attention']})",
        f"  mean accepted length : {c['mean_accepted']:.4f} tokens",
        f"  acceptance rate      : {c['acceptance_rate']:.4f}  (= mean accepted / {c['length']})",
        "  accepted-length hist : " + "  ".join(f"{a}:{n}" for a, n in enumerate(c["accepted_hist"])),
        f"  note: {c['definition']}",
    ]
    return "\n".join(lines)
