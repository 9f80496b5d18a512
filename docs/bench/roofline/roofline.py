"""GPU roofline projection of ultra-long generation wall time (``roofline_cli.py project``; research
maths kept beside the docs, not part of the plugin).

Pure Python + numpy; imports neither vLLM nor torch, so it runs anywhere.

The model
=========

Batch-1 decoding of a dense decoder-only transformer is memory-bandwidth bound:
each forward pass streams every weight that takes part in the matmuls, plus the
KV cache it attends to, from HBM once. Compute is checked too (a true roofline
takes ``max(memory time, compute time)`` per forward), but at batch 1 with at most
``k + 1`` query tokens it never binds for the presets.

Units used throughout: bytes (B), seconds (s), tokens, FLOPs; bandwidth in
TB/s = 1e12 B/s; peak compute in TFLOP/s = 1e12 FLOP/s.

Per forward pass over ``q`` query tokens attending to ``c`` cached tokens:

* weight bytes ``W = (non-embedding params + vocab * hidden) * dtype_bytes``: all
  layer matrices, norms and biases plus the LM head read in full; the input
  embedding is a row lookup (``q`` rows, neglected). For tied embeddings the one
  shared matrix is read in full as the LM head, which is the same count.
* KV bytes ``c * kv_bytes_per_token`` with
  ``kv_bytes_per_token = 2 (K and V) * layers * kv_heads * head_dim * dtype_bytes``.
  Writing the ``q`` new KV entries and reading activations are neglected (< 0.01 %).
* FLOPs ``q * (2 * read_params + 4 * layers * heads * head_dim * c)`` (matmuls plus
  the QK^T and PV products).
* time ``max(bytes / (B * eff), flops / (P * eff))`` with ``B`` the peak bandwidth,
  ``P`` the peak dense 16-bit tensor throughput and ``eff`` the achievable fraction
  (default 0.8: well-tuned decode kernels reach 75-90 % of the datasheet bandwidth).

Per method and *step* (one scheduler iteration), at context ``c`` tokens already
in the cache:

``ar``
    one forward, ``q = 1``, reads ``W + c * kv``; emits 1 token.
``tokenswift``
    a draft forward of the target with the partial KV view (``q = 1``, reads
    ``W + heads + min(kv_budget, c) * kv``; the γ draft heads are ``γ * (H*H + 2H)``
    parameters) plus a verification forward over ``k + 1`` tokens with the full cache
    (reads ``W + c * kv``); emits the mean accepted length per step ``A`` tokens
    (accepted drafts plus the bonus token, so ``1 <= A <= k + 1``).
``ngram`` / ``suffix``
    only the verification forward (drafts come from a CPU lookup; put its cost in
    ``overhead_s``); emits their own mean accepted length.

An optional fixed ``overhead_s`` per step models kernel launches, scheduling and
sampling. The generation from ``prefix`` to ``prefix + gen`` tokens is integrated
step by step: step ``j`` runs at context ``c_j = prefix + j * A`` and there are
``ceil(gen / A)`` steps. Real decoders are slower than this bound; the paper's AR
times (A100, HF transformers + its own kernels) are ~15x the projection, a finding
that :func:`paper_comparison` reports, not a bug of the model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable

import numpy as np

# ---------------------------------------------------------------------------
# Model and GPU descriptions
# ---------------------------------------------------------------------------

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "fp16": 2, "bf16": 2, "float8": 1, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense Llama/Qwen2-style decoder (gated MLP, RMSNorm, GQA).

    Attributes:
        name: display name.
        num_layers: decoder layers ``L``.
        hidden_size: ``H``.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA groups); equal to ``num_heads`` for MHA.
        head_dim: per-head dimension.
        intermediate_size: MLP inner width ``I`` (gate, up and down projections).
        vocab_size: ``V``.
        dtype_bytes: bytes per weight and per KV element (2 for bf16/fp16).
        tie_embeddings: input embedding and LM head share one matrix.
        qkv_bias: q/k/v projections carry biases (Qwen2).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_embeddings: bool = False
    qkv_bias: bool = False

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (attention, gated MLP, 2 RMSNorms, biases)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        bias = (q + 2 * kv) if self.qkv_bias else 0
        mlp = 3 * h * self.intermediate_size
        return attn + bias + mlp + 2 * h

    @property
    def num_params(self) -> int:
        """Total parameters (embedding counted once if tied)."""
        emb = self.vocab_size * self.hidden_size
        return (self.num_layers * self.params_per_layer + self.hidden_size
                + emb * (1 if self.tie_embeddings else 2))

    @property
    def read_params(self) -> int:
        """Parameters streamed per forward: layers + final norm + LM head (not the embedding lookup)."""
        return (self.num_layers * self.params_per_layer + self.hidden_size
                + self.vocab_size * self.hidden_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per forward pass ``W`` (B)."""
        return self.read_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per cached token over all layers (B/token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def heads_bytes(self, num_heads: int = 3) -> int:
        """Bytes of ``num_heads`` TokenSwift draft heads (``H*H`` linear + 2 norms each) (B)."""
        return num_heads * (self.hidden_size ** 2 + 2 * self.hidden_size) * self.dtype_bytes

    def flops(self, q_tokens: int, context: float) -> float:
        """FLOPs of one forward over ``q_tokens`` queries attending to ``context`` tokens."""
        attn = 4.0 * self.num_layers * self.num_heads * self.head_dim * context
        return q_tokens * (2.0 * self.read_params + attn)


#: Presets from the public Hugging Face ``config.json`` of each model (bf16).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3.1-8b": ModelSpec("Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32,
                             num_kv_heads=8, head_dim=128, intermediate_size=14336,
                             vocab_size=128256, dtype_bytes=2, tie_embeddings=False,
                             qkv_bias=False),
    "qwen2.5-1.5b": ModelSpec("Qwen2.5-1.5B", num_layers=28, hidden_size=1536, num_heads=12,
                              num_kv_heads=2, head_dim=128, intermediate_size=8960,
                              vocab_size=151936, dtype_bytes=2, tie_embeddings=True,
                              qkv_bias=True),
    "qwen2.5-7b": ModelSpec("Qwen2.5-7B", num_layers=28, hidden_size=3584, num_heads=28,
                            num_kv_heads=4, head_dim=128, intermediate_size=18944,
                            vocab_size=152064, dtype_bytes=2, tie_embeddings=False,
                            qkv_bias=True),
    "qwen2.5-14b": ModelSpec("Qwen2.5-14B", num_layers=48, hidden_size=5120, num_heads=40,
                             num_kv_heads=8, head_dim=128, intermediate_size=13824,
                             vocab_size=152064, dtype_bytes=2, tie_embeddings=False,
                             qkv_bias=True),
}
_MODEL_ALIASES = {"llama-3.1-8b": "llama3.1-8b", "llama3.1_8b": "llama3.1-8b",
                  "qwen2.5_7b": "qwen2.5-7b", "qwen2.5_14b": "qwen2.5-14b",
                  "qwen2.5_1.5b": "qwen2.5-1.5b"}


