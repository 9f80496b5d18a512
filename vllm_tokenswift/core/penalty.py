"""Contextual (windowed) repetition penalty (paper Sec 3.4, Eq. 3) and min_p,
applied identically in plain decoding, in speculative verification and to
TokenSwift's own draft distributions.

Users ask for the penalty per request::

    SamplingParams(repetition_penalty=1.2, extra_args={"repetition_penalty_window": 1024})

(through the OpenAI API: ``"vllm_xargs": {"repetition_penalty_window": 1024}``).
The repetition penalty θ then applies only to the token ids among the last W
tokens of prompt + output (+ the draft prefix, for a draft position), with
vLLM's own kernel (``logit > 0 → logit/θ`` else ``logit·θ``). Presence and
frequency penalties keep vLLM's semantics (whole output). Without the window,
vLLM's behaviour is unchanged.

vLLM mechanism (the glue is :mod:`vllm_tokenswift.patches.sampling`): the per-row window
is tracked by ``PenaltyWindowState``, a state-only logits processor added to the
persistent batch's ``LogitsProcessors`` (it follows vLLM's ``BatchUpdate``
add/remove/move protocol and never changes logits itself). The plugin replaces
``Sampler.apply_penalties`` and ``RejectionSampler.apply_penalties`` with
:func:`apply_penalties_windowed`, so bonus and draft positions see the same rule (the
rejection sampler already passes each draft row its own history ``output + drafts[:i]``).

min_p: vLLM 0.32 drops its min_p processor when speculative decoding is on. For
TokenSwift engines the plugin keeps vLLM's ``MinPLogitsProcessor`` (so the bonus
position is filtered exactly as in plain decoding) and applies the same filter
(:func:`apply_min_p`) to the draft positions after temperature, before top-k/top-p,
which is where plain decoding applies it.
"""

from __future__ import annotations

import numpy as np
import torch

WINDOW_KEY = "repetition_penalty_window"


def window_from_params(params) -> int:
    """The request's penalty window W in tokens (0 = no window = vLLM's global penalty).

    Raises:
        ValueError: if the extra arg is not a positive integer.
    """
    extra = getattr(params, "extra_args", None) or {}
    w = extra.get(WINDOW_KEY)
    if w is None:
        return 0
    if isinstance(w, bool) or not isinstance(w, (int, float)) or int(w) != w or int(w) < 1:
        raise ValueError(f"extra_args[{WINDOW_KEY!r}] must be a positive integer (tokens), got {w!r}")
    return int(w)


def window_tokens(prompt_row: torch.Tensor | np.ndarray | list[int], output: list[int],
                  window: int, vocab_size: int) -> list[int]:
    """Last ``window`` tokens of prompt + output.

    Reads O(``window``) of ``output`` (not the whole output, which at 16K tokens cost
    ~0.2 ms per step for the scan alone), unless the tail holds async placeholders.

    Args:
        prompt_row: prompt token ids, possibly right-padded with ``vocab_size``.
        output: output token ids so far (may end with draft tokens); ``-1`` entries
            (async placeholders) are dropped.
    """
    if window <= 0:
        return []
    tail = output[-window:]
    if tail and min(tail) < 0:
        # placeholders inside the window: filter the whole output, then take the window
        tail = [t for t in output if t >= 0][-window:]
    if len(tail) >= window:
        return tail
    need = window - len(tail)
    pr = prompt_row
    if isinstance(pr, torch.Tensor):
        pr = pr.cpu().numpy()
    pr = np.asarray(pr)
    pr = pr[pr != vocab_size]
    return pr[-need:].tolist() + tail


