"""Draft distributions and draws (paper Sec 3.4 on the draft side): each request's
repetition penalty, temperature and min_p on the draft logits, the per-request draws from
the resulting distribution q, and the buffer of q that vLLM's rejection sampler reads.

Losslessness rests on one rule: a sampled draft token is drawn from exactly the q handed to
vLLM with it (standard speculative sampling then accepts it with ``min(1, p/q)`` and
resamples from ``(p - q)+``); a token chosen deterministically (greedy rows, n-gram
candidates) is handed over as a point mass, which is vLLM's own treatment of custom drafts.
How q is shaped (penalty, temperature, min_p) only affects how often drafts are accepted.

Engine-free (numpy, torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_tokenswift.core.penalty import apply_min_p


def _in_vocab(ids: np.ndarray, v: int) -> np.ndarray:
    """The entries of ``ids`` in ``[0, v)`` (numpy would wrap a negative index)."""
    return ids[(ids >= 0) & (ids < v)]


def penalty_counts(st, token_row: np.ndarray, pos: int, v: int) -> np.ndarray:
    """``[V]`` int32 counts of the tokens in the request's penalty history (the last
    ``st.window`` tokens of prompt + output up to position ``pos``, or all of them), kept
    incrementally on the state: only the tokens that entered or left the window since the
    last call are read. Returns ``st.pen_counts`` itself (do not modify it).

    Args:
        st: the request's :class:`~vllm_tokenswift.core.request_state.RequestState`
            (``pen_counts``/``pen_lo``/``pen_hi`` updated in place).
        token_row: the request's token ids (a row of vLLM's ``input_batch.token_ids_cpu``).
        pos: position of the newest token.
        v: vocabulary size (ids outside ``[0, v)`` are ignored).
    """
    hi = pos + 1
    lo = max(0, hi - st.window) if st.window else 0
    if st.pen_counts is None or st.pen_counts.shape[0] != v or lo < st.pen_lo or hi < st.pen_hi \
            or lo >= st.pen_hi:
        st.pen_counts = np.zeros(v, dtype=np.int32)
        st.pen_lo = st.pen_hi = lo
    if hi > st.pen_hi:
        add = token_row[st.pen_hi: hi]
        np.add.at(st.pen_counts, _in_vocab(add, v), 1)
    if lo > st.pen_lo:
        sub = token_row[st.pen_lo: lo]
        np.subtract.at(st.pen_counts, _in_vocab(sub, v), 1)
    st.pen_lo, st.pen_hi = lo, hi
    return st.pen_counts


def chain_penalty_counts(st, token_row: np.ndarray, pos: int, chain: Sequence[int], v: int) -> np.ndarray:
    """``[V]`` int32: the penalty history's counts at the draft position after ``chain``,
    the chain's own earlier tokens counted as verification counts them.

    Verification samples the token at position ``pos + j + 1`` (``j = len(chain)``) with
    the penalty over the last ``st.window`` tokens before it: the request's tokens up to
    ``pos`` and the chain's ``j`` tokens at ``pos + 1 .. pos + j``; with a window the
    ``j`` oldest tokens of the window at ``pos`` leave it. Starts from the incremental
    counts of :func:`penalty_counts` at ``pos`` (which it brings up to date) and adjusts a
    copy; ``chain=[]`` returns the state's own counts (do not modify them).
    """
    base = penalty_counts(st, token_row, pos, v)
    j = len(chain)
    if not j:
        return base
    counts = base.copy()
    hi = pos + 1 + j                       # the window ends before position pos + j + 1
    lo = max(0, hi - st.window) if st.window else 0
    if lo > st.pen_lo:                     # request tokens that left the window
        gone = token_row[st.pen_lo: min(lo, pos + 1)]
        np.subtract.at(counts, _in_vocab(gone, v), 1)
    new = [int(t) for t in chain[max(0, lo - (pos + 1)):] if 0 <= int(t) < v]   # chain tokens in it
    if new:
        np.add.at(counts, new, 1)
    return counts


def penalty_mask(st, token_row: np.ndarray, pos: int, v: int, device) -> torch.Tensor:
    """``[V]`` bool on ``device``: the tokens of :func:`penalty_counts` (the request's
    penalty history up to position ``pos``)."""
    return torch.from_numpy(penalty_counts(st, token_row, pos, v) > 0).to(device)


def chain_penalty_mask(st, token_row: np.ndarray, pos: int, chain: Sequence[int], v: int,
                       device) -> torch.Tensor:
    """``[V]`` bool on ``device``: the tokens of :func:`chain_penalty_counts` (the penalty
    history of the draft position after ``chain``)."""
    return torch.from_numpy(chain_penalty_counts(st, token_row, pos, chain, v) > 0).to(device)


def apply_repetition_penalty(logits: torch.Tensor, mask: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """vLLM's repetition penalty rule on ``logits`` ``[R, V]`` (in place): where ``mask``
    ``[R, V]`` is set, a positive logit is divided by the row's penalty ``penalties`` ``[R]``
    and a negative one multiplied (``vllm._custom_ops.apply_repetition_penalties_torch``).
    Returns ``logits``."""
    pen = torch.where(mask, penalties.view(-1, 1).to(logits.dtype), torch.ones((), dtype=logits.dtype,
                                                                                 device=logits.device))
    logits *= torch.where(logits > 0, 1.0 / pen, pen)
    return logits


def draft_distributions(states: Sequence, token_rows: Sequence[np.ndarray], positions: Sequence[int],
                        logits: torch.Tensor, *, filters: bool = True,
                        chains: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """The draft distributions q of ``n`` requests: softmax of their draft logits after each
    request's repetition penalty (windowed or global), temperature and min_p, applied as the
    target's sampler applies them (Sec 3.4). The penalty history is the request's tokens up
    to the newest (:func:`penalty_mask`); for the heads' later distributions the chain's own
    earlier draft tokens are not added (an approximation on the draft side: it changes
    acceptance, never the output). A self-speculative chain passes ``chains``: its
    distributions (``D = 1``) then count the chain drawn so far exactly as verification
    will (:func:`chain_penalty_mask`).

    Args:
        states: per request, its ``RequestState`` (``repetition_penalty``, ``window``,
            ``temperature``, ``min_p``, ``sampled``).
        token_rows, positions: per request, its token ids and the newest token's position.
        logits: ``[n, D, V]`` float32 draft logits (``l_0..l_{D-1}``); modified.
        filters: False: plain softmax (the ``draft_penalty=false`` ablation).
        chains: per request, the draft tokens already drawn before this distribution's
            position (None: none).
    Returns:
        ``[n, D, V]`` float32, rows summing to 1.
    """
    if not filters:
        return torch.softmax(logits, dim=-1)
    n, ndist, v = logits.shape
    pen = [k for k, st in enumerate(states) if st.repetition_penalty != 1.0]
    if pen:
        counts = np.empty((len(pen), v), dtype=np.int32)     # one host array, one copy to the device
        for i, k in enumerate(pen):
            counts[i] = (penalty_counts(states[k], token_rows[k], positions[k], v) if chains is None else
                         chain_penalty_counts(states[k], token_rows[k], positions[k], chains[k], v))
        mask = torch.from_numpy(counts > 0).to(logits.device)
        idx = torch.as_tensor(pen, dtype=torch.long, device=logits.device)
        sub = logits[idx].reshape(len(pen) * ndist, v)
        pens = torch.as_tensor([states[k].repetition_penalty for k in pen], dtype=torch.float32,
                               device=logits.device)
        apply_repetition_penalty(sub, mask.repeat_interleave(ndist, dim=0), pens.repeat_interleave(ndist))
        logits[idx] = sub.view(len(pen), ndist, v)
    temps = torch.as_tensor([st.temperature if st.sampled else 1.0 for st in states],
                            dtype=torch.float32, device=logits.device)
    logits = logits / temps.view(n, 1, 1)
    mp = [k for k, st in enumerate(states) if st.min_p > 0 and st.sampled]
    if mp:
        idx = torch.as_tensor(mp, dtype=torch.long, device=logits.device)
        sub = logits[idx].reshape(len(mp) * ndist, v)
        mpv = torch.as_tensor([states[k].min_p for k in mp], dtype=torch.float32,
                              device=logits.device).repeat_interleave(ndist)
        logits[idx] = apply_min_p(sub, mpv).view(len(mp), ndist, v)
    return torch.softmax(logits, dim=-1)


def draw(st, probs: torch.Tensor) -> list[int]:
    """One token per depth from ``probs`` ``[depth, V]`` (float, rows summing to ~1) with
    the request's own RNG (seeded by its ``seed``, else by the engine seed and its id):
    reproducible per request, independent of the batch, identical on every
    tensor-parallel rank.

    Inverse-CDF sampling: one uniform ``u`` per depth from the request's generator, the
    token is the first whose float64 cumulative probability exceeds ``u·total``
    (``searchsorted``, right side, so a zero-probability token is never drawn). It costs
    one cumulative sum over the vocabulary instead of ``torch.multinomial``'s generic
    path; rows without positive mass fall back to ``torch.multinomial`` (which raises its
    usual error on invalid rows).

    Returns:
        ``depth`` token ids.
    """
    if st.generator is None or st.generator.device != probs.device:
        st.generator = torch.Generator(device=probs.device)
        st.generator.manual_seed(st.seed)
    depth = probs.shape[0]
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool(torch.all(total > 0)):
        return torch.multinomial(probs, 1, generator=st.generator).view(-1).tolist()
    u = torch.rand((depth, 1), generator=st.generator, dtype=torch.float64, device=probs.device)
    tok = torch.searchsorted(cdf, u * total, right=True).clamp_(max=probs.shape[-1] - 1)
    return tok.view(-1).tolist()


class DraftProbBuffer:
    """The draft distributions of one step's proposal, as vLLM's rejection sampler reads them
    (``GPUModelRunner._draft_probs``: ``[num_rows, num_speculative_tokens, V]`` float32, rows in
    batch order, read at ``[row, :num_drafts]`` only).

    Every proposed position gets a one-hot row (a point mass: vLLM's treatment of a token
    chosen deterministically) unless it was drawn from a draft distribution q, whose row is
    q itself. The buffer is kept between steps and only the positions proposed in a step
    are written (vLLM never reads the others).

    Args:
        num_spec_tokens: ``num_speculative_tokens`` k.
        vocab_size: V.
    """

    def __init__(self, num_spec_tokens: int, vocab_size: int):
        self.k = num_spec_tokens
        self.v = vocab_size
        self._buf: torch.Tensor | None = None

    def fill(self, drafts: Sequence[Sequence[int]], q_by_row: dict, device) -> torch.Tensor:
        """The step's ``[len(drafts), k, V]`` view of the buffer.

        Args:
            drafts: per batch row, the proposed draft token ids.
            q_by_row: batch row -> ``q [D, V]``: the distributions its first ``D`` drafts
                were drawn from (fewer are used when the chain is shorter).
            device: the runner's device.
        """
        n_rows = len(drafts)
        dev = torch.device(device)
        buf = self._buf
        if buf is None or buf.shape[0] < n_rows or buf.device != dev:
            buf = self._buf = torch.zeros((max(n_rows, 8), self.k, self.v), dtype=torch.float32, device=dev)
        oi, oj, ot = [], [], []
        for i, toks in enumerate(drafts):
            for j, t in enumerate(toks):
                oi.append(i)
                oj.append(j)
                ot.append(t)
        if oi:
            ii = torch.as_tensor(oi, device=dev)
            jj = torch.as_tensor(oj, device=dev)
            buf[ii, jj] = 0.0
            buf[ii, jj, torch.as_tensor(ot, device=dev)] = 1.0
        for i, q in q_by_row.items():
            d = min(int(q.shape[0]), len(drafts[i]))
            if d:
                buf[i, :d] = q[:d]
        return buf[:n_rows]