@dataclass(frozen=True)
class GpuSpec:
    """Accelerator roofline parameters.

    Attributes:
        name: display name.
        bandwidth_tbs: peak HBM bandwidth (TB/s, 1e12 B/s).
        peak_tflops: peak dense bf16/fp16 tensor throughput (TFLOP/s).
        efficiency: achievable fraction of both peaks (0 < eff <= 1). 0.8 is typical
            of tuned decode kernels (FlashAttention/FlashInfer + cuBLAS GEMV).
    """

    name: str
    bandwidth_tbs: float
    peak_tflops: float
    efficiency: float = 0.8

    @property
    def bytes_per_s(self) -> float:
        """Achievable bandwidth (B/s)."""
        return self.bandwidth_tbs * 1e12 * self.efficiency

    @property
    def flops_per_s(self) -> float:
        """Achievable compute (FLOP/s)."""
        return self.peak_tflops * 1e12 * self.efficiency


#: Datasheet numbers (SXM parts; A100 80GB rounded to 2.0 TB/s).
GPU_PRESETS: dict[str, GpuSpec] = {
    "a100": GpuSpec("A100-80GB", bandwidth_tbs=2.0, peak_tflops=312.0),
    "h100": GpuSpec("H100-SXM", bandwidth_tbs=3.35, peak_tflops=989.0),
    "h200": GpuSpec("H200", bandwidth_tbs=4.8, peak_tflops=989.0),
}

