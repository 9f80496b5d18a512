"""Before/after, in one process: what a verifying step's sampling costs on CPU, the parts the
``cpu-recovered-noise`` patch and the sparse windowed penalty (``core/penalty.py``) change.

* recovered-token noise: vLLM's ``sample_recovered_tokens`` (exponential_ over every request's
  row) against the patched one (uniform_ + log, drafting rows only), SmolLM2's vocabulary
  (49,152), batch 2 / 8 / 16, every row or half the rows verifying 1 or 8 drafts;
* the windowed repetition penalty (W = 1,024) over 2 / 8 / 16 rows: the masked path (vLLM's
  ``apply_repetition_penalties`` on two [rows, V] masks) against the sparse one.

Run: ``PYTHONPATH=. .venv/bin/python docs/bench/sampler-floor/bench_sampler.py`` (one core,
nothing else running). Prints a table of ms per call (median of 30) and the ratios.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from vllm_tokenswift import patches
from vllm_tokenswift.compat.patching import original_of

V = 49152


def ms(fn, reps=30):
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def masked_penalty(logits, rows, windows, penalties):
    """The masked path (what ``apply_windowed_repetition`` did before, and still does on CUDA)."""
    from vllm._custom_ops import apply_repetition_penalties

    mask = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool)
    for j, toks in enumerate(windows):
        mask[j, torch.as_tensor(toks, dtype=torch.long)] = True
    idx = torch.as_tensor(rows, dtype=torch.long)
    sub = logits[idx]
    apply_repetition_penalties(sub, mask, torch.zeros_like(mask), penalties[idx].contiguous())
    logits[idx] = sub
    return logits


def main() -> None:
    torch.set_num_threads(1)
    patches.register()
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.platforms import current_platform

    from vllm_tokenswift.core.penalty import apply_windowed_repetition

    current_platform.register_triton_kernel_overrides()
    new = rs.sample_recovered_tokens
    old = original_of(new)
    assert old is not None and old is not new, "the cpu-recovered-noise patch is not active"
    print("| part | batch | rows verifying drafts | before (ms) | after (ms) | after / before |")
    print("|---|---|---|---|---|---|")
    for b in (2, 8, 16):
        for frac, k in ((1.0, 1), (0.5, 1), (1.0, 8)):
            nd = [k if i < max(1, int(b * frac)) else 0 for i in range(b)]
            cu = torch.tensor(list(torch.tensor(nd).cumsum(0)), dtype=torch.int32)
            n = int(cu[-1])
            ids = torch.randint(0, V, (n,), dtype=torch.int32)
            tp = torch.softmax(torch.randn(n, V), -1)
            dp = torch.softmax(torch.randn(n, V), -1)
            md = SimpleNamespace(temperature=torch.ones(b), all_random=True, generators={})
            args = (k, nd, cu, ids, dp, tp, md, torch.device("cpu"))
            t0, t1 = ms(lambda: old(*args)), ms(lambda: new(*args))
            print(f"| recovered-token noise + kernel, k={k} | {b} | {sum(x > 0 for x in nd)} | {t0:.2f} | {t1:.2f} "
                  f"| {t1 / t0:.2f} |")
    for r in (2, 8, 16):
        logits = torch.randn(r, V)
        rows = list(range(r))
        wins = [torch.randint(0, V, (1024,)).tolist() for _ in rows]
        theta = torch.full((r,), 1.2)
        t0 = ms(lambda: masked_penalty(logits.clone(), rows, wins, theta))
        t1 = ms(lambda: apply_windowed_repetition(logits.clone(), rows, wins, theta))
        tc = ms(lambda: logits.clone())
        print(f"| windowed penalty W=1,024 (clone of the logits, {tc:.2f} ms, included) | {r} | {r} | {t0:.2f} "
              f"| {t1:.2f} | {t1 / t0:.2f} |")


if __name__ == "__main__":
    main()
