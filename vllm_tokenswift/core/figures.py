"""Figures from raw counters and tokens, shared by ``generate``, the benchmark report and
the per-segment rows: Distinct-n, vLLM's speculative-decoding counters (from
``LLM.get_metrics()`` or the Prometheus collectors) and their deltas, α and mean
accepted length (paper Eq. 4), and the drafting policy's decision mix. Engine-free; no
imports from the rest of the package.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence


def distinct_n(tokens: Sequence[int], n: int) -> float | None:
    """Distinct-n of one sequence: number of distinct n-grams / number of n-grams.

    Returns ``None`` when the sequence has fewer than ``n`` tokens.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    total = len(tokens) - n + 1
    if total <= 0:
        return None
    grams = {tuple(tokens[i:i + n]) for i in range(total)}
    return len(grams) / total


def distinct_scores(outputs: Iterable[Sequence[int]], max_n: int = 4) -> dict[str, float | None]:
    """``{"distinct_1": .., ..., "distinct_{max_n}": ..}`` averaged over outputs.

    Each output's Distinct-n is computed on its own token ids and the values are
    averaged (outputs too short for ``n`` are skipped; ``None`` if none qualifies).
    """
    outs = [list(o) for o in outputs]
    res: dict[str, float | None] = {}
    for n in range(1, max_n + 1):
        vals = [v for v in (distinct_n(o, n) for o in outs) if v is not None]
        res[f"distinct_{n}"] = sum(vals) / len(vals) if vals else None
    return res


