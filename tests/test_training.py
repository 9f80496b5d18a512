"""Tests of the draft-head trainer (``vllm_tokenswift.training``): CPU, tiny random models."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import transformers  # noqa: E402  (a core dependency)

from vllm_tokenswift.core.heads import DraftHeads, load_heads  # noqa: E402
from vllm_tokenswift.training import cli as tcli  # noqa: E402
from vllm_tokenswift.training.data import (  # noqa: E402
    TrainHeadsError, build_sequences, iter_documents, load_token_sequences)
from vllm_tokenswift.training.evaluate import evaluate_heads  # noqa: E402
from vllm_tokenswift.training.trainer import (  # noqa: E402
    base_hidden_states, heads_loss, load_base_model, lr_factor, train_heads)

CORPUS = Path(__file__).parent / "data" / "tiny_corpus.jsonl"
VOCAB = 256
SEQ = 64


# ------------------------------------------------------------------ fixtures
def _make_tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "[UNK]"],
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="[UNK]")
    fast.save_pretrained(folder)
    return fast


def _make_model(folder: Path, arch: str = "llama", randomize_norm: bool = True):
    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():
        if randomize_norm:  # so that "before the final norm" differs from "after" (norm weight != 1)
            model.model.norm.weight.copy_(0.5 + torch.rand(64))
        # larger LM-head scale than the 0.02 init so 20 tiny steps move the loss clearly
        model.lm_head.weight.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    _make_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _make_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _make_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


FAST = dict(seq_len=SEQ, batch_size=2, grad_accum=1, warmup=2, device="cpu", progress=False,
            chunk_size=48, log=lambda m: None)


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run20")
    exp = out / "exported"
    res = train_heads(llama_dir, CORPUS, out / "heads", steps=20, lr=2e-2, seed=0,
                      export_tokenswift=exp, **FAST)
    return res


# ----------------------------------------------------------------------- data
def test_data_packing_and_cut(llama_dir):
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    docs = list(iter_documents(CORPUS))
    assert len(docs) == 12
    assert list(iter_documents(CORPUS, max_docs=3)) == docs[:3]
    full = [tok(d)["input_ids"] for d in docs]
    assert all(f[0] == tok.bos_token_id for f in full)
    # packing: all documents are shorter than 512 tokens -> concatenated with EOS, cut in 512s
    L = 512
    assert all(len(f) < L for f in full)
    stream = [t for f in full for t in f + [tok.eos_token_id]]
    packed = build_sequences(docs, tok, L, pack=True)
    assert packed.dtype == torch.long and packed.shape == (len(stream) // L, L)
    assert packed.flatten().tolist() == stream[: packed.numel()]
    # no packing: short documents skipped; long ones cut to their first L tokens
    assert build_sequences(docs, tok, L, pack=False).shape == (0, L)
    cut = build_sequences(docs, tok, 20, pack=False)
    assert cut.tolist() == [f[:20] for f in full if len(f) >= 20]
    assert 0 < cut.shape[0] < len(full)
    with pytest.raises(TrainHeadsError, match="no sequence of 100000 tokens"):
        load_token_sequences(CORPUS, tok, 100000)


def test_windows_per_doc(llama_dir):
    """W windows per document: the first W*L tokens as W sequences, remainder packed/skipped."""
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    docs = list(iter_documents(CORPUS))
    full = [tok(d)["input_ids"] for d in docs]
    L, W = 20, 3
    got = build_sequences(docs, tok, L, pack=False, windows_per_doc=W)
    want = [f[w * L:(w + 1) * L] for f in full for w in range(min(W, len(f) // L))]
    assert got.tolist() == want
    assert got.shape[0] > sum(1 for f in full if len(f) >= L)   # more than one window per long doc
    # with packing, each document's remainder after its full windows is packed (EOS-separated)
    packed = build_sequences(docs, tok, L, pack=True, windows_per_doc=W).tolist()
    stream = []
    for f in full:
        head = f[: W * L]
        rest = head[(len(head) // L) * L:]
        if rest or len(head) < L:
            stream += rest + [tok.eos_token_id]
    extra = len(stream) // L
    assert len(packed) == len(want) + extra
    windows = [r for r in packed if r in want]
    assert windows == want
    assert [t for r in packed if r not in want for t in r] == stream[: extra * L]
    with pytest.raises(TrainHeadsError, match="windows_per_doc must be >= 1"):
        build_sequences(docs, tok, L, windows_per_doc=0)


def test_lr_schedule():
    f = [lr_factor(u, 10, 2) for u in range(10)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == 1.0
    assert all(a > b for a, b in zip(f[2:], f[3:]))
    assert f[-1] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 7 / 8)).item()))


# ----------------------------------------------------------------------- loss
def _random_heads_loss(H, seed, lm_head, h0, ids, **kw):
    """3 heads with seeded random weights (norm weights around 1); ``heads_loss`` on them.
    Returns ``(stats, gradients, heads)``."""
    heads = DraftHeads(H, 3, eps=1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    st = heads_loss(heads, lm_head, h0, ids, **kw)
    return st, [p.grad.clone() for p in heads.parameters()], heads


def test_chunked_loss_equals_unchunked():
    torch.manual_seed(0)
    H, V, B, L = 16, 50, 2, 13
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    h0 = torch.randn(B, L, H)
    ids = torch.randint(0, V, (B, L))

    def run(chunk):
        return _random_heads_loss(H, 7, lm_head, h0, ids, chunk_size=chunk, backward=True)

    ref, gref, heads = run(None)
    # reference computed by hand, in one piece
    with torch.no_grad():
        outs = heads(h0.reshape(-1, H))
    manual = 0.0
    for i, o in enumerate(outs, start=1):
        logits = lm_head(o).reshape(B, L, V)[:, : L - 1 - i]
        tgt = ids[:, 1 + i:]
        manual += torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1)).item()
    assert ref.count == [B * (L - 2), B * (L - 3), B * (L - 4)]
    assert ref.loss == pytest.approx(manual, abs=1e-5)
    for chunk in (1, 5, 7, 26):
        st, g, _ = run(chunk)
        assert st.count == ref.count and st.correct == ref.correct
        assert st.loss == pytest.approx(ref.loss, abs=1e-5)
        for a, b in zip(g, gref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_hidden_state_is_before_final_norm(llama_dir):
    model, _ = load_base_model(llama_dir, load_tokenizer=False)
    ids = torch.randint(0, VOCAB, (2, 16))
    seen = {}
    hk = model.model.layers[-1].register_forward_hook(lambda m, a, out: seen.__setitem__(
        "h", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        logits = model(ids).logits
    hk.remove()
    h0 = base_hidden_states(model, ids)
    assert h0.shape == (2, 16, 64) and not h0.requires_grad
    torch.testing.assert_close(h0, seen["h"], atol=0, rtol=0)
    torch.testing.assert_close(model.lm_head(model.model.norm(h0)), logits, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------- training
def test_loss_decreases_and_outputs(trained):
    res = trained
    assert res.completed and res.steps_done == 20 and res.seq_len == SEQ
    rows = [json.loads(x) for x in res.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    for r in rows:
        assert set(r) >= {"step", "lr", "loss", "head_loss", "head_acc"}
        assert len(r["head_loss"]) == 3 and len(r["head_acc"]) == 3
        assert r["loss"] == pytest.approx(sum(r["head_loss"]))
    assert rows[0]["lr"] == pytest.approx(2e-2 * 0.5)
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert res.final_loss == rows[-1]["loss"] and res.final_head_acc == rows[-1]["head_acc"]
    assert res.plot_path is not None and res.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((res.heads_dir / "tokenswift_heads.json").read_text())
    assert meta["steps"] == 20 and meta["seq_len"] == SEQ and meta["final_loss"] == rows[-1]["loss"]
    assert meta["num_heads"] == 3 and meta["hidden_size"] == 64


def test_saved_and_exported_heads_roundtrip(trained, llama_dir):
    res = trained
    mem = res.heads.cpu().eval()
    eps = json.loads((llama_dir / "config.json").read_text())["rms_norm_eps"]
    loaded = load_heads(res.heads_dir, hidden_size=64, num_heads=3, eps=eps)
    exported = load_heads(res.export_dir, hidden_size=64, num_heads=3, eps=eps)
    ref = mem.state_dict_flat()
    assert any(float(v.abs().sum()) > 0 for k, v in ref.items() if "linear" in k)  # trained, not zero
    for other in (loaded, exported):
        got = other.state_dict_flat()
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
        assert other.eps == mem.eps
    x = torch.randn(5, 64)
    with torch.no_grad():
        for a, b, c in zip(mem(x), loaded(x), exported(x)):
            assert torch.equal(a, b) and torch.equal(a, c)
    cfg = json.loads((res.export_dir / "config.json").read_text())
    assert cfg["medusa_heads"] == 3 and cfg["model_type"] == "llama"


def test_resume_matches_uninterrupted(llama_dir, tmp_path):
    kw = dict(steps=6, lr=1e-2, seed=3, save_every=2, **FAST)
    full = train_heads(llama_dir, CORPUS, tmp_path / "full", **kw)
    part = train_heads(llama_dir, CORPUS, tmp_path / "split", stop_after=3, **kw)
    assert not part.completed and part.steps_done == 3 and part.heads_dir is None
    assert (tmp_path / "split" / "checkpoint" / "state.pt").is_file()
    with pytest.raises(TrainHeadsError, match="--resume"):
        train_heads(llama_dir, CORPUS, tmp_path / "split", **kw)
    with pytest.raises(TrainHeadsError, match="settings differ"):
        train_heads(llama_dir, CORPUS, tmp_path / "split", resume=True, **{**kw, "lr": 2e-2})
    rest = train_heads(llama_dir, CORPUS, tmp_path / "split", resume=True, **kw)
    assert rest.completed and rest.steps_done == 6
    a, b = full.heads.state_dict_flat(), rest.heads.state_dict_flat()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    rb = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    strip = lambda rows: [{k: v for k, v in json.loads(x).items() if k != "elapsed_s"} for x in rows]  # noqa: E731
    assert strip(ra) == strip(rb)


def test_grad_accum_equals_bigger_batch(llama_dir, tmp_path):
    base = {**FAST, "steps": 2, "lr": 1e-2, "seed": 5}
    a = train_heads(llama_dir, CORPUS, tmp_path / "a", **{**base, "batch_size": 2, "grad_accum": 1})
    b = train_heads(llama_dir, CORPUS, tmp_path / "b", **{**base, "batch_size": 1, "grad_accum": 2})
    for k, v in a.heads.state_dict_flat().items():
        # float rounding (summation order differs with the thread count), amplified by Adam's
        # normalisation; a wrong accumulation changes weights by O(lr) = 1e-2
        torch.testing.assert_close(v, b.heads.state_dict_flat()[k], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- errors
def test_errors_before_training(llama_dir, tmp_path):
    with pytest.raises(TrainHeadsError, match="does not exist"):
        train_heads(llama_dir, tmp_path / "missing.jsonl", tmp_path / "o1", steps=1, **FAST)
    with pytest.raises(TrainHeadsError, match="max_position_embeddings=512"):
        train_heads(llama_dir, CORPUS, tmp_path / "o2", steps=1, **{**FAST, "seq_len": 1024})
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                         vocab_size=VOCAB)).save_pretrained(gpt2)
    with pytest.raises(TrainHeadsError, match="has no model.model"):
        train_heads(gpt2, CORPUS, tmp_path / "o3", steps=1, **FAST)
    with pytest.raises(TrainHeadsError, match="no config.json"):
        train_heads(tmp_path, CORPUS, tmp_path / "o4", steps=1, **FAST)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n{"text": "   "}\n')
    with pytest.raises(TrainHeadsError, match="no non-empty documents"):
        train_heads(llama_dir, empty, tmp_path / "o5", steps=1, **FAST)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(TrainHeadsError, match="bad.jsonl:1"):
        train_heads(llama_dir, bad, tmp_path / "o6", steps=1, **FAST)
    with pytest.raises(TrainHeadsError, match="--seq-len must be at least 5"):
        train_heads(llama_dir, CORPUS, tmp_path / "o7", steps=1, **{**FAST, "seq_len": 4})
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
    assert issubclass(TrainHeadsError, ValueError)


def _cli(argv):
    p = argparse.ArgumentParser(prog="vllm-tokenswift")
    tcli.add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


def test_cli_errors(llama_dir, tmp_path, capsys):
    rc = _cli(["train-heads", "--model", str(llama_dir), "--data", str(tmp_path / "nope.jsonl"),
               "--out", str(tmp_path / "o"), "--device", "cpu"])
    assert rc == 2
    assert "error: data path" in capsys.readouterr().err
    rc = _cli(["train-heads", "--model", str(llama_dir), "--data", str(CORPUS), "--out",
               str(tmp_path / "o"), "--seq-len", "4096", "--device", "cpu"])
    assert rc == 2 and "max_position_embeddings" in capsys.readouterr().err
    rc = _cli(["eval-heads", "--model", str(llama_dir), "--heads", str(tmp_path), "--data", str(CORPUS),
               "--seq-len", "64", "--device", "cpu"])
    assert rc == 2 and "error:" in capsys.readouterr().err


# ------------------------------------------------------------------------ eval
def _reference_eval(model, heads, seqs):
    """Slow, independent reference: per-position Python loops, h_0 from the last layer's output."""
    n = heads.num_heads
    top1 = [0] * (n + 1)
    tot = [0] * (n + 1)
    acc_lens = []
    for ids in seqs:
        seen = {}
        hk = model.model.layers[-1].register_forward_hook(lambda m, a, out: seen.__setitem__(
            "h", out[0] if isinstance(out, tuple) else out))
        with torch.no_grad():
            base_logits = model(ids[None]).logits[0]
        hk.remove()
        h0 = seen["h"][0]
        L = ids.numel()
        for t in range(L - 1):
            with torch.no_grad():
                d = [base_logits[t]] + [model.lm_head(o)[0] for o in heads(h0[t:t + 1])]
            am = [int(x.argmax()) for x in d]
            for j in range(n + 1):
                if t + 1 + j < L:
                    tot[j] += 1
                    top1[j] += int(am[j] == int(ids[t + 1 + j]))
            if t + n + 1 < L:
                k = 0
                while k <= n and am[k] == int(ids[t + 1 + k]):
                    k += 1
                acc_lens.append(k)
    return top1, tot, acc_lens


