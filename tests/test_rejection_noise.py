"""The ``cpu-recovered-noise`` patch: vLLM's recovered-token sampling with the noise drawn as
``-log U`` for drafting rows only (engine-free; vLLM's CPU kernel does the sampling)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_tokenswift import patches
from vllm_tokenswift.compat import patching
from vllm_tokenswift.patches.sampling import recovered_noise_reciprocal


@pytest.fixture(scope="module", autouse=True)
def _registered():
    patches.register()


def test_only_rows_that_verify_sampled_drafts_draw_noise():
    """Rows without drafts and greedy rows get 1 and consume no random numbers; the others
    get 1/E with E = -log U from exactly one uniform draw per vocabulary entry."""
    torch.manual_seed(3)
    inv_q = recovered_noise_reciprocal([0, 2, 1, 3], 7, {}, {2})
    torch.manual_seed(3)
    u = torch.empty(2, 7).uniform_()
    after_ref = torch.rand(1)
    torch.manual_seed(3)
    recovered_noise_reciprocal([0, 2, 1, 3], 7, {}, {2})
    assert torch.equal(torch.rand(1), after_ref)       # 14 draws, no more
    assert inv_q.shape == (4, 7) and inv_q.dtype == torch.float32
    assert torch.equal(inv_q[0], torch.ones(7)) and torch.equal(inv_q[2], torch.ones(7))
    assert torch.equal(inv_q[[1, 3]], 1.0 / -torch.log(u))
    # a seeded request draws from its own generator, the others from the global one
    g = torch.Generator().manual_seed(5)
    inv = recovered_noise_reciprocal([1, 1], 4, {1: g}, set(), torch.float64)
    want = 1.0 / -torch.log(torch.empty(4, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(5)))
    assert inv.dtype == torch.float64 and torch.equal(inv[1], want)
    assert bool(torch.isfinite(inv).all()) and bool((inv > 0).all())


def test_patch_is_active_on_cpu():
    assert patching.RECORDS["cpu-recovered-noise"].status == "applied"


def test_recovered_tokens_follow_the_residual_distribution(monkeypatch):
    """At a rejected draft position vLLM samples from max(p - q, 0), normalized: with the
    patched noise, 40,000 requests' draws through vLLM's own function and CPU kernel match that
    distribution (each frequency within 5 standard errors), tokens with zero residual never
    come out, and a request without drafts is left alone."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils as cpu_tl

    # vLLM's CPU kernel, bound for this test only, as a CPU worker's
    # register_triton_kernel_overrides() binds it everywhere. Not that call itself: its rebinding
    # scan over sys.modules raises in a process that has imported llvmlite (its _lib_fn_wrapper
    # answers __dict__ with a non-dict), which a test worker may have.
    owner = rs._sample_recovered_tokens                    # the JIT warmup owner that launches it
    if not isinstance(owner.kernel, KernelOverride):
        kernel = KernelOverride(owner.kernel, cpu_tl._sample_recovered_tokens_kernel_impl)
        monkeypatch.setattr(rs, "sample_recovered_tokens_kernel", kernel)
        monkeypatch.setattr(owner, "kernel", kernel)
        monkeypatch.delitem(owner.__dict__, "_kernel_arg_names", raising=False)
    p = torch.tensor([0.40, 0.30, 0.20, 0.10, 0.0])
    q = torch.tensor([0.10, 0.50, 0.10, 0.10, 0.20])
    resid = (p - q).clamp_min(0)
    resid = resid / resid.sum()                      # [0.6, 0, 0.2, 0, 0] / 0.8
    n, v = 40_000, p.numel()
    # n requests of one draft position each (vLLM draws one noise row per request), all at
    # the same p and q, and a last request without drafts
    num_draft = [1] * n + [0]
    cu = torch.tensor(list(range(1, n + 1)) + [n], dtype=torch.int32)
    draft_ids = torch.zeros(n, dtype=torch.int32)
    target = p.expand(n, v).contiguous()
    draft = q.expand(n, v).contiguous()
    md = SimpleNamespace(temperature=torch.ones(n + 1), all_random=True, generators={})
    torch.manual_seed(11)
    out = rs.sample_recovered_tokens(1, num_draft, cu, draft_ids, draft, target, md, torch.device("cpu"))
    assert patching.patch_of(rs.sample_recovered_tokens) == "cpu-recovered-noise"
    counts = torch.bincount(out.long(), minlength=v).double() / n
    se = (resid * (1 - resid) / n).sqrt()
    assert counts[1] == 0 and counts[3] == 0 and counts[4] == 0
    assert bool(((counts - resid).abs() <= 5 * se + 1e-12).all()), (counts, resid)
