"""Tiny random Llama/Qwen2 models built in a temp dir for the tests (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_model(out_dir: str | Path, arch: str = "llama", *, vocab_size: int = 512,
                     hidden_size: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     max_pos: int = 8192, seed: int = 0, init_std: float = 0.2) -> Path:
    """Save a random ``arch`` ("llama": GQA, untied; "qwen2": qkv bias, tied embeddings, MHA)
    model (fp32 safetensors + config) to ``out_dir``. The Qwen2 model's q/k/v biases are drawn
    like its weights (HF initialises them to zero, which would leave the bias path untested). head_dim = hidden/heads must be one the
    CPU attention kernel supports (32, 64, ...).

    A larger ``init_std`` than HF's default makes the random model's next-token
    distribution peaked, so greedy decoding is deterministic and fairly repetitive,
    which is what long-generation tests need.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6, initializer_range=init_std, bos_token_id=0, eos_token_id=1,
                  torch_dtype="float32")
    if arch == "llama":
        cfg = LlamaConfig(num_key_value_heads=kv_heads, tie_word_embeddings=False, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(num_key_value_heads=heads, tie_word_embeddings=True,
                          use_sliding_window=False, **common)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, init_std)
    else:
        raise ValueError(arch)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_random_heads(out_dir: str | Path, hidden_size: int, seed: int = 1, scale: float = 0.05) -> Path:
    """Heads checkpoint with small random W_i (non-trivial, for exercising the path)."""
    from vllm_tokenswift.core.heads import DraftHeads, save_heads

    torch.manual_seed(seed)
    heads = DraftHeads(hidden_size, 3)
    with torch.no_grad():
        for h in heads.heads:
            h.linear.weight.normal_(0, scale)
    return save_heads(heads, out_dir)


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Byte-level BPE tokenizer (``tokenizers``) trained on a bundled paragraph, saved as a
    ``PreTrainedTokenizerFast`` next to a tiny model so vLLM can serve text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (Path(__file__).parent / "data" / "tiny_corpus.jsonl").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out_dir))
    return Path(out_dir)
