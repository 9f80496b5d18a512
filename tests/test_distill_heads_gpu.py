"""docs/research/distill_heads_gpu.py: the self-distillation run of the bundled SmolLM2 heads, on CPU
with tiny models (the real run needs the GPU machine)."""

import json
import sys

import numpy as np
import pytest
import torch
from research_utils import load_research

from vllm_tokenswift.training.evaluate import SamplingSpec, sampling_probs, window_presence


@pytest.fixture(scope="module")
def distill():
    return load_research("distill_heads_gpu")


def _tiny_llama(vocab=64, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def test_generate_samples_inside_the_windowed_penalty_and_min_p_support(distill):
    """Every sampled token is one the sampling rule allows at its position, with the penalty's
    history being exactly the last `window` tokens (checked against a full forward without
    the KV cache and `window_presence`); the prompts come back unchanged, and a seed fixes
    the samples."""
    model = _tiny_llama()
    # a sharp rule (low temperature, high min_p: few tokens allowed per position) and a large
    # penalty on a short window, so a wrong history changes the support: a history that keeps
    # the whole prompt, or one that never drops a token, fails this test
    spec = SamplingSpec(temperature=0.1, min_p=0.5, repetition_penalty=3.0, window=5)
    g = torch.Generator().manual_seed(1)
    P, G = 16, 24
    prompts = torch.randint(0, 64, (5, P), generator=g)
    out = distill.generate(model, prompts, G, batch=2, seed=3, progress=False, spec=spec)
    assert out.shape == (5, P + G) and out.dtype == torch.long
    assert torch.equal(out[:, :P], prompts)
    again = distill.generate(model, prompts, G, batch=2, seed=3, progress=False, spec=spec)
    assert torch.equal(out, again)
    with torch.no_grad():
        logits = model(out).logits          # [5, P + G, V]; position t predicts t + 1
    checked = 0
    for r in range(out.shape[0]):
        pres = window_presence(out[r], P - 1, P + G - 1, 64, spec.window)   # histories of tokens P..
        p = sampling_probs(logits[r, P - 1: P + G - 1], pres, spec)
        assert (p[torch.arange(G), out[r, P:]] > 0).all()
        checked += G
    assert checked == 5 * G
    # the whole history instead of the window would have ruled out some of these samples
    wrong = 0
    for r in range(out.shape[0]):
        pres = window_presence(out[r], P - 1, P + G - 1, 64, 0)            # whole history instead
        p = sampling_probs(logits[r, P - 1: P + G - 1], pres, spec)
        wrong += int((p[torch.arange(G), out[r, P:]] == 0).sum())
    assert wrong > 0


def test_smoke_run_writes_heads_that_load_and_an_evaluation(distill, tmp_path, monkeypatch):
    """`run --smoke`: a random 2-layer Llama, generation, 3 training steps and the evaluation of
    zero and new heads on both held-out sets; the heads load and fit the model."""
    from vllm_tokenswift.core.heads import load_heads

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["distill_heads_gpu.py", "run", "--smoke", "--out", str(out),
                                      "--work", str(tmp_path / "work"), "--no-progress"])
    distill.main()
    names = sorted(p.name for p in out.iterdir())
    assert names == ["eval.json", "heads.safetensors", "ids.npz", "metrics.jsonl", "summary.json",
                     "tokenswift_heads.json", "training_curves.png"]
    ev = json.loads((out / "eval.json").read_text())
    assert sorted(ev) == ["new/books", "new/generated", "zero/books", "zero/generated"]
    assert ev["new/generated"]["num_sequences"] == 4 and ev["new/books"]["num_sequences"] == 2
    ids = np.load(out / "ids.npz")
    assert ids["train"].shape == (12, 64) and ids["heldout"].shape == (4, 64)
    assert ids["train"].dtype == np.uint16
    heads = load_heads(out, hidden_size=64)
    assert heads.num_heads == 3
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_tokens"] == 16 * 48 and summary["train_sequences"] == 12


def test_prepare_cuts_seeded_prompts_and_heldout_windows(distill, tmp_path, monkeypatch):
    """`prepare` with the demo model's tokenizer: N training prompts of P tokens from the first
    books, M held-out prompts and W windows per held-out book, all uint16 and the same for the
    same seed."""
    from vllm_tokenswift.cli.assets import DEMO_MODEL

    rng = np.random.default_rng(0)
    words = ["the", "house", "river", "walked", "slowly", "towards", "a", "light", "and", "she"]
    books = tmp_path / "books.jsonl"
    with open(books, "w") as fh:
        for b in range(5):
            fh.write(json.dumps({"id": f"b{b}", "text": " ".join(rng.choice(words, 3000))}) + "\n")
    outs = []
    for k in range(2):
        out = tmp_path / f"prompts{k}.npz"
        monkeypatch.setattr(sys, "argv", [
            "distill_heads_gpu.py", "prepare", "--model", str(DEMO_MODEL), "--books", str(books),
            "--train-books", "3", "--heldout-books", "2", "--num", "7", "--heldout-num", "3",
            "--prefix-len", "32", "--window-len", "256", "--windows-per-doc", "2", "--out", str(out)])
        distill.main()
        outs.append(np.load(out))
    a, b = outs
    assert a["train_prompts"].shape == (7, 32) and a["train_prompts"].dtype == np.uint16
    assert a["heldout_prompts"].shape == (3, 32)
    assert a["heldout_windows"].shape == (4, 256)
    assert list(a["heldout_books"]) == ["b3", "b4"]
    for key in ("train_prompts", "heldout_prompts", "heldout_windows"):
        assert np.array_equal(a[key], b[key])