def test_evaluate_matches_reference(trained, llama_dir):
    model, tok = load_base_model(llama_dir)
    seqs = load_token_sequences(CORPUS, tok, 40)[:2]
    heads = trained.heads.cpu().eval()
    res = evaluate_heads(model, heads, seqs, chunk_size=20)
    top1, tot, acc_lens = _reference_eval(model, heads, seqs)
    N, L = seqs.shape
    assert res["num_sequences"] == N and res["num_tokens"] == N * L
    assert [d["positions"] for d in res["distributions"]] == [N * (L - 1 - j) for j in range(4)] == tot
    assert [round(d["top1"] * d["positions"]) for d in res["distributions"]] == top1
    c = res["chain"]
    assert c["positions"] == len(acc_lens) == N * (L - 4) and c["attention"] == "full"
    assert c["accepted_hist"] == [acc_lens.count(k) for k in range(5)]
    assert c["mean_accepted"] == pytest.approx(sum(acc_lens) / len(acc_lens))
    assert c["acceptance_rate"] == pytest.approx(c["mean_accepted"] / 4)
    for d in res["distributions"]:
        assert d["top1"] <= d["top3"] <= 1.0
    # fresh heads (W=0, norms 1) differ from l_0 because the final norm weight is not 1
    fresh = evaluate_heads(model, DraftHeads(64, 3, eps=model.config.rms_norm_eps), seqs)
    ftop1, _, flens = _reference_eval(model, DraftHeads(64, 3, eps=model.config.rms_norm_eps), seqs)
    assert [round(d["top1"] * d["positions"]) for d in fresh["distributions"]] == ftop1
    assert fresh["chain"]["accepted_hist"] == [flens.count(k) for k in range(5)]


