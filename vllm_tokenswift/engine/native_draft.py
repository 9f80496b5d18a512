"""The native draft forward's vLLM side: whether it applies to this engine, and the packed
decoder (:class:`~vllm_tokenswift.kernels.draft_forward.PackedDecoder`) built from the target
vLLM loaded.

What it reads from vLLM 0.32 (``vllm/model_executor/models/llama.py``, ``qwen2.py``): the
decoder layers' modules (``self_attn.qkv_proj`` / ``o_proj`` / ``rotary_emb``,
``mlp.gate_up_proj`` / ``down_proj`` / ``act_fn``, the two ``RMSNorm``), ``model.norm``,
``lm_head`` and ``logits_processor``, and the attention layers' KV caches and impls from the
static forward context. vLLM's CPU linear layers hand their weight to oneDNN and drop the
tensor (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``,
``model_executor/layers/utils.py``), so the four projection weights of every layer are read
from the model's safetensors checkpoint (vLLM's own ``stacked_params_mapping``: q, k, v rows
into ``qkv_proj``, gate then up into ``gate_up_proj``); norms, biases, the rotary table and the
LM head come from the modules, which keep theirs.

It applies (:func:`unsupported_reason` is None) to an fp32 Llama/Qwen2-style decoder on vLLM's
CPU backend with the plugin's kernel loaded, one tensor- and pipeline-parallel rank, full
attention the kernel supports, plain RoPE (any ``RotaryEmbedding`` subclass that only changes
its ``cos_sin_cache``: YaRN, linear, Llama 3), SiLU-gated MLP, no logit scale or soft cap.
Anything else keeps vLLM's forward. The proposer also compares the two forwards once, on the
engine's first draft forward (:mod:`vllm_tokenswift.engine.target`), before it uses this one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vllm_tokenswift.kernels.draft_forward import DecoderLayerWeights, PackedDecoder, pack_weight

logger = logging.getLogger("vllm_tokenswift")

#: vLLM's fused projections and the checkpoint tensors stacked into them (in order)
STACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _decoder_layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return inner, (list(layers) if layers is not None else None)


def unsupported_reason(model, vllm_config, attn_modules: list, tp_size: int) -> str | None:
    """Why the native draft forward does not apply to this target (None: it does).

    Args:
        model: the target model vLLM loaded (``LlamaForCausalLM``-like).
        vllm_config: the engine's ``VllmConfig``.
        attn_modules: the target's ``Attention`` layers in layer order.
        tp_size: tensor-parallel world size.
    """
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from vllm_tokenswift.kernels.build import load_kernel, kernel_error
    from vllm_tokenswift.kernels.cpu_attention import impl_supported

    if tp_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
        return "tensor or pipeline parallelism (one rank only)"
    if vllm_config.model_config.dtype != torch.float32:
        return f"the target's dtype is {vllm_config.model_config.dtype} (float32 only)"
    if load_kernel() is None:
        return kernel_error() or "the plugin's CPU kernel is not loaded"
    inner, layers = _decoder_layers(model)
    if not layers or len(layers) != len(attn_modules):
        return "not a decoder whose model.layers match its attention layers"
    if type(getattr(inner, "norm", None)) is not RMSNorm or getattr(inner, "embed_tokens", None) is None:
        return "no model.norm RMSNorm or model.embed_tokens"
    eps = inner.norm.variance_epsilon
    lp = getattr(model, "logits_processor", None)
    if lp is None or getattr(lp, "scale", 1.0) != 1.0 or getattr(lp, "soft_cap", None) is not None:
        return "a logit scale or soft cap"
    if getattr(getattr(model, "lm_head", None), "weight", None) is None:
        return "no LM head weight"
    for i, (ly, attn) in enumerate(zip(layers, attn_modules)):
        sa, mlp = getattr(ly, "self_attn", None), getattr(ly, "mlp", None)
        need = [getattr(sa, n, None) for n in ("qkv_proj", "o_proj", "rotary_emb")]
        need += [getattr(mlp, n, None) for n in ("gate_up_proj", "down_proj", "act_fn")]
        if any(m is None for m in need):
            return f"layer {i} is not a Llama/Qwen2 decoder layer"
        if any(hasattr(sa, n) for n in ("q_norm", "k_norm")):
            return f"layer {i} normalises q/k (Qwen3-style)"
        if not isinstance(mlp.act_fn, SiluAndMul) or type(mlp.act_fn) is not SiluAndMul:
            return f"layer {i}'s MLP activation is {type(mlp.act_fn).__name__} (SiluAndMul only)"
        for n in ("input_layernorm", "post_attention_layernorm"):
            nm = getattr(ly, n, None)
            if type(nm) is not RMSNorm or not getattr(nm, "has_weight", True) or nm.variance_epsilon != eps:
                return f"layer {i}'s {n} is not a plain RMSNorm with the final norm's epsilon"
        rot = sa.rotary_emb
        if not isinstance(rot, RotaryEmbedding) or getattr(rot, "cos_sin_cache", None) is None:
            return f"layer {i}'s rotary embedding ({type(rot).__name__}) has no cos_sin_cache"
        for meth in ("forward_native", "forward_cpu", "forward_static", "forward_cuda"):
            if getattr(type(rot), meth, None) is not getattr(RotaryEmbedding, meth, None):
                return f"layer {i}'s rotary embedding {type(rot).__name__} overrides {meth}"
        for proj in ("qkv_proj", "o_proj"):
            if type(getattr(sa, proj).quant_method).__name__ != "UnquantizedLinearMethod":
                return f"layer {i} is quantized"
        for proj in ("gate_up_proj", "down_proj"):
            if type(getattr(mlp, proj).quant_method).__name__ != "UnquantizedLinearMethod":
                return f"layer {i} is quantized"
        impl = getattr(attn, "impl", None)
        if impl is None or not impl_supported(impl, None, None):
            return f"layer {i}'s attention is not one the plugin's kernel computes"
        kv = _kv_cache(attn)
        if kv is None or kv.dtype != torch.float32 or kv.dim() != 4 or not kv.is_cpu or not kv.is_contiguous():
            return f"layer {i}'s KV cache is not a contiguous float32 CPU cache"
    return None


def _kv_cache(attn) -> torch.Tensor | None:
    kv = getattr(attn, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    return kv if isinstance(kv, torch.Tensor) else None


def checkpoint_files(model_name: str, revision: str | None = None) -> list[Path]:
    """The ``*.safetensors`` files of the target's checkpoint: ``model_name`` as a local
    folder, else its copy in the Hugging Face cache (never downloaded from here).

    Raises:
        FileNotFoundError: no local folder or cached snapshot with safetensors files.
    """
    path = Path(model_name)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(model_name, revision=revision, local_files_only=True,
                                          allow_patterns=["*.safetensors", "*.json"]))
        except Exception as e:  # not cached, offline, not a hub id
            raise FileNotFoundError(f"no local checkpoint for {model_name!r}: {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .safetensors files")
    return files


def _projection_weights(files: list[Path], num_layers: int) -> list[dict[str, torch.Tensor]]:
    """Per layer, ``{fused name: [N, K] float32}`` for the four projections of :data:`STACKED`."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where[k] = f
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        for key in (f"model.{name}.weight", f"{name}.weight"):
            f = where.get(key)
            if f is not None:
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt")
                return handles[f].get_tensor(key).to(torch.float32)
        raise KeyError(f"the checkpoint has no {name}.weight")

    out = []
    for i in range(num_layers):
        out.append({fused: torch.cat([get(f"layers.{i}.{part}") for part in parts], dim=0)
                    for fused, parts in STACKED.items()})
    return out