#: vLLM Prometheus counter name -> short key used in records.
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters_from_metrics(metrics: Iterable[Any]) -> dict[str, Any]:
    """Sum vLLM's speculative-decoding counters from ``LLM.get_metrics()`` output.

    Works on ``vllm.v1.metrics.reader`` objects (attributes ``name``, ``value`` or
    ``values``) or plain dicts with the same keys. Label sets (engines) are summed.

    Returns:
        ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}`` ints and
        ``"accepted_per_pos"`` (list of ints, possibly empty).
    """
    out: dict[str, Any] = {k: 0 for k in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for m in metrics:
        get = (m.get if isinstance(m, dict) else lambda k, d=None, _m=m: getattr(_m, k, d))
        name = get("name")
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += int(get("value", 0) or 0)
        elif name == SPEC_PER_POS:
            vals = list(get("values", []) or [])
            if len(vals) > len(per_pos):
                per_pos.extend([0] * (len(vals) - len(per_pos)))
            for i, v in enumerate(vals):
                per_pos[i] += int(v)
    out["accepted_per_pos"] = per_pos
    return out


def spec_counters_from_collectors(collectors: Iterable[Any]) -> dict[str, Any]:
    """:func:`spec_counters_from_metrics` read from Prometheus collector objects
    (``prometheus_client`` counters, labelled or not) instead of the process registry.

    An engine's counters stay readable through its collector objects after a later
    engine in the same process replaced them in the registry (vLLM unregisters the
    previous engine's metrics when it builds a new one), which ``bench --interleave``
    needs: it keeps several engines alive in one process.
    """
    metrics: list[dict[str, Any]] = []
    for c in collectors:
        for fam in c.collect():
            if fam.type != "counter":
                continue
            total = [smp for smp in fam.samples if smp.name == fam.name + "_total"]
            if fam.name == SPEC_PER_POS:
                by_pos: dict[int, float] = defaultdict(float)
                for smp in total:
                    by_pos[int(smp.labels.get("position", 0))] += smp.value
                n = max(by_pos) + 1 if by_pos else 0
                metrics.append({"name": fam.name, "values": [by_pos.get(i, 0.0) for i in range(n)]})
            else:
                metrics.append({"name": fam.name, "value": sum(smp.value for smp in total)})
    return spec_counters_from_metrics(metrics)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` for every numeric key, element-wise for lists of numbers and
    key-wise for nested dicts (cumulative counters such as ``steps_by_kind``); other
    values (strings, lists of records such as ``prometheus_samples``) are left out."""
    d: dict[str, Any] = {}
    for k, a in after.items():
        b = before.get(k)
        if isinstance(a, list):
            if not all(_is_number(x) for x in a):
                continue            # not a counter vector (e.g. ``prometheus_samples`` tuples)
            b = b if isinstance(b, list) else []
            d[k] = [int(x) - (int(b[i]) if i < len(b) else 0) for i, x in enumerate(a)]
        elif isinstance(a, dict):
            d[k] = counter_delta(b if isinstance(b, dict) else {}, a)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            d[k] = a - (b if isinstance(b, (int, float)) and not isinstance(b, bool) else 0)
    return d


#: The drafting policy's step kinds, in the order reports show them (``core.step.KINDS``:
#: draft forward over the budgeted view, fused heads on the verification forward's hidden
#: state, an n-gram chain alone, no draft, then the self-speculative chain, shown only
#: where it was taken, so that the four-kind mixes of earlier runs read as before).
STEP_KINDS = ("forward", "fused", "ngram", "none", "chain")


def decision_mix_fractions(steps_by_kind: dict | None) -> dict[str, float] | None:
    """Share of request-steps per step kind, ``{kind: fraction}`` in :data:`STEP_KINDS`
    order (unknown kinds appended), summing to 1; None when there are no steps.
    ``steps_by_kind`` holds counts (or fractions already: the result is the same)."""
    if not isinstance(steps_by_kind, dict):
        return None
    kinds = [k for k in STEP_KINDS if k != "chain" or k in steps_by_kind]
    kinds += sorted(k for k in steps_by_kind if k not in STEP_KINDS)
    counts = {k: max(0.0, float(steps_by_kind.get(k) or 0)) for k in kinds}
    total = sum(counts.values())
    if total <= 0:
        return None
    return {k: v / total for k, v in counts.items()}


def format_decision_mix(steps_by_kind: dict | None) -> str | None:
    """``"62/20/15/3"``: percent of request-steps that were forward/fused/ngram/none, then
    ``/chain`` where any step took a self-speculative chain (``"40/0/10/20/30"``;
    :data:`STEP_KINDS` order), or None without steps."""
    frac = decision_mix_fractions(steps_by_kind)
    if not frac:
        return None
    kinds = STEP_KINDS if frac.get("chain", 0.0) > 0 else STEP_KINDS[:4]
    return "/".join(f"{100 * frac[k]:.0f}" for k in kinds)


def _sum_dicts(ds: Iterable[Any]) -> dict | None:
    tot: dict[str, float] = {}
    seen = False
    for d in ds:
        if isinstance(d, dict):
            seen = True
            for k, v in d.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tot[k] = tot.get(k, 0) + v
    return tot if seen else None


def acceptance_from_counters(delta: dict[str, Any], num_speculative_tokens: int | None
                             ) -> dict[str, Any]:
    """α, mean accepted length and per-position acceptance from counter deltas.

    Args:
        delta: output of :func:`counter_delta` on :func:`spec_counters_from_metrics`.
        num_speculative_tokens: ``γ+1`` drafts per step (the speculative config's
            ``num_speculative_tokens``).

    Returns:
        ``acceptance_rate`` = accepted / ((γ+1) · drafts) (paper Eq. 4),
        ``mean_accepted_length`` = 1 + accepted / drafts, ``draft_token_acceptance``
        = accepted / draft tokens (vLLM's own rate, differs when drafts are shorter
        than γ+1), ``acceptance_per_pos`` = accepted at position i / drafts; all
        ``None`` when there were no drafts.
    """
    drafts = int(delta.get("num_drafts", 0) or 0)
    acc = int(delta.get("num_accepted_tokens", 0) or 0)
    dtok = int(delta.get("num_draft_tokens", 0) or 0)
    res: dict[str, Any] = {"num_drafts": drafts, "num_draft_tokens": dtok,
                           "num_accepted_tokens": acc, "acceptance_rate": None,
                           "mean_accepted_length": None, "draft_token_acceptance": None,
                           "acceptance_per_pos": None}
    if drafts > 0:
        if num_speculative_tokens:
            res["acceptance_rate"] = acc / (num_speculative_tokens * drafts)
        res["mean_accepted_length"] = 1.0 + acc / drafts
        res["draft_token_acceptance"] = acc / dtok if dtok else None
        pp = delta.get("accepted_per_pos") or []
        res["acceptance_per_pos"] = [v / drafts for v in pp] if pp else None
    return res
