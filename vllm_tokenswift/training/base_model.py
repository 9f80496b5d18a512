"""The base model the heads are trained on: the device and dtype to train with, loading a
transformers causal LM (a local folder or a model from the cache; never the hub at run
time), checking it has the structure TokenSwift's heads need (a final norm before the LM
head), and its pre-norm hidden states.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_tokenswift.training.data import TrainHeadsError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` → CUDA when available else CPU.

    Raises:
        TrainHeadsError: CUDA requested but not available.
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainHeadsError(f"device {str(device)!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` → bf16 on CUDA, fp32 otherwise; accepts names like ``"bfloat16"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise TrainHeadsError(f"unsupported dtype {dtype!r} (use float32 or bfloat16)")
    return table[dtype]


def check_base_structure(model, where: str = "model") -> None:
    """Check that ``model`` has the Llama/Qwen2 layout the heads need.

    Required: ``model.model.layers``, ``model.model.norm`` (final norm, its
    input is ``h_0``) and ``model.lm_head`` (an ``nn.Linear``-like module with a
    ``weight`` of shape ``[V, H]``).

    Raises:
        TrainHeadsError: naming the first missing attribute.
    """
    inner = getattr(model, "model", None)
    missing = None
    if inner is None:
        missing = "model.model"
    elif getattr(inner, "layers", None) is None:
        missing = "model.model.layers"
    elif getattr(inner, "norm", None) is None:
        missing = "model.model.norm"
    elif getattr(model, "lm_head", None) is None or getattr(model.lm_head, "weight", None) is None:
        missing = "model.lm_head"
    if missing:
        raise TrainHeadsError(
            f"{where} ({type(model).__name__}) has no {missing}: draft heads need a Llama/Qwen2-style "
            f"causal LM with model.model.layers, model.model.norm and model.lm_head"
        )


def inspect_base_model(model_path: str | os.PathLike, seq_len: int | None = None,
                       config_overrides: dict | None = None):
    """Check a base model *before* loading its weights; return its HF config.

    Loads ``config.json`` only (plus ``config_overrides``, e.g. YaRN's from
    :func:`vllm_tokenswift.cli.models.yarn_overrides`), checks ``seq_len <=
    max_position_embeddings``, and instantiates the architecture on the ``meta``
    device (no memory) to check :func:`check_base_structure`.

    Raises:
        TrainHeadsError: unreadable/missing config, unsupported architecture,
            missing layers, or ``seq_len`` beyond the model's context.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    mp = str(model_path)
    p = Path(mp).expanduser()
    if p.exists() and not p.is_dir():
        raise TrainHeadsError(f"model path {mp!r} is a file, expected a model folder")
    if not p.exists() and (p.is_absolute() or mp.startswith((".", "~")) or not _looks_like_hub_id(mp)):
        raise TrainHeadsError(f"model folder {mp!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise TrainHeadsError(f"model folder {mp!r} has no config.json (not a Hugging Face model)")
    try:
        config = AutoConfig.from_pretrained(mp)
    except Exception as e:  # OSError, ValueError, ... from transformers
        raise TrainHeadsError(f"cannot load a model config from {mp!r}: {e}") from None
    for k, v in (config_overrides or {}).items():
        setattr(config, k, v)
    max_pos = getattr(config, "max_position_embeddings", None)
    if seq_len is not None and max_pos is not None and seq_len > int(max_pos):
        raise TrainHeadsError(
            f"--seq-len {seq_len} is beyond the model's context (max_position_embeddings={max_pos})"
        )
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise TrainHeadsError(f"{mp!r} is not a causal LM transformers can build: {e}") from None
    check_base_structure(skeleton, where=f"model {mp!r}")
    del skeleton
    return config


def _looks_like_hub_id(s: str) -> bool:
    """``org/name`` or a legacy bare ``name`` (no further path separators)."""
    parts = s.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not s.startswith((".", "/", "~"))


def load_base_model(model_path: str | os.PathLike, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, tokenizer_path: str | None = None,
                    load_tokenizer: bool = True, config_overrides: dict | None = None):
    """Load a frozen Hugging Face causal LM (and its tokenizer) for head training/eval.

    Args:
        model_path: local folder or hub id (offline machines: a folder).
        device: where to put the model.
        dtype: parameter dtype (bf16 on GPU, fp32 on CPU by default upstream).
        tokenizer_path: tokenizer folder/id (default: ``model_path``).
        config_overrides: set on the model's config before it is built (YaRN: the same
            ``rope_parameters``/``max_position_embeddings`` vLLM gets as ``hf_overrides``,
            so heads train on the hidden states the engine will produce).
    Returns:
        ``(model, tokenizer)``; the model is in eval mode with ``requires_grad``
        off for every parameter. ``tokenizer`` is ``None`` if not requested.
    Raises:
        TrainHeadsError: load failure or a model without the needed layers.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        kw = {}
        if config_overrides:
            cfg = AutoConfig.from_pretrained(str(model_path))
            for k, v in config_overrides.items():
                setattr(cfg, k, v)
            kw["config"] = cfg
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, **kw)
    except Exception as e:
        raise TrainHeadsError(f"cannot load the model from {str(model_path)!r}: {e}") from None
    check_base_structure(model, where=f"model {str(model_path)!r}")
    model.to(device).eval()
    model.requires_grad_(False)
    tok = None
    if load_tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        except Exception as e:
            raise TrainHeadsError(
                f"cannot load a tokenizer from {str(tokenizer_path or model_path)!r}: {e}") from None
    return model, tok


def base_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``h_0``: the base model's last hidden state before its final norm (Sec 3.2).

    Runs ``model.model`` (not the LM head) under ``torch.no_grad`` and captures
    the input of ``model.model.norm`` with a forward pre-hook.

    Args:
        model: HF causal LM passing :func:`check_base_structure`.
        input_ids: ``torch.long`` ``[B, L]`` on the model's device.
    Returns:
        ``[B, L, H]`` in the model's dtype, detached.
    """
    captured: list[torch.Tensor] = []

    def hook(_mod, args):
        captured.append(args[0])

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model.model(input_ids=input_ids, use_cache=False)
    finally:
        handle.remove()
    if not captured:
        raise TrainHeadsError("the base model's forward never called model.model.norm")
    return captured[-1].detach()
