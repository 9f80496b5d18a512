"""A model folder's window and YaRN rope scaling: its ``config.json``, the tokens it can
hold, and the config overrides that extend its window (``--yarn FACTOR``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_model_config(model: str | os.PathLike) -> dict | None:
    """``config.json`` of a model folder (``text_config`` merged in), or None."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {**cfg, **(cfg.get("text_config") or {})}


def yarn_overrides(model: str | os.PathLike, factor: float) -> dict:
    """Config overrides that extend ``model``'s window ``factor`` times with YaRN.

    With transformers 5 the rope settings live in ``config.rope_parameters`` (the old
    ``rope_scaling`` name is an alias of it), and vLLM 0.32 builds its rotary embedding
    from the same dict. YaRN takes ``factor`` and ``original_max_position_embeddings``
    (the trained window); ``max_position_embeddings`` must already be the extended
    window: vLLM does not multiply it by the YaRN factor (``_get_and_verify_max_len``)
    and transformers derives the attention factor from the same fields. Pass the result
    as ``LLM(hf_overrides=...)`` / ``--hf-overrides``, or set each key on a transformers
    config (``setattr(config, key, value)``) before building the model.

    Args:
        model: a model folder with a ``config.json``.
        factor: window multiplier, > 1 (2 turns SmolLM2's 8,192 tokens into 16,384).

    Returns:
        ``{"rope_parameters": {"rope_type": "yarn", "factor": F,
        "original_max_position_embeddings": M, "rope_theta": θ, ...},
        "max_position_embeddings": int(M * F)}``.

    Raises:
        ValueError: ``factor`` <= 1, no readable ``config.json`` with
            ``max_position_embeddings``, or the model already uses rope scaling.
    """
    f = float(factor)
    if not f > 1.0:
        raise ValueError(f"the YaRN factor must be > 1, got {factor}")
    cfg = read_model_config(model)
    if not cfg or not cfg.get("max_position_embeddings"):
        raise ValueError(f"{model}: no config.json with max_position_embeddings, cannot apply YaRN")
    window = int(cfg["max_position_embeddings"])
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    if rope_type != "default":
        raise ValueError(f"{model} already uses {rope_type!r} rope scaling; YaRN is applied to "
                         "models with plain rope only")
    theta = rp.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    rp.pop("factor", None)
    rope = {**rp, "rope_type": "yarn", "factor": f, "original_max_position_embeddings": window,
            "rope_theta": float(theta)}
    return {"rope_parameters": rope, "max_position_embeddings": int(window * f)}


def model_window(model: str | os.PathLike, yarn: float | None = None) -> int | None:
    """Tokens ``model`` can hold: ``max_position_embeddings`` (× ``yarn`` if given), or
    None when the folder has no readable config."""
    cfg = read_model_config(model)
    if not cfg or not cfg.get("max_position_embeddings"):
        return None
    return int(int(cfg["max_position_embeddings"]) * (float(yarn) if yarn else 1.0))