def test_cli_train_and_eval_end_to_end(llama_dir, tmp_path, capsys):
    out, js = tmp_path / "cli-out", tmp_path / "eval.json"
    rc = _cli(["train-heads", "--model", str(llama_dir), "--data", str(CORPUS), "--out", str(out),
               "--seq-len", "64", "--steps", "3", "--warmup", "1", "--batch-size", "2", "--device", "cpu",
               "--no-progress", "--export-tokenswift", str(tmp_path / "ts")])
    assert rc == 0
    o = capsys.readouterr().out
    assert "heads:" in o and "TokenSwift layout:" in o
    assert (out / "heads.safetensors").is_file() and (tmp_path / "ts" / "model.safetensors").is_file()
    rc = _cli(["eval-heads", "--model", str(llama_dir), "--heads", str(out), "--data", str(CORPUS),
               "--seq-len", "64", "--max-docs", "6", "--device", "cpu", "--no-progress", "--json", str(js)])
    assert rc == 0
    o = capsys.readouterr().out
    assert "l_3 (head 3)" in o and "FULL attention" in o and "acceptance rate" in o
    res = json.loads(js.read_text())
    assert len(res["distributions"]) == 4 and res["chain"]["length"] == 4
    assert 0.0 <= res["chain"]["acceptance_rate"] <= 1.0


