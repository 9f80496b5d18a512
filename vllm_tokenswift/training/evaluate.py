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
from dataclasses import asdict, dataclass

import torch

from vllm_tokenswift.core.heads import DraftHeads
from vllm_tokenswift.training.trainer import base_hidden_states, check_base_structure

CHAIN_NOTE = ("greedy chain [argmax l_0..l_3] from the hidden state at t computed with FULL attention "
              "(no draft KV budget, no n-gram candidates, no penalty); accepted = longest prefix equal "
              "to the true tokens t+1..t+4")


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling rule under which sampled drafts are accepted (default: the paper's,
    Sec 4.1 / 3.4: temperature 1.0, min_p 0.1, repetition penalty 1.2 over the last
    1,024 tokens)."""

    temperature: float = 1.0
    min_p: float = 0.1
    repetition_penalty: float = 1.2
    window: int = 1024


PAPER_SAMPLING = SamplingSpec()


def window_presence(ids: torch.Tensor, start: int, end: int, vocab_size: int, window: int) -> torch.Tensor:
    """Which tokens the repetition penalty hits at each position ``t`` in ``[start, end)``.

    The history of position ``t`` is ``ids[max(0, t - window + 1) : t + 1]`` (the last
    ``window`` tokens up to and including ``t``; ``window <= 0``: all of ``ids[:t+1]``),
    as the windowed penalty of :mod:`vllm_tokenswift.core.penalty` sees it when sampling the
    token after ``t``.

    Args:
        ids: ``[L]`` long token ids.
    Returns:
        ``[end - start, vocab_size]`` bool.
    """
    L = int(ids.numel())
    end = min(end, L)
    out = torch.zeros((max(0, end - start), vocab_size), dtype=torch.bool, device=ids.device)
    if end <= start:
        return out
    lo = 0 if window <= 0 else max(0, start - window + 1)
    counts = torch.bincount(ids[lo: start + 1], minlength=vocab_size)[:vocab_size].clone()
    for r, t in enumerate(range(start, end)):
        if r:
            counts[ids[t]] += 1
            if window > 0 and t - window >= 0:
                counts[ids[t - window]] -= 1
        out[r] = counts > 0
    return out


def sampling_probs(logits: torch.Tensor, presence: torch.Tensor | None, spec: SamplingSpec) -> torch.Tensor:
    """Probabilities a sampler with ``spec`` draws from: repetition penalty on the
    ``presence`` tokens (vLLM's rule: ``logit > 0 → logit/θ`` else ``logit·θ``),
    temperature, then min_p (tokens below ``min_p · max p`` removed, renormalised).

    Args:
        logits: ``[R, V]`` raw logits (any float dtype).
        presence: ``[R, V]`` bool or None (no penalty).
    Returns:
        ``[R, V]`` float32, rows summing to 1.
    """
    lg = logits.float()
    if presence is not None and spec.repetition_penalty != 1.0:
        th = spec.repetition_penalty
        lg = torch.where(presence, torch.where(lg > 0, lg / th, lg * th), lg)
    lg = lg / max(spec.temperature, 1e-5)
    p = torch.softmax(lg, dim=-1)
    if spec.min_p > 0:
        keep = p >= spec.min_p * p.amax(dim=-1, keepdim=True)
        p = p * keep
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def _as_sequences(token_ids) -> list[torch.Tensor]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 1:
            return [token_ids]
        if token_ids.dim() == 2:
            return list(token_ids)
        raise ValueError(f"token_ids must be [L] or [N, L], got {tuple(token_ids.shape)}")
    return [torch.as_tensor(s, dtype=torch.long) for s in token_ids]


def evaluate_heads(model, heads: DraftHeads, token_ids: torch.Tensor | Sequence[Sequence[int]], *,
                   chunk_size: int = 1024, topk: int = 3, progress: bool = False,
                   sampling: SamplingSpec | None = PAPER_SAMPLING) -> dict:
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
        sampling: also report, per distribution ``l_j`` (drafted at ``t``, predicting
            ``t+1+j``), the acceptance probability of a draft token *sampled* from it,
            ``Σ_v min(p(v), q(v))``, where ``q`` is ``l_j`` and ``p`` the target's
            distribution at ``t+j`` (``l_0`` there, i.e. given the true tokens up to
            ``t+j``), both under this sampling rule with the penalty history of their
            own position. That is what vLLM's rejection sampler accepts with when the
            proposer hands it ``q`` (sampled requests). ``None``: skip.
    Returns:
        ``dict`` (JSON-serialisable)::

            {"num_sequences": N, "num_tokens": Σ L, "topk": k, "num_heads": γ,
             "distributions": [{"name": "l_0 (base model)", "index": 0,
                                "predicts": "t+1", "positions": int,
                                "top1": float, "top<k>": float}, ... γ+1 entries],
             "chain": {"length": γ+1, "positions": int, "mean_accepted": float,
                       "acceptance_rate": float, "accepted_hist": [γ+2 ints],
                       "attention": "full", "definition": str},
             "sampling": {... SamplingSpec fields ...,
                          "expected_accepted_forward": float,   # Σ_k Π_{j<=k} a_j, j = 0..γ
                          "expected_accepted_fused": float}}    # Σ_k Π_{1<=j<=k} a_j

        where every distribution entry also has ``"q_acceptance"`` (mean of
        ``Σ min(p, q)``, a_j above) when ``sampling`` is given.

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
    qacc = [0.0] * ndist
    qpos = [0] * ndist
    e_fwd = e_fused = 0.0
    e_pos = 0
    vocab = int(model.lm_head.weight.shape[0])
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
                if sampling is not None:
                    a = _q_acceptance(model, final_norm, h0, ids, dists, s, e, vocab, sampling)
                    for j, (tot, cnt) in enumerate(a["per_depth"]):
                        qacc[j] += tot
                        qpos[j] += cnt
                    e_fwd += a["e_forward"]
                    e_fused += a["e_fused"]
                    e_pos += a["e_positions"]
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
        if sampling is not None:
            dist_rows[-1]["q_acceptance"] = qacc[j] / qpos[j] if qpos[j] else 0.0
    extra = {}
    if sampling is not None:
        extra["sampling"] = {**asdict(sampling),
                             "expected_accepted_forward": e_fwd / e_pos if e_pos else 0.0,
                             "expected_accepted_fused": e_fused / e_pos if e_pos else 0.0,
                             "positions": e_pos}
    return {**extra,
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


def _q_acceptance(model, final_norm, h0, ids, dists, s, e, vocab, spec: SamplingSpec) -> dict:
    """Σ min(p, q) per depth for the chunk ``[s, e)`` (see :func:`evaluate_heads`)."""
    L = int(ids.numel())
    n = len(dists)
    ext_end = min(L, e + n - 1)
    with torch.no_grad():
        base_ext = model.lm_head(final_norm(h0[s:ext_end]))          # l_0 at s..ext_end-1
        pres = window_presence(ids, s, ext_end, vocab, spec.window) if spec.repetition_penalty != 1.0 else None
        p_ext = sampling_probs(base_ext[..., :vocab], pres, spec)   # target p at every position
        c = e - s
        per_depth = []
        accs = []
        for j, lg in enumerate(dists):
            q = p_ext[:c] if j == 0 else sampling_probs(lg[..., :vocab], None if pres is None else pres[:c], spec)
            valid = min(c, ext_end - s - j)                          # target position t+j < L
            a = torch.minimum(p_ext[j: j + valid], q[:valid]).sum(-1)
            per_depth.append((float(a.sum()), int(valid)))
            accs.append(a)
        m = min(int(a.numel()) for a in accs)
        if m == 0:
            return {"per_depth": per_depth, "e_forward": 0.0, "e_fused": 0.0, "e_positions": 0}
        A = torch.stack([a[:m] for a in accs], dim=1)               # [m, n]
        e_fwd = A.cumprod(dim=1).sum(dim=1)
        e_fused = A[:, 1:].cumprod(dim=1).sum(dim=1) if n > 1 else torch.zeros(m)
    return {"per_depth": per_depth, "e_forward": float(e_fwd.sum()), "e_fused": float(e_fused.sum()),
            "e_positions": m}


def format_report(result: dict) -> str:
    """Render :func:`evaluate_heads`' result as a plain-text table."""
    k = result["topk"]
    samp = result.get("sampling")
    lines = [
        f"sequences: {result['num_sequences']}   tokens: {result['num_tokens']}",
        "",
        f"{'distribution':<18} {'predicts':>8} {'positions':>10} {'top-1':>8} {'top-' + str(k):>8}"
        + (f" {'q-accept':>9}" if samp else ""),
    ]
    for d in result["distributions"]:
        lines.append(f"{d['name']:<18} {d['predicts']:>8} {d['positions']:>10} "
                     f"{d['top1']:>8.4f} {d[f'top{k}']:>8.4f}"
                     + (f" {d['q_acceptance']:>9.4f}" if samp else ""))
    c = result["chain"]
    lines += [
        "",
        f"greedy chain of {c['length']} drafts, {c['positions']} positions (attention: {c['attention']})",
        f"  mean accepted length : {c['mean_accepted']:.4f} tokens",
        f"  acceptance rate      : {c['acceptance_rate']:.4f}  (= mean accepted / {c['length']})",
        "  accepted-length hist : " + "  ".join(f"{a}:{n}" for a, n in enumerate(c["accepted_hist"])),
        f"  note: {c['definition']}",
    ]
    if samp:
        lines += [
            "",
            f"sampled drafts (T {samp['temperature']}, min_p {samp['min_p']}, repetition penalty "
            f"{samp['repetition_penalty']} over {samp['window']} tokens): q-accept = Σ min(p, q), the "
            "rejection sampler's acceptance probability of a draft sampled from q",
            f"  expected accepted drafts, draft forward [l_0..l_{len(result['distributions']) - 1}]: "
            f"{samp['expected_accepted_forward']:.4f}",
            f"  expected accepted drafts, fused heads [l_1..l_{len(result['distributions']) - 1}]: "
            f"{samp['expected_accepted_fused']:.4f}",
        ]
    return "\n".join(lines)
