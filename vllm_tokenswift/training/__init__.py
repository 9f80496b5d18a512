"""Draft-head training and offline evaluation (paper Sec 3.2 and Sec 4.1).

Python API (imported lazily, so ``vllm-tokenswift --help`` stays fast)::

    from vllm_tokenswift.training import train_heads, evaluate_heads, TrainHeadsError

    res = train_heads("meta-llama/Llama-3.1-8B", "pg19_train.jsonl", "out/heads",
                      seq_len=8192, steps=200)
    res.heads_dir  # -> load with vllm_tokenswift.core.heads.load_heads

Modules: ``data`` (corpus -> ``[N, L]`` token sequences; packing),
``trainer`` (:func:`train_heads`, chunked loss, checkpoints, metrics, plot),
``evaluate`` (:func:`evaluate_heads`: per-head accuracy and greedy-chain
acceptance), ``cli`` (the ``train-heads`` and ``eval-heads`` sub-commands).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainHeadsError": "vllm_tokenswift.training.data",
    "load_token_sequences": "vllm_tokenswift.training.data",
    "iter_documents": "vllm_tokenswift.training.data",
    "build_sequences": "vllm_tokenswift.training.data",
    "train_heads": "vllm_tokenswift.training.trainer",
    "TrainResult": "vllm_tokenswift.training.trainer",
    "heads_loss": "vllm_tokenswift.training.trainer",
    "load_base_model": "vllm_tokenswift.training.trainer",
    "base_hidden_states": "vllm_tokenswift.training.trainer",
    "evaluate_heads": "vllm_tokenswift.training.evaluate",
    "format_report": "vllm_tokenswift.training.evaluate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