def build_packed_decoder(model, vllm_config, attn_modules: list, block_size: int,
                         weight_dtype: str = "bfloat16") -> PackedDecoder:
    """Pack the target vLLM loaded for :func:`~vllm_tokenswift.kernels.draft_forward.draft_forward`
    (call :func:`unsupported_reason` first).

    Args:
        model: the target model; vllm_config: the engine's ``VllmConfig``.
        attn_modules: its ``Attention`` layers in layer order (their KV caches are used in place).
        block_size: the KV cache's block size in tokens.
        weight_dtype: ``"bfloat16"`` or ``"float32"``, the packed weights' dtype.

    Raises:
        FileNotFoundError / KeyError: the checkpoint or one of its projection tensors is missing.
        ValueError: a projection's shape differs from vLLM's module.
    """
    inner, layers = _decoder_layers(model)
    mc = vllm_config.model_config
    files = checkpoint_files(mc.model, getattr(mc, "revision", None))
    proj = _projection_weights(files, len(layers))
    first = layers[0].self_attn
    attn0 = attn_modules[0]
    hq, hkv, d = int(attn0.num_heads), int(attn0.num_kv_heads), int(attn0.head_size)
    hidden = int(inner.norm.weight.shape[0])
    out_layers = []
    inter = None
    for i, (ly, attn) in enumerate(zip(layers, attn_modules)):
        sa, mlp = ly.self_attn, ly.mlp
        w = proj[i]
        shapes = {"self_attn.qkv_proj": ((hq + 2 * hkv) * d, hidden), "self_attn.o_proj": (hidden, hq * d),
                  "mlp.down_proj": (hidden, w["mlp.down_proj"].shape[1]),
                  "mlp.gate_up_proj": (2 * w["mlp.down_proj"].shape[1], hidden)}
        for name, shape in shapes.items():
            if tuple(w[name].shape) != shape:
                raise ValueError(f"layer {i}'s {name} is {tuple(w[name].shape)} in the checkpoint, "
                                 f"{shape} in vLLM's model")
        inter = int(w["mlp.down_proj"].shape[1])

        def bias(m):
            b = getattr(m, "bias", None)
            return b.detach().float().contiguous() if isinstance(b, torch.Tensor) and b.numel() else None

        out_layers.append(DecoderLayerWeights(
            ln1=ly.input_layernorm.weight.detach().float(), ln2=ly.post_attention_layernorm.weight.detach().float(),
            qkv=pack_weight(w["self_attn.qkv_proj"], weight_dtype), o=pack_weight(w["self_attn.o_proj"], weight_dtype),
            gate_up=pack_weight(w["mlp.gate_up_proj"], weight_dtype), down=pack_weight(w["mlp.down_proj"], weight_dtype),
            kv_cache=_kv_cache(attn), b_qkv=bias(sa.qkv_proj), b_o=bias(sa.o_proj),
            b_gate_up=bias(mlp.gate_up_proj), b_down=bias(mlp.down_proj)))
    rot = first.rotary_emb
    lm = model.lm_head.weight.detach()
    vocab = int(mc.get_vocab_size())
    return PackedDecoder(
        out_layers, inner.norm.weight.detach().float(), rot.cos_sin_cache.detach().float(), hidden, hq, hkv, d,
        inter, block_size, float(inner.norm.variance_epsilon), float(attn0.impl.scale),
        bool(rot.is_neox_style), weight_dtype, lm_head=pack_weight(lm[:vocab], weight_dtype), vocab_size=vocab)


def describe(dec: PackedDecoder) -> str:
    """One log line's worth: layers, weight dtype and the packed copy's size."""
    return (f"{dec.num_layers} layers, {dec.weight_dtype} weights, "
            f"{dec.nbytes() / 2**20:.0f} MiB packed")