#: Paper reference wall times in minutes, A100, prefix 4096, 100K generated tokens.
#: Qwen2.5: Table 4 (T_AR, T_TokenSwift, alpha at 100K). Llama3.1-8b: Figure 1 /
#: Sec. 1 ("nearly 5 hours" -> "90 minutes"), approximate.
PAPER_100K_A100: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {"ar_min": 187.8, "tokenswift_min": 60.0, "alpha": 0.89, "source": "Table 4"},
    "qwen2.5-7b": {"ar_min": 244.2, "tokenswift_min": 75.6, "alpha": 0.82, "source": "Table 4"},
    "qwen2.5-14b": {"ar_min": 474.6, "tokenswift_min": 142.2, "alpha": 0.84, "source": "Table 4"},
    "llama3.1-8b": {"ar_min": 300.0, "tokenswift_min": 90.0, "alpha": 0.90,
                    "source": "Fig. 1 (~5 h -> 90 min, approx.)"},
}


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name (``llama3.1-8b``, ``qwen2.5-7b``, ...) or an HF ``config.json`` path.

    A directory is taken to contain ``config.json``.

    Raises:
        ValueError: unknown preset and no such file.
    """
    key = name_or_path.strip().lower()
    key = _MODEL_ALIASES.get(key, key)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        return model_from_hf_config(path)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODEL_PRESETS)} "
                     "or a path to an HF config.json / model folder")


def model_from_hf_config(path_or_dict: str | dict, dtype_bytes: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama/Qwen2/Mistral style) into a :class:`ModelSpec`.

    Args:
        path_or_dict: path of the JSON file or the parsed dict (a ``text_config``
            sub-dict is used when present).
        dtype_bytes: override; default from ``torch_dtype``/``dtype`` (bf16 if absent).
    """
    if isinstance(path_or_dict, dict):
        cfg, name = path_or_dict, path_or_dict.get("_name_or_path", "hf-config")
    else:
        with open(path_or_dict, encoding="utf-8") as f:
            cfg = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(path_or_dict))) or "hf-config"
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    if dtype_bytes is None:
        dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        dtype_bytes = _DTYPE_BYTES.get(dt, 2)
    model_type = str(cfg.get("model_type", ""))
    qkv_bias = bool(cfg.get("attention_bias", model_type.startswith("qwen2")))
    return ModelSpec(
        name=name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        dtype_bytes=int(dtype_bytes),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
    )


def resolve_gpu(name: str | None = None, bandwidth_tbs: float | None = None,
                efficiency: float = 0.8, peak_tflops: float | None = None) -> GpuSpec:
    """A GPU preset (``a100``/``h100``/``h200``) or a custom bandwidth (TB/s).

    Args:
        name: preset name; ignored for bandwidth when ``bandwidth_tbs`` is given.
        bandwidth_tbs: custom peak bandwidth (TB/s).
        efficiency: achievable fraction of peak (0, 1].
        peak_tflops: custom peak compute (TFLOP/s); default the preset's, or 989.
    """
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if bandwidth_tbs is not None:
        base = GPU_PRESETS.get((name or "").lower())
        tf = peak_tflops or (base.peak_tflops if base else 989.0)
        return GpuSpec(f"custom-{bandwidth_tbs:g}TB/s", float(bandwidth_tbs), float(tf), efficiency)
    key = (name or "a100").lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}: use one of {sorted(GPU_PRESETS)} or --bandwidth-tbs")
    g = GPU_PRESETS[key]
    return replace(g, efficiency=efficiency, peak_tflops=peak_tflops or g.peak_tflops)


# ---------------------------------------------------------------------------
# Projection
# ---------------------------------------------------------------------------

METHODS = ("ar", "tokenswift", "ngram", "suffix")