def test_qwen2_trains_and_evaluates(qwen_dir, tmp_path):
    res = train_heads(qwen_dir, CORPUS, tmp_path / "q", steps=3, lr=1e-2, **FAST)
    assert res.completed and len(res.final_head_loss) == 3
    heads = load_heads(res.heads_dir, hidden_size=64, num_heads=3)
    model, tok = load_base_model(qwen_dir)
    seqs = load_token_sequences(CORPUS, tok, SEQ)[:2]
    ev = evaluate_heads(model, heads, seqs)
    assert ev["chain"]["positions"] == 2 * (SEQ - 4)


# ------------------------------------------------------------ self-distillation, sampled acceptance
def test_distill_loss_matches_manual_soft_cross_entropy():
    """``distill_norm``: head i at t is trained towards softmax(l_0 at t+i), chunking exact."""
    torch.manual_seed(1)
    H, V, B, L = 16, 40, 2, 11
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    norm = torch.nn.LayerNorm(H).requires_grad_(False)
    h0 = torch.randn(B, L, H)
    ids = torch.randint(0, V, (B, L))

    def run(chunk):
        return _random_heads_loss(H, 3, lm_head, h0, ids, chunk_size=chunk, distill_norm=norm)

    ref, gref, heads = run(None)
    with torch.no_grad():
        outs = heads(h0.reshape(-1, H))
        base = torch.softmax(lm_head(norm(h0)), -1)                     # [B, L, V]
    manual = 0.0
    for i, o in enumerate(outs, start=1):                               # head i predicts t+1+i
        logq = torch.log_softmax(lm_head(o).reshape(B, L, V)[:, : L - 1 - i], -1)
        p = base[:, i: L - 1]                                           # l_0 at t+i
        manual += (-(p * logq).sum(-1)).mean().item()
    assert ref.count == [B * (L - 2), B * (L - 3), B * (L - 4)]
    assert ref.loss == pytest.approx(manual, abs=1e-5)
    for chunk in (1, 4, 9, 22):
        st, g, _ = run(chunk)
        assert st.loss == pytest.approx(ref.loss, abs=1e-5)
        for a, b in zip(g, gref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_window_presence_and_sampling_probs():
    from vllm_tokenswift.training.evaluate import SamplingSpec, sampling_probs, window_presence

    ids = torch.tensor([3, 1, 3, 2, 0, 4, 4, 1])
    pres = window_presence(ids, 2, 8, 6, window=3)
    for r, t in enumerate(range(2, 8)):
        want = set(ids[max(0, t - 2): t + 1].tolist())
        assert set(torch.nonzero(pres[r]).flatten().tolist()) == want
    allp = window_presence(ids, 0, 8, 6, window=0)
    assert set(torch.nonzero(allp[7]).flatten().tolist()) == {0, 1, 2, 3, 4}
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9]])
    spec = SamplingSpec(temperature=1.0, min_p=0.3, repetition_penalty=2.0, window=4)
    p = sampling_probs(logits, torch.tensor([[True, True, False, False]]), spec)
    # penalised logits [1.0, -2.0, 0.5, 1.9]; softmax; min_p 0.3 of the max drops -2.0 and 0.5
    raw = torch.softmax(torch.tensor([1.0, -2.0, 0.5, 1.9]), -1)
    keep = raw >= 0.3 * raw.max()
    want = raw * keep / (raw * keep).sum()
    torch.testing.assert_close(p[0], want)
    assert keep.tolist() == [True, False, False, True]


