"""Unit tests of the dependent draft heads (Sec 3.2) and their checkpoint formats."""

import json

import pytest
import torch

from vllm_tokenswift.core.heads import (DraftHeads, HeadsLoadError, export_tokenswift_layout, load_heads,
                                   rms_norm, save_heads, zero_heads)

H = 64


def random_heads(seed=0):
    torch.manual_seed(seed)
    heads = DraftHeads(H, 3, eps=1e-6)
    with torch.no_grad():
        for hd in heads.heads:
            hd.linear.weight.normal_(0, 0.1)
            hd.input_layernorm.normal_(1, 0.1)
            hd.post_layernorm.normal_(1, 0.1)
    return heads


def reference(heads, h0):
    outs, h = [], h0
    for hd in heads.heads:
        x = h.float()
        n_in = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * hd.input_layernorm
        h = h + n_in @ hd.linear.weight.T
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * hd.post_layernorm
        outs.append(y)
    return outs


def test_shapes_and_reference_computation():
    heads = random_heads()
    h0 = torch.randn(5, H)
    outs = heads(h0)
    assert len(outs) == 3 and all(o.shape == (5, H) and o.dtype == torch.float32 for o in outs)
    for got, ref in zip(outs, reference(heads, h0)):
        assert torch.allclose(got, ref, atol=1e-5)


def test_fresh_heads_reproduce_normed_input():
    heads = DraftHeads(H, 3)
    h0 = torch.randn(4, H)
    expect = rms_norm(h0, torch.ones(H), 1e-6)
    for o in heads(h0):
        assert torch.allclose(o, expect, atol=1e-6)


def test_zero_heads_repeat_the_base_prediction():
    """zero_heads(model): every head outputs the target's FinalNorm(h_0), so l_i = l_0 exactly;
    the model's eps and final-norm weight are used, in the requested dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=H, intermediate_size=96,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         rms_norm_eps=1e-5))
    with torch.no_grad():
        model.model.norm.weight.normal_(1.5, 0.5)
    heads = zero_heads(model, 2)
    assert heads.num_heads == 2 and heads.eps == 1e-5
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    h0 = torch.randn(4, H)
    base = model.model.norm(h0)
    for out in heads(h0):
        assert torch.allclose(out, base, atol=1e-6, rtol=0)
        assert torch.equal(model.lm_head(out).argmax(-1), model.lm_head(base).argmax(-1))
    assert all(p.dtype == torch.bfloat16 for p in zero_heads(model, 3, dtype=torch.bfloat16).parameters())
    with pytest.raises(ValueError, match="num_heads"):
        zero_heads(model, 0)
    with pytest.raises(ValueError, match="model.model.norm"):
        zero_heads(torch.nn.Linear(2, 2))


def test_save_load_roundtrip_and_dtype(tmp_path):
    heads = random_heads(1)
    save_heads(heads, tmp_path / "h", metadata={"base_model": "tiny"})
    cfg = json.loads((tmp_path / "h" / "tokenswift_heads.json").read_text())
    assert cfg["num_heads"] == 3 and cfg["hidden_size"] == H and cfg["base_model"] == "tiny"
    loaded = load_heads(tmp_path / "h", hidden_size=H)
    h0 = torch.randn(3, H)
    for a, b in zip(heads(h0), loaded(h0)):
        assert torch.equal(a, b)
    bf = load_heads(tmp_path / "h", hidden_size=H, dtype=torch.bfloat16)
    assert next(bf.parameters()).dtype == torch.bfloat16
    with pytest.raises(HeadsLoadError, match="float32"):
        load_heads(tmp_path / "h", hidden_size=H, dtype=torch.bfloat16, strict_dtype=True)


def test_published_medusa_layout_reads_only_head_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    heads = random_heads(2)
    export_tokenswift_layout(heads, tmp_path / "ts", base_config={"model_type": "llama"})
    tensors = load_file(str(tmp_path / "ts" / "model.safetensors"))
    assert set(tensors) == {f"model.medusa_layers.{i}.{p}" for i in range(3)
                            for p in ("linear.weight", "input_layernorm.weight", "post_layernorm.weight")}
    # a full model folder: extra base-model tensors in another shard are ignored
    save_file({"model.embed_tokens.weight": torch.randn(10, H)}, str(tmp_path / "ts" / "model-base.safetensors"))
    loaded = load_heads(tmp_path / "ts", hidden_size=H)
    for a, b in zip(heads.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_mismatches_fail_clearly(tmp_path):
    heads = random_heads()
    save_heads(heads, tmp_path / "h")
    with pytest.raises(HeadsLoadError, match="hidden size 64 but the target model has 128"):
        load_heads(tmp_path / "h", hidden_size=128)
    with pytest.raises(HeadsLoadError, match="hold 3 heads but tokenswift.num_heads=4"):
        load_heads(tmp_path / "h", hidden_size=H, num_heads=4)
    # more heads than configured: the first num_heads are used (dependent heads)
    two = load_heads(tmp_path / "h", hidden_size=H, num_heads=2)
    assert two.num_heads == 2
    x = torch.randn(5, H)
    full = load_heads(tmp_path / "h", hidden_size=H)
    for a, b in zip(two(x), full(x)[:2]):
        torch.testing.assert_close(a, b)
    with pytest.raises(HeadsLoadError, match="not a folder"):
        load_heads(tmp_path / "missing", hidden_size=H)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsLoadError, match="neither"):
        load_heads(tmp_path / "empty", hidden_size=H)