@dataclass
class SpecParams:
    """Speculation settings of the projection.

    Attributes:
        k: draft tokens verified per step (``num_speculative_tokens``); verification
            processes ``k + 1`` query tokens.
        accepted_length: TokenSwift mean tokens emitted per step, bonus included
            (``1 <= A <= k + 1``; paper: ``1 + (γ+1)·α`` style figures around 3-4).
        ngram_accepted_length: same for vLLM n-gram (prompt lookup) decoding.
        suffix_accepted_length: same for suffix decoding (default: the n-gram value).
        kv_budget: TokenSwift draft KV budget ``|B|`` (tokens); ``None`` = full cache.
        num_heads: TokenSwift draft heads ``γ`` (their weights are read by the draft).
        overhead_s: fixed per-step overhead (s): launches, scheduling, sampling.
    """

    k: int = 4
    accepted_length: float = 3.0
    ngram_accepted_length: float = 1.8
    suffix_accepted_length: float | None = None
    kv_budget: int | None = 4096
    num_heads: int = 3
    overhead_s: float = 0.0

    def tokens_per_step(self, method: str) -> float:
        """Mean tokens emitted per step by ``method``."""
        if method == "ar":
            return 1.0
        if method == "tokenswift":
            return float(self.accepted_length)
        if method == "ngram":
            return float(self.ngram_accepted_length)
        if method == "suffix":
            return float(self.suffix_accepted_length if self.suffix_accepted_length is not None
                         else self.ngram_accepted_length)
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")


@dataclass
class Projection:
    """Projected cost of generating ``gen`` tokens after a ``prefix``-token prompt.

    Attributes:
        method: ``ar``/``tokenswift``/``ngram``/``suffix``.
        model, gpu: display names.
        prefix, gen: tokens.
        tokens_per_step: mean tokens emitted per step.
        steps: number of steps ``ceil(gen / tokens_per_step)``.
        bytes_first_step, bytes_mean_step: HBM bytes moved in the first step and on
            average per step (B).
        bytes_per_token: total bytes / gen (B/token).
        wall_s: projected total time (s).
        tokens_per_s: ``gen / wall_s``.
        ms_per_token: ``1000 * wall_s / gen``.
        compute_bound_steps: steps where compute, not bandwidth, bound a forward.
    """

    method: str
    model: str
    gpu: str
    prefix: int
    gen: int
    tokens_per_step: float
    steps: int
    bytes_first_step: float
    bytes_mean_step: float
    bytes_per_token: float
    wall_s: float
    tokens_per_s: float
    ms_per_token: float
    compute_bound_steps: int = 0

    @property
    def wall_min(self) -> float:
        """Projected wall time in minutes."""
        return self.wall_s / 60.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (adds ``wall_min``)."""
        d = asdict(self)
        d["wall_min"] = self.wall_min
        return d


def _forward_time(model: ModelSpec, gpu: GpuSpec, nbytes: np.ndarray, q_tokens: int,
                  context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-forward roofline time (s) and a compute-bound mask."""
    t_mem = nbytes / gpu.bytes_per_s
    t_cmp = model.flops(q_tokens, context) / gpu.flops_per_s
    return np.maximum(t_mem, t_cmp), t_cmp > t_mem


def step_bytes(method: str, model: ModelSpec, context: float, spec: SpecParams | None = None) -> float:
    """HBM bytes moved by one step of ``method`` at ``context`` cached tokens (B).

    See the module docstring for the per-method formulas.
    """
    spec = spec or SpecParams()
    w, kv = model.weight_bytes, model.kv_bytes_per_token
    verify = w + context * kv
    if method in ("ar", "ngram", "suffix"):
        spec.tokens_per_step(method)  # validates the name
        return float(verify)
    if method == "tokenswift":
        view = context if spec.kv_budget is None else min(spec.kv_budget, context)
        return float(w + model.heads_bytes(spec.num_heads) + view * kv + verify)
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def project(method: str, model: ModelSpec, gpu: GpuSpec, prefix: int, gen: int,
            spec: SpecParams | None = None) -> Projection:
    """Integrate the step cost of ``method`` over a generation of ``gen`` tokens.

    Args:
        method: one of :data:`METHODS`.
        model: the target model.
        gpu: the accelerator (bandwidth, compute, efficiency).
        prefix: prompt tokens already in the KV cache when decoding starts.
        gen: tokens to generate.
        spec: speculation settings (accepted lengths, k, budget, overhead).

    Returns:
        a :class:`Projection` (total wall time in s, tokens/s, bytes per step).
    """
    spec = spec or SpecParams()
    if gen <= 0 or prefix < 0:
        raise ValueError("gen must be > 0 and prefix >= 0")
    a = spec.tokens_per_step(method)
    if method != "ar" and not 1.0 <= a <= spec.k + 1:
        raise ValueError(f"{method}: accepted length {a} outside [1, k+1={spec.k + 1}]")
    n = int(math.ceil(gen / a - 1e-9))
    ctx = prefix + a * np.arange(n, dtype=np.float64)
    w, kv = float(model.weight_bytes), float(model.kv_bytes_per_token)
    verify_bytes = w + ctx * kv
    if method == "ar":
        t, cb = _forward_time(model, gpu, verify_bytes, 1, ctx)
        total_bytes = verify_bytes
    else:
        t, cb = _forward_time(model, gpu, verify_bytes, spec.k + 1, ctx)
        total_bytes = verify_bytes
        if method == "tokenswift":
            view = ctx if spec.kv_budget is None else np.minimum(float(spec.kv_budget), ctx)
            draft_bytes = w + model.heads_bytes(spec.num_heads) + view * kv
            td, cbd = _forward_time(model, gpu, draft_bytes, 1, view)
            t, cb = t + td, cb | cbd
            total_bytes = total_bytes + draft_bytes
    wall = float(t.sum() + n * spec.overhead_s)
    return Projection(
        method=method, model=model.name, gpu=gpu.name, prefix=int(prefix), gen=int(gen),
        tokens_per_step=a, steps=n, bytes_first_step=float(total_bytes[0]),
        bytes_mean_step=float(total_bytes.mean()), bytes_per_token=float(total_bytes.sum() / gen),
        wall_s=wall, tokens_per_s=gen / wall, ms_per_token=1000.0 * wall / gen,
        compute_bound_steps=int(cb.sum()),
    )