def test_q_acceptance_of_zero_and_trained_heads(trained, llama_dir):
    """Σ min(p, q): 1 for l_0 (q = p); for every head equal to a direct computation."""
    from vllm_tokenswift.training.evaluate import SamplingSpec, sampling_probs, window_presence

    model, tok = load_base_model(llama_dir)
    seqs = load_token_sequences(CORPUS, tok, 40)[:2]
    spec = SamplingSpec(temperature=0.8, min_p=0.05, repetition_penalty=1.3, window=8)
    heads = trained.heads.cpu().eval()
    res = evaluate_heads(model, heads, seqs, chunk_size=16, sampling=spec)
    assert res["distributions"][0]["q_acceptance"] == pytest.approx(1.0)
    # direct computation, position by position
    tot = [0.0] * 4
    cnt = [0] * 4
    with torch.no_grad():
        for ids in seqs:
            h0 = base_hidden_states(model, ids[None])[0]
            L = ids.numel()
            pres = window_presence(ids, 0, L, VOCAB, spec.window)
            p_all = sampling_probs(model.lm_head(model.model.norm(h0)), pres, spec)
            outs = heads(h0)
            for j in range(4):
                q = p_all if j == 0 else sampling_probs(model.lm_head(outs[j - 1]), pres, spec)
                for t in range(L - 1):
                    if t + j < L:
                        tot[j] += float(torch.minimum(p_all[t + j], q[t]).sum())
                        cnt[j] += 1
    for j in range(4):
        assert res["distributions"][j]["q_acceptance"] == pytest.approx(tot[j] / cnt[j], abs=1e-5)
    s = res["sampling"]
    a = [d["q_acceptance"] for d in res["distributions"]]
    assert 0.0 < s["expected_accepted_fused"] < s["expected_accepted_forward"] <= 4.0
    assert s["expected_accepted_forward"] >= 1.0  # l_0 (q = p) is always accepted
    assert s["expected_accepted_fused"] <= a[1] * 3
    # zero heads (W = 0, post-norm = final norm): every head repeats l_0 exactly
    zero = DraftHeads(64, 3, eps=model.config.rms_norm_eps).init_from_base(model.model.norm.weight)
    zres = evaluate_heads(model, zero, seqs, sampling=None)
    assert [round(d["top1"] * d["positions"]) for d in zres["distributions"][1:]] == \
        [_argmax_hits(model, seqs, shift) for shift in (2, 3, 4)]