def apply_windowed_repetition(logits: torch.Tensor, rows: list[int], windows: list[list[int]],
                              penalties: torch.Tensor) -> torch.Tensor:
    """Apply the repetition penalty of ``rows`` using only their window tokens (paper Eq. 3).

    Numerics equal vLLM's ``apply_repetition_penalties``: a penalized logit ``l`` becomes
    ``l * (1/θ)`` if ``l > 0`` else ``l * θ``, every other logit is unchanged. Off CUDA
    (where vLLM's op is its torch fallback, two ``[rows, V]`` masks and two full-vocabulary
    ``where`` passes) only the window's distinct tokens are gathered, scaled with the same
    float32 operations and scattered back: O(W) per row instead of O(V), bit-identical.
    On CUDA vLLM's own kernel runs on the masks.

    Args:
        logits: ``[num_rows, V]`` float32, modified in place.
        rows: row indices with a window.
        windows: per such row, the window token ids (each in ``[0, V)``; repeats allowed).
        penalties: ``[num_rows]`` float32 repetition penalties θ.

    Returns:
        ``logits``.
    """
    if not rows:
        return logits
    v = logits.shape[1]
    if not logits.is_cuda:
        keys = [torch.as_tensor(toks, dtype=torch.long) + r * v for r, toks in zip(rows, windows) if toks]
        if not keys:
            return logits
        key = torch.unique(torch.cat(keys)).to(logits.device)
        rr, tt = key // v, key % v
        got = logits[rr, tt]
        theta = penalties.to(logits.device)[rr]
        logits[rr, tt] = got * torch.where(got > 0, 1.0 / theta, theta)
        return logits
    from vllm._custom_ops import apply_repetition_penalties

    mask = torch.zeros((len(rows), v), dtype=torch.bool)
    for j, toks in enumerate(windows):
        if toks:
            mask[j, torch.as_tensor(toks, dtype=torch.long)] = True
    mask = mask.to(logits.device)
    idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits[idx]
    no_out = torch.zeros_like(mask)
    apply_repetition_penalties(sub, mask, no_out, penalties[idx].contiguous())
    logits[idx] = sub
    return logits


def apply_penalties_windowed(orig_fn, logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                             presence: torch.Tensor, frequency: torch.Tensor,
                             repetition: torch.Tensor, output_token_ids: list[list[int]],
                             row_windows: list[int], rest_needed: bool = True) -> torch.Tensor:
    """vLLM's penalties with per-row repetition windows.

    Rows with window 0 go through ``orig_fn`` (vLLM's ``apply_all_penalties``)
    unchanged; windowed rows get the windowed repetition penalty first (same
    order as vLLM: repetition, then frequency and presence) and then ``orig_fn``
    with their repetition penalty set to 1.

    Args:
        orig_fn: vLLM's ``apply_all_penalties``.
        logits: ``[R, V]`` float32.
        prompt_token_ids: ``[R, P]`` padded with V.
        presence, frequency, repetition: ``[R]``.
        output_token_ids: R lists (output + draft prefix for draft rows).
        row_windows: R ints, the window of each row (0 = none).
        rest_needed: False when no row has a presence or frequency penalty and every
            row without a window has repetition penalty 1 (the caller knows this from
            the requests' parameters, :class:`PenaltyWindowState`): ``orig_fn`` would
            then leave the logits bit-for-bit unchanged (θ = 1 multiplies by 1, the
            frequency and presence terms subtract 0) and is skipped. It builds the
            prompt's and the whole output's token masks and counts on every call, an
            O(prompt + output) cost per step.
    """
    rows = [r for r, w in enumerate(row_windows) if w > 0]
    if not rows:
        return orig_fn(logits, prompt_token_ids, presence, frequency, repetition, output_token_ids)
    v = logits.shape[1]
    prompt_cpu = prompt_token_ids.cpu()
    wins = [window_tokens(prompt_cpu[r], output_token_ids[r], row_windows[r], v) for r in rows]
    logits = apply_windowed_repetition(logits, rows, wins, repetition)
    if not rest_needed:
        return logits
    rep = repetition.clone()
    rep[torch.as_tensor(rows, dtype=torch.long, device=rep.device)] = 1.0
    return orig_fn(logits, prompt_token_ids, presence, frequency, rep, output_token_ids)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p filter (``MinPLogitsProcessor.apply``), per row.

    Args:
        logits: ``[R, V]`` temperature-scaled logits, modified in place.
        min_p: ``[R]`` or ``[R, 1]`` float32; 0 disables the row.
    """
    probability_values = torch.nn.functional.softmax(logits, dim=-1)
    max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
    adjusted_min_p = max_probabilities.mul_(min_p.view(-1, 1))
    invalid_token_mask = probability_values < adjusted_min_p
    logits.masked_fill_(invalid_token_mask, -float("inf"))
    return logits