def project_all(model: ModelSpec, gpu: GpuSpec, prefix: int, gen: int,
                spec: SpecParams | None = None,
                methods: Iterable[str] = METHODS) -> list[Projection]:
    """:func:`project` for each method."""
    return [project(m, model, gpu, prefix, gen, spec) for m in methods]


def paper_comparison(gpu: GpuSpec | None = None, prefix: int = 4096, gen: int = 100_000,
                     spec: SpecParams | None = None,
                     use_paper_acceptance: bool = True) -> list[dict[str, Any]]:
    """Paper wall times (A100, prefix 4096, 100K tokens) vs. this roofline.

    Args:
        gpu: defaults to the A100 preset (the paper's GPU).
        prefix, gen: the paper's setting by default.
        spec: projection settings; the TokenSwift accepted length is replaced by the
            paper's ``1 + 4·α`` (α at 100K, γ+1 = 4 drafts) when ``use_paper_acceptance``.
        use_paper_acceptance: see ``spec``.

    Returns:
        one dict per paper model with ``paper_ar_min``, ``roofline_ar_min``,
        ``ratio_ar`` (paper / roofline), the same for TokenSwift, the implied
        effective bandwidth of the paper's AR decoder (TB/s) and the per-token time
        the paper's AR spent beyond the roofline (ms/token).
    """
    gpu = gpu or GPU_PRESETS["a100"]
    spec = spec or SpecParams()
    rows = []
    for key, ref in PAPER_100K_A100.items():
        model = MODEL_PRESETS[key]
        ar = project("ar", model, gpu, prefix, gen, spec)
        s = spec
        if use_paper_acceptance:
            s = replace(spec, accepted_length=min(spec.k + 1, 1.0 + 4.0 * ref["alpha"]))
        ts = project("tokenswift", model, gpu, prefix, gen, s)
        total_ar_bytes = ar.bytes_per_token * gen
        rows.append({
            "model": model.name, "key": key, "source": ref["source"],
            "paper_ar_min": ref["ar_min"], "roofline_ar_min": ar.wall_min,
            "ratio_ar": ref["ar_min"] / ar.wall_min,
            "paper_tokenswift_min": ref["tokenswift_min"],
            "tokenswift_accepted_length": ts.tokens_per_step,
            "roofline_tokenswift_min": ts.wall_min,
            "ratio_tokenswift": ref["tokenswift_min"] / ts.wall_min,
            "paper_speedup": ref["ar_min"] / ref["tokenswift_min"],
            "roofline_speedup": ar.wall_s / ts.wall_s,
            "paper_ar_effective_tbs": total_ar_bytes / (ref["ar_min"] * 60.0) / 1e12,
            "implied_ar_overhead_ms_per_token": (ref["ar_min"] - ar.wall_min) * 60e3 / gen,
        })
    return rows
