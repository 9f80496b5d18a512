"""TokenSwift's dependent draft heads (paper Sec 3.2) and their checkpoint formats.

Structure (γ = ``num_heads`` = 3 in the paper)::

    h_0 = last hidden state of the target, *before* the final norm      [N, H]
    h_i = h_{i-1} + W_i · RMSNorm_in_i(h_{i-1})                          i = 1..γ
    l_i = lm_head(RMSNorm_post_i(h_i))                                   [N, V]

``l_0`` is the target's own next-token logits. The LM head is the target's and
is applied by the caller (vLLM's ``compute_logits``), so no copy of the model or
of the LM head is kept here: :class:`DraftHeads` returns the post-normed hidden
states ``RMSNorm_post_i(h_i)``.

Two on-disk formats load with :func:`load_heads`:

* the project's own: a folder with ``tokenswift_heads.json`` and
  ``heads.safetensors`` holding ``heads.{i}.linear.weight`` [H, H],
  ``heads.{i}.input_layernorm.weight`` [H], ``heads.{i}.post_layernorm.weight`` [H];
* the published TokenSwift checkpoints: full Llama/Qwen2 model folders whose
  ``config.json`` has ``medusa_heads`` and whose safetensors carry
  ``model.medusa_layers.{i}.linear.weight`` etc. Only those tensors are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HEADS_CONFIG_NAME = "tokenswift_heads.json"
HEADS_WEIGHTS_NAME = "heads.safetensors"
FORMAT_NAME = "vllm-tokenswift-heads"
FORMAT_VERSION = 1
MEDUSA_PREFIX = "model.medusa_layers."
_PARTS = ("linear.weight", "input_layernorm.weight", "post_layernorm.weight")


class HeadsLoadError(ValueError):
    """A heads checkpoint is missing, malformed or does not fit the target model."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm, computed in fp32 and cast back to ``x.dtype``.

    Args:
        x: ``[..., H]`` any float dtype.
        weight: ``[H]``.
        eps: variance epsilon (the target's ``rms_norm_eps``).
    """
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


class DraftHead(nn.Module):
    """One dependent residual head: ``h' = h + W·RMSNorm_in(h)``; output ``RMSNorm_post(h')``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(hidden_size, hidden_size, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(hidden_size))
        self.post_layernorm = nn.Parameter(torch.ones(hidden_size))
        nn.init.zeros_(self.linear.weight)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: h ``[N, H]``. Returns ``(h_next [N, H], normed [N, H])``."""
        h_next = h + self.linear(rms_norm(h, self.input_layernorm, self.eps))
        return h_next, rms_norm(h_next, self.post_layernorm, self.eps)


class DraftHeads(nn.Module):
    """γ dependent draft heads on the target's pre-final-norm hidden state (Sec 3.2).

    A fresh instance has ``W_i = 0`` and norm weights 1; after
    :meth:`init_from_base` (post-norm weights = the target's final-norm weight) every
    head reproduces the base next-token prediction ``l_0`` exactly ("zero heads"),
    which is where training starts.

    Args:
        hidden_size: H of the target model.
        num_heads: γ (3 in the paper).
        eps: RMSNorm epsilon; use the target's ``rms_norm_eps``.
    """

    def __init__(self, hidden_size: int, num_heads: int = 3, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.heads = nn.ModuleList(DraftHead(hidden_size, eps) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @torch.no_grad()
    def init_from_base(self, final_norm_weight: torch.Tensor) -> "DraftHeads":
        """Set every head's post-norm weight to the target's final-norm weight ``[H]``.

        With ``W_i = 0`` each head then outputs ``FinalNorm(h_0)``, so ``l_i = l_0``: the
        untrained heads predict exactly what the base model predicts. Real models have
        final-norm weights far from 1 (SmolLM2-135M: mean 1.8, range -2.1..3.3), so
        starting from norm weights 1 would start from a distribution the LM head was
        never trained on. Returns ``self``.

        Raises:
            ValueError: ``final_norm_weight`` is not ``[hidden_size]``.
        """
        w = final_norm_weight.detach().reshape(-1)
        if w.numel() != self.hidden_size:
            raise ValueError(f"final norm weight has {w.numel()} entries, hidden size is {self.hidden_size}")
        for hd in self.heads:
            hd.post_layernorm.copy_(w.to(hd.post_layernorm.device, hd.post_layernorm.dtype))
        return self

    def forward(self, h0: torch.Tensor) -> list[torch.Tensor]:
        """Post-normed hidden states of every head.

        Args:
            h0: ``[N, H]`` pre-final-norm hidden state of the newest token.
        Returns:
            ``num_heads`` tensors ``[N, H]`` (dtype of ``h0``): ``RMSNorm_post_i(h_i)``.
            Apply the target's LM head to get ``l_1..l_γ``.
        """
        outs = []
        h = h0
        for head in self.heads:
            h, normed = head(h)
            outs.append(normed)
        return outs

    # ------------------------------------------------------------------ I/O
    def state_dict_flat(self) -> dict[str, torch.Tensor]:
        """Tensors in the project's layout (``heads.{i}.<part>``), contiguous, on CPU."""
        out = {}
        for i, hd in enumerate(self.heads):
            out[f"heads.{i}.linear.weight"] = hd.linear.weight.detach().cpu().contiguous()
            out[f"heads.{i}.input_layernorm.weight"] = hd.input_layernorm.detach().cpu().contiguous()
            out[f"heads.{i}.post_layernorm.weight"] = hd.post_layernorm.detach().cpu().contiguous()
        return out

    def load_flat(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``heads.{i}.<part>`` tensors in (shapes checked)."""
        for i, hd in enumerate(self.heads):
            for part, param in (("linear.weight", hd.linear.weight),
                                ("input_layernorm.weight", hd.input_layernorm),
                                ("post_layernorm.weight", hd.post_layernorm)):
                key = f"heads.{i}.{part}"
                if key not in tensors:
                    raise HeadsLoadError(f"heads checkpoint lacks tensor {key}")
                t = tensors[key]
                if tuple(t.shape) != tuple(param.shape):
                    raise HeadsLoadError(
                        f"{key} has shape {tuple(t.shape)}, expected {tuple(param.shape)} "
                        f"(target hidden size {self.hidden_size})"
                    )
                with torch.no_grad():
                    param.copy_(t.to(param.dtype))


def zero_heads(model: nn.Module, num_heads: int = 3, *, dtype: torch.dtype | None = None) -> DraftHeads:
    """Untrained heads of a Hugging Face causal LM: ``W_i = 0`` and post-norm weights equal to
    the target's final norm (:meth:`DraftHeads.init_from_base`), so every head repeats the
    base next-token prediction ``l_0``; where training starts, and the baseline of evaluations.

    Args:
        model: a Llama-style ``*ForCausalLM``: its final-norm weight ``model.model.norm.weight``
            ``[H]`` gives H and the post-norm weights, ``model.config.rms_norm_eps`` the eps.
        num_heads: γ.
        dtype: dtype of the heads (default: that of the final-norm weight); they are put on
            the final-norm weight's device.

    Raises:
        ValueError: the model has no final norm ``model.model.norm`` or ``num_heads`` < 1.
    """
    norm = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
    if norm is None:
        raise ValueError("zero_heads needs a Llama-style model with model.model.norm.weight")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6) or 1e-6)
    heads = DraftHeads(int(norm.numel()), num_heads, eps=eps).to(norm.device, dtype or norm.dtype)
    return heads.init_from_base(norm)


@dataclass(frozen=True)
class HeadsInfo:
    """What a checkpoint declares: format, hidden size, head count, dtype, eps."""

    fmt: str  # "tokenswift-heads" | "medusa-layout"
    hidden_size: int
    num_heads: int
    dtype: torch.dtype
    eps: float | None


def _dtype_from_str(s: str | None) -> torch.dtype:
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if s is None:
        return torch.float32
    if s not in table:
        raise HeadsLoadError(f"unsupported heads dtype {s!r}")
    return table[s]


def save_heads(heads: DraftHeads, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
               metadata: dict | None = None) -> Path:
    """Write ``heads`` in the project's format (``tokenswift_heads.json`` + ``heads.safetensors``).

    Args:
        heads: the trained heads.
        out_dir: folder to create or overwrite files in.
        dtype: storage dtype (default: the heads' parameter dtype).
        metadata: extra JSON fields (base model, training figures, ...).
    Returns:
        the folder path.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = heads.state_dict_flat()
    dt = dtype or next(heads.parameters()).dtype
    tensors = {k: v.to(dt).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / HEADS_WEIGHTS_NAME), metadata={"format": FORMAT_NAME})
    cfg = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "hidden_size": heads.hidden_size,
        "num_heads": heads.num_heads,
        "rms_norm_eps": heads.eps,
        "dtype": str(dt).replace("torch.", ""),
    }
    cfg.update(metadata or {})
    (out / HEADS_CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def export_tokenswift_layout(heads: DraftHeads, out_dir: str | os.PathLike,
                             base_config: dict | None = None,
                             dtype: torch.dtype | None = None) -> Path:
    """Write the published TokenSwift layout: ``model.medusa_layers.{i}.*`` tensors in
    ``model.safetensors`` and a ``config.json`` with ``medusa_heads``.

    Only the head tensors are written (not the base model's weights); the
    result loads with :func:`load_heads` like a published checkpoint.

    Args:
        base_config: the target's HF ``config.json`` dict to copy fields from.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dt = dtype or next(heads.parameters()).dtype
    tensors = {}
    for key, t in heads.state_dict_flat().items():
        _, i, part = key.split(".", 2)
        tensors[f"{MEDUSA_PREFIX}{i}.{part}"] = t.to(dt).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(base_config or {})
    cfg.update({"medusa_heads": heads.num_heads, "hidden_size": heads.hidden_size,
                "rms_norm_eps": heads.eps, "torch_dtype": str(dt).replace("torch.", "")})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def inspect_heads(path: str | os.PathLike) -> HeadsInfo:
    """Read a checkpoint's declared shape without loading its weights.

    Raises:
        HeadsLoadError: missing folder/files or a folder of neither format.
    """
    p = Path(path)
    if not p.is_dir():
        raise HeadsLoadError(f"heads checkpoint {str(p)!r} is not a folder")
    own = p / HEADS_CONFIG_NAME
    if own.is_file():
        cfg = json.loads(own.read_text())
        if cfg.get("format") != FORMAT_NAME:
            raise HeadsLoadError(f"{own} is not a {FORMAT_NAME} config")
        if not (p / HEADS_WEIGHTS_NAME).is_file():
            raise HeadsLoadError(f"{p / HEADS_WEIGHTS_NAME} is missing")
        return HeadsInfo("tokenswift-heads", int(cfg["hidden_size"]), int(cfg["num_heads"]),
                         _dtype_from_str(cfg.get("dtype")), cfg.get("rms_norm_eps"))
    hf = p / "config.json"
    if hf.is_file():
        cfg = json.loads(hf.read_text())
        if "medusa_heads" in cfg:
            dt = cfg.get("torch_dtype") or cfg.get("dtype")
            return HeadsInfo("medusa-layout", int(cfg["hidden_size"]), int(cfg["medusa_heads"]),
                             _dtype_from_str(dt if isinstance(dt, str) else None),
                             cfg.get("rms_norm_eps"))
    raise HeadsLoadError(
        f"{str(p)!r} holds neither a {HEADS_CONFIG_NAME} (vllm-tokenswift heads) nor a config.json "
        f"with 'medusa_heads' (published TokenSwift checkpoint)"
    )


def _read_medusa_tensors(p: Path, num_heads: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise HeadsLoadError(f"no *.safetensors files in {p}")
    wanted = {f"{MEDUSA_PREFIX}{i}.{part}" for i in range(num_heads) for part in _PARTS}
    index = p / "model.safetensors.index.json"
    if index.is_file():  # sharded: open only the shards holding head tensors
        wm = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({p / wm[k] for k in wanted if k in wm}) or files
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k in wanted:
                    found[k] = sf.get_tensor(k)
    missing = sorted(wanted - set(found))
    if missing:
        raise HeadsLoadError(f"TokenSwift checkpoint {p} lacks tensors: {missing[:4]}...")
    return {f"heads.{k[len(MEDUSA_PREFIX):]}": v for k, v in found.items()}


def load_heads(path: str | os.PathLike, *, hidden_size: int, num_heads: int | None = None,
               eps: float = 1e-6, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", strict_dtype: bool = False) -> DraftHeads:
    """Load a heads checkpoint of either format and check it fits the target.

    Args:
        path: folder (project format or TokenSwift model folder).
        hidden_size: the target's hidden size H.
        num_heads: heads to use (None: all the checkpoint has). A checkpoint with more
            heads than that loads its first ``num_heads`` (the heads are dependent:
            head i only reads heads 1..i-1, so a prefix of them is a valid set).
        eps: the target's ``rms_norm_eps`` (used when the checkpoint has none).
        dtype: dtype to run the heads in (the target's dtype).
        device: where to put the heads.
        strict_dtype: raise if the stored dtype differs from ``dtype`` instead of casting.
    Returns:
        :class:`DraftHeads` in eval mode, ``requires_grad`` off.
    Raises:
        HeadsLoadError: on a hidden-size or (strict) dtype mismatch, fewer heads than
            ``num_heads``, or missing tensors.
    """
    info = inspect_heads(path)
    if info.hidden_size != hidden_size:
        raise HeadsLoadError(
            f"heads in {path} have hidden size {info.hidden_size} but the target model has "
            f"{hidden_size}: they were trained for another model"
        )
    if num_heads is not None and info.num_heads < num_heads:
        raise HeadsLoadError(
            f"heads in {path} hold {info.num_heads} heads but tokenswift.num_heads={num_heads} "
            f"(use num_heads <= {info.num_heads}, with a tree of num_heads + 1 entries)"
        )
    use = info.num_heads if num_heads is None else num_heads
    if strict_dtype and info.dtype != dtype:
        raise HeadsLoadError(f"heads in {path} are {info.dtype}, target runs in {dtype}")
    p = Path(path)
    if info.fmt == "tokenswift-heads":
        from safetensors.torch import load_file

        tensors = load_file(str(p / HEADS_WEIGHTS_NAME))
    else:
        tensors = _read_medusa_tensors(p, info.num_heads)
    heads = DraftHeads(hidden_size, use, eps=info.eps if info.eps is not None else eps)
    heads.load_flat(tensors)
    heads = heads.to(device=device, dtype=dtype).eval()
    for prm in heads.parameters():
        prm.requires_grad_(False)
    return heads