def _argmax_hits(model, seqs, shift):
    """Top-1 hits of argmax l_0 at t against the token t+shift."""
    hits = 0
    with torch.no_grad():
        for ids in seqs:
            am = model(ids[None]).logits[0].argmax(-1)
            hits += int((am[: ids.numel() - shift] == ids[shift:]).sum())
    return hits


def test_eval_cli_resolves_model_names_and_yarn(capsys):
    """``--model tiny`` is the bundled demo model with its bundled heads; ``--yarn`` builds
    the model with the YaRN overrides (window x factor)."""
    from vllm_tokenswift.cli import main

    rc = main(["eval-heads", "--model", "tiny", "--data", str(CORPUS), "--seq-len", "64", "--max-docs", "2",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "q-accept" in out and "l_3 (head 3)" in out
    rc = main(["eval-heads", "--model", "tiny", "--heads", "zero", "--data", str(CORPUS), "--seq-len", "64",
               "--max-docs", "2", "--yarn", "2", "--no-progress"])
    assert rc == 0
    from vllm_tokenswift.cli.models import resolve_target, yarn_overrides
    from vllm_tokenswift.training.trainer import inspect_base_model

    model, heads = resolve_target("tiny")
    cfg = inspect_base_model(model, 100, yarn_overrides(model, 2))
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.max_position_embeddings == 2 * 20480
