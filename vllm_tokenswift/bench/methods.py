"""The benchmark's methods and settings: the models and heads it runs, the methods
(plain decoding, TokenSwift and its ablations, vLLM's n-gram and suffix decoding) as
speculative configs and engine arguments, the sampling presets, the generation lengths
that fit a model's window, and :class:`BenchConfig`, one benchmark's settings.

vLLM is not imported here.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from vllm_tokenswift.core.config import VERIFY_ATTENTION_OPT_IN_KEY


_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Default target: a model name resolved by :func:`vllm_tokenswift.cli.models.resolve_target`
#: (``smollm2``: SmolLM2-135M-Instruct + its heads; ``tiny``: the bundled demo model).
DEFAULT_MODEL = "smollm2"
#: The bundled 12.6M demo model and heads (``--model tiny``).
TINY_MODEL = os.path.join(_PKG_DIR, "assets", "demo-model")
TINY_HEADS = os.path.join(_PKG_DIR, "assets", "demo-heads")
DEFAULT_PROMPT_GLOB = os.path.join(_PKG_DIR, "assets", "prompts", "*.txt")
#: The Project Gutenberg corpus next to the checkout (``$TOKENSWIFT_BOOKS`` overrides it):
#: one JSON object per line with the book's ``text``.
DEFAULT_BOOKS = os.path.join(os.path.dirname(_PKG_DIR), "..", "shared", "data", "pg-books", "train.jsonl")
#: TokenSwift defaults of the benchmark for SmolLM2 on CPU: k = 8 and a 1,024-token
#: draft KV budget (8 KV blocks of 128 tokens on vLLM's CPU backend).
DEFAULT_K = 8
DEFAULT_KV_BUDGET = 1024

#: Sampling presets. ``paper``: the TokenSwift paper's min-p setting (Sec 4.1,
#: Appendix D) with the contextual (windowed) repetition penalty, Eq. 3.
#: ``paper-no-min-p``: the same without min_p, which stock vLLM 0.32 refuses with
#: ngram and suffix decoding (they drop it under ``paper``, so they sample another
#: distribution and skip min_p's per-step cost); under this preset every method,
#: AR included, samples the same distribution.
SAMPLING_PRESETS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "paper": {"temperature": 1.0, "min_p": 0.1, "repetition_penalty": 1.2,
              "extra_args": {"repetition_penalty_window": 1024}},
}
SAMPLING_PRESETS["paper-no-min-p"] = {k: copy.deepcopy(v) for k, v in SAMPLING_PRESETS["paper"].items()
                                     if k != "min_p"}

#: TokenSwift ablations: method name -> overrides of the ``"tokenswift"`` settings.
TOKENSWIFT_VARIANTS: dict[str, dict[str, Any]] = {
    "tokenswift": {},
    "tokenswift-k0": {"ngram_topk": 0},
    "tokenswift-noheads": {"use_heads": False},
    "tokenswift-fullkv": {"draft_kv": "full"},
    "tokenswift-static": {"draft_kv": "static"},
    "tokenswift-nopenalty": {},  # same engine; the requests carry no repetition penalty
    "tokenswift-paper": {"policy": "paper"},  # the paper's drafting: a draft forward every step
    "tokenswift-nofused": {"fused_heads": False},  # adaptive policy without the fused-heads option
    "tokenswift-b512": {"kv_budget": 512},         # the draft KV budget (the paper's Table 5)
    "tokenswift-b4096": {"kv_budget": 4096},
    # the paper's Table 3 baselines on the same kernel and verifier: TriForce* (the target
    # drafting token by token over its dynamic budgeted view every step, no heads, no
    # n-grams; chains of 2 forwards, or 1 / 4) and Medusa* (the heads on the verification
    # forward's hidden state every step, no n-grams)
    "triforce": {"policy": "triforce", "use_heads": False, "ngram_topk": 0, "chain_length": 2},
    "triforce-1": {"policy": "triforce", "use_heads": False, "ngram_topk": 0, "chain_length": 1},
    "triforce-4": {"policy": "triforce", "use_heads": False, "ngram_topk": 0, "chain_length": 4},
    "medusa": {"policy": "medusa", "ngram_topk": 0},
    # the draft forward through vLLM's model instead of the native one (the before of
    # kernels/draft_forward.c), and the native one with fp32 weights
    "tokenswift-vllmfwd": {"draft_forward": "vllm"},
    "triforce-vllmfwd": {"policy": "triforce", "use_heads": False, "ngram_topk": 0, "chain_length": 2,
                         "draft_forward": "vllm"},
    "tokenswift-fp32w": {"draft_weights": "float32"},
}

#: vLLM n-gram (prompt lookup) settings. ``ngram``: vLLM's documented example;
#: ``ngram-best``: the best of the settings tried on the 2-core CPU box (see
#: NGRAM_SWEEP_NOTES).
NGRAM_CONFIGS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4,
              "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "ngram-best": {"method": "ngram", "num_speculative_tokens": 8,
                   "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}

#: How ``ngram-best`` was chosen (tiny random Llama, 2 layers, hidden 128, vocab 512,
#: fp32, 2-core CPU shared with other jobs, greedy, b=1, prefix 1024, 512 tokens,
#: 3 repeats). Tried (k = num_speculative_tokens, lookup min..max): 4 2..4 (``ngram``),
#: 8 1..5, 8 2..4, 4 1..3, 2 1..3, 6 3..5, plus suffix (cap 8).
#: Mean accepted length per step on a model whose greedy output loops (distinct-4
#: 0.08): 4.76, 6.77, **8.13**, 4.41, 2.82, 6.56, suffix 6.58; tokens/s medians 1103,
#: 1207, **1447**, 725, 442, 1028, suffix 642 (AR 130, noisy). On a model whose
#: output does not repeat (distinct-4 0.98): 1.22 (4 2..4), 1.22 (8 2..4), 1.13
#: (8 1..5); min 1 proposes more wrong drafts, k=8 costs nothing extra when nothing
#: matches. Timings on the shared box varied up to 2x between repeats (load
#: average 5-7 on 2 cores), so the choice rests on accepted length: 8, 2..4.
NGRAM_SWEEP_NOTES = ("ngram-best = num_speculative_tokens 8, prompt_lookup 2..4: the longest "
                     "accepted length of the settings tried on the CPU box (see bench/methods.py)")

#: Suffix decoding (arctic-inference). ``num_speculative_tokens`` is its cap per step.
#: Suffix decoding needs ``arctic_inference`` (vLLM checks ``has_arctic_inference()``).
#: PyPI has only an sdist (0.3.0); its plugin entry point is inert unless
#: ``ARCTIC_INFERENCE_ENABLED`` is set, and only ``arctic_inference.suffix_decoding._C``
#: (C++/nanobind, no CUDA) is compiled. Built on the CPU box without downloading a
#: second torch::
#:
#:     python -m venv /tmp/arcbuild && /tmp/arcbuild/bin/pip install nanobind==2.9.2 \
#:         grpcio-tools setuptools wheel
#:     echo $PWD/.venv/lib/python3.11/site-packages > /tmp/arcbuild/lib/python3.11/site-packages/zz.pth
#:     pip download --no-deps --no-build-isolation arctic-inference==0.3.0 && tar xzf arctic_inference-0.3.0.tar.gz
#:     cd arctic_inference-0.3.0 && CMAKE_ARGS="-DPython_EXECUTABLE=/tmp/arcbuild/bin/python" \
#:         /tmp/arcbuild/bin/pip wheel --no-build-isolation --no-deps -w /tmp/arcwheel .
#:     .venv/bin/pip install --no-deps /tmp/arcwheel/arctic_inference-0.3.0-*.whl
#:
#: (torch and vllm versions unchanged by it.)
ARCTIC_INSTALL_NOTE = ("suffix decoding needs the arctic-inference package; PyPI ships an sdist "
                       "that compiles a small C++ extension (see vllm_tokenswift/bench/methods.py for a recipe that "
                       "keeps the venv's torch)")

#: ``suffix_decoding_max_cached_requests=0`` disables the global tree of *previous*
#: responses: with it, a repeat (or the warm-up) of the same prompt under greedy
#: decoding is speculated from the earlier identical output, which inflated the
#: smoke run's suffix speedup from ~1x to 1.7x. The per-request tree over the prompt
#: and the response generated so far (what matters for long generation) stays on.
SUFFIX_CONFIG: dict[str, Any] = {"method": "suffix", "num_speculative_tokens": 8,
                                 "suffix_decoding_max_cached_requests": 0}

#: vLLM's model-free methods, and plain decoding, with the plugin's verification-attention
#: kernel (``additional_config["tokenswift_verify_attention"]``,
#: :data:`vllm_tokenswift.core.config.VERIFY_ATTENTION_OPT_IN_KEY`): at long context on CPU
#: their decode steps then cost what TokenSwift's do, so a comparison measures the
#: drafting, not vLLM's CPU attention; ``ar-vk`` (plain decoding, its one-token decode rows on the kernel)
#: divided by ``ar`` is what the kernel alone buys. Name -> base method.
VERIFY_KERNEL_METHODS: dict[str, str] = {"suffix-vk": "suffix", "ngram-vk": "ngram",
                                         "ngram-best-vk": "ngram-best", "ar-vk": "ar"}

KNOWN_METHODS = ("ar", *TOKENSWIFT_VARIANTS, *NGRAM_CONFIGS, "suffix", *VERIFY_KERNEL_METHODS)


@dataclass
class BenchConfig:
    """Settings of one ``vllm-tokenswift bench`` invocation.

    Attributes:
        methods: method names (see :data:`KNOWN_METHODS`, or names given in
            ``method_configs``).
        gen_lens: generated tokens per sequence (``max_tokens``, ``ignore_eos``).
        batch_sizes: prompts per ``generate`` call.
        samplings: sampling preset names (:data:`SAMPLING_PRESETS`).
        repeats: timed runs per setting.
        out_dir: output folder.
        model: target model folder (resolved; see :func:`vllm_tokenswift.cli.models.resolve_target`).
        heads: TokenSwift heads folder.
        tokenizer: tokenizer folder (default: the model's).
        prompt_files: ``.txt`` files (tokenized) or ``.json`` token-id lists.
        random_prompts: use seeded random token ids instead of prompt files.
        prefix_len: prompt tokens per sequence (capped to fit the model's window).
        k: ``num_speculative_tokens`` of TokenSwift.
        tokenswift: extra ``"tokenswift"`` settings merged into every variant.
        method_configs: method name -> speculative config dict (``None`` = AR);
            overrides or adds methods. An ``"engine_args"`` key in it holds extra
            ``vllm.LLM`` keyword arguments for that method's engine only (the rest, if
            empty, is AR), e.g. ``{"engine_args": {"async_scheduling": false}}``: plain
            decoding without asynchronous scheduling, which vLLM turns off for n-gram,
            suffix and custom-class speculative decoding.
        engine_scope: ``"method"``, ``"setting"`` or ``"interleave"`` (see module doc;
            ``"interleave"`` holds one engine per method in memory at once).
        enforce_eager: pass ``enforce_eager`` to vLLM (no torch.compile; fast start).
        kv_cache_gb: KV cache size (GiB) via ``kv_cache_memory_bytes``.
        dtype: model dtype for vLLM.
        seed: engine seed.
        warmup_tokens: tokens generated by each untimed warm-up (per engine and per
            setting, with the setting's sampling parameters).
        save_tokens: also write each run's output token ids under ``out_dir/tokens``.
        engine_kwargs: extra ``vllm.LLM`` keyword arguments.
        yarn: extend the model's window this many times with YaRN rope scaling
            (``hf_overrides``, :func:`vllm_tokenswift.cli.models.yarn_overrides`); None: off.
        segment_tokens: > 0: runs of one request take a snapshot of the counters every
            this many output tokens and record per-segment figures (``segments``; see
            :mod:`vllm_tokenswift.bench.segments`); 0: off.
        books: Project Gutenberg ids (``pg-books`` corpus, :data:`DEFAULT_BOOKS` or
            ``$TOKENSWIFT_BOOKS``) whose text, after :data:`BOOK_SKIP_TOKENS` tokens of
            front matter, is the prompt source instead of ``prompt_files``.
        engines: engine instances per method, started one after another (each runs
            ``repeats`` timed runs per setting); with ``"interleave"`` each instance
            round starts every method's engine afresh and rotates the methods' order
            by one, so no method always runs right after AR. Timed runs per setting:
            ``engines × repeats``.
    """

    methods: list[str] = field(default_factory=lambda: ["ar", "tokenswift", "ngram", "suffix"])
    gen_lens: list[int] = field(default_factory=lambda: [2048, 4096])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    samplings: list[str] = field(default_factory=lambda: ["greedy", "paper"])
    repeats: int = 1
    out_dir: str = "bench-out"
    model: str = TINY_MODEL
    heads: str = TINY_HEADS
    tokenizer: str | None = None
    prompt_files: list[str] | None = None
    random_prompts: bool = False
    prefix_len: int = 2048
    k: int = DEFAULT_K
    tokenswift: dict[str, Any] = field(default_factory=dict)
    method_configs: dict[str, Any] = field(default_factory=dict)
    engine_scope: str = "method"
    enforce_eager: bool = True
    kv_cache_gb: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    warmup_tokens: int = 32
    save_tokens: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    yarn: float | None = None
    engines: int = 1
    segment_tokens: int = 0
    books: list[str] | None = None


# ---------------------------------------------------------------------------
# Method and sampling definitions
# ---------------------------------------------------------------------------

def speculative_config(method: str, cfg: BenchConfig) -> dict[str, Any] | None:
    """The ``speculative_config`` dict of ``method`` (``None`` for AR; a
    :data:`VERIFY_KERNEL_METHODS` name gives its base method's).

    Raises:
        ValueError: unknown method.
    """
    if method in cfg.method_configs:
        mc = {k: v for k, v in (cfg.method_configs[method] or {}).items() if k != "engine_args"}
        return copy.deepcopy(mc) if mc else None
    if method == "ar":
        return None
    if method in VERIFY_KERNEL_METHODS:
        return speculative_config(VERIFY_KERNEL_METHODS[method], cfg)
    if method in TOKENSWIFT_VARIANTS:
        ts = {**cfg.tokenswift, **TOKENSWIFT_VARIANTS[method]}
        return {"method": "tokenswift", "model": cfg.heads, "num_speculative_tokens": cfg.k,
                "tokenswift": ts}
    if method in NGRAM_CONFIGS:
        return copy.deepcopy(NGRAM_CONFIGS[method])
    if method == "suffix":
        return copy.deepcopy(SUFFIX_CONFIG)
    raise ValueError(f"unknown method {method!r}; known: {', '.join(KNOWN_METHODS)} "
                     "(or define it with --method-config NAME=JSON)")


def method_engine_args(method: str, cfg: BenchConfig) -> dict[str, Any]:
    """Extra ``vllm.LLM`` keyword arguments of ``method``'s engine: the ``"engine_args"``
    of its ``--method-config`` (over the invocation's ``engine_kwargs``), and for a
    :data:`VERIFY_KERNEL_METHODS` name the ``additional_config`` opt-in (merged into the
    invocation's); ``{}`` if none.

    Raises:
        ValueError: ``"engine_args"`` is not a JSON object.
    """
    mc = cfg.method_configs.get(method) or {}
    extra = mc.get("engine_args", {}) if isinstance(mc, dict) else {}
    if not isinstance(extra, dict):
        raise ValueError(f"method {method!r}: \"engine_args\" must be a JSON object of vllm.LLM "
                         f"keyword arguments, got {extra!r}")
    extra = dict(extra)
    if method in VERIFY_KERNEL_METHODS and method not in cfg.method_configs:
        extra["additional_config"] = {**(cfg.engine_kwargs.get("additional_config") or {}),
                                      VERIFY_ATTENTION_OPT_IN_KEY: True}
    return extra


def sampling_kwargs(method: str, sampling: str, spec: dict[str, Any] | None
                    ) -> tuple[dict[str, Any], str | None]:
    """SamplingParams keyword arguments for ``method`` under preset ``sampling``.

    Stock vLLM 0.32 rejects ``min_p`` on any speculative engine
    (``SamplingParams._validate_spec_decode`` raises ``VLLMValidationError``). The
    TokenSwift plugin lifts that for ``tokenswift`` engines; for other speculative
    methods ``min_p`` is dropped and the returned note says so.
    ``tokenswift-nopenalty`` drops the repetition penalty (ablation of Sec 3.4).

    Returns:
        ``(kwargs, note)`` with ``note`` ``None`` when nothing was changed.
    """
    if sampling not in SAMPLING_PRESETS:
        raise ValueError(f"unknown sampling {sampling!r}; one of {sorted(SAMPLING_PRESETS)}")
    kw = copy.deepcopy(SAMPLING_PRESETS[sampling])
    notes = []
    if method == "tokenswift-nopenalty" and "repetition_penalty" in kw:
        kw.pop("repetition_penalty")
        (kw.get("extra_args") or {}).pop("repetition_penalty_window", None)
        if not kw.get("extra_args"):
            kw.pop("extra_args", None)
        notes.append("repetition penalty off (ablation)")
    is_ts = bool(spec) and spec.get("method") == "tokenswift"
    if spec and not is_ts and kw.get("min_p", 0.0) > 0:
        notes.append(f"min_p={kw.pop('min_p')} dropped: vLLM 0.32 refuses min_p with "
                     f"speculative decoding ({spec.get('method')}); AR keeps it")
    return kw, ("; ".join(notes) or None)


def method_unavailable(method: str, spec: dict[str, Any] | None) -> str | None:
    """A reason why ``method`` cannot run in this environment, or ``None``."""
    if spec and spec.get("method") == "suffix":
        if importlib.util.find_spec("arctic_inference") is None:
            return ARCTIC_INSTALL_NOTE
    if spec and spec.get("method") == "tokenswift":
        heads = spec.get("model")
        use_heads = (spec.get("tokenswift") or {}).get("use_heads", True)
        if use_heads and not heads:
            return "no TokenSwift heads for this model: pass --heads FOLDER"
        if use_heads and not os.path.exists(heads):
            return f"TokenSwift heads folder not found: {heads}"
    return None


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------

def model_max_len(model_dir: str, yarn: float | None = None) -> int | None:
    """The model's window: ``max_position_embeddings`` from its config.json (× ``yarn``
    when the window is extended with YaRN), or None if unreadable."""
    from vllm_tokenswift.cli.models import model_window

    return model_window(model_dir, yarn)


#: Default generation lengths: the issue's CPU ladder, and the paper's 20K-100K on GPUs.
CPU_GEN_LENS = [2048, 4096, 8192, 16384]
GPU_GEN_LENS = [20480, 40960, 61440, 81920, 102400]


def default_gen_lens(cuda: bool | None = None, window: int | None = None,
                     prefix_len: int = 0) -> list[int]:
    """Generation lengths used when ``--gen-lens`` is not given.

    Args:
        cuda: whether a CUDA device is used (default: ``torch.cuda.is_available()``).
        window: the model's window in tokens (``max_position_embeddings`` × YaRN
            factor); None: no limit.
        prefix_len: prompt tokens per sequence.
    Returns:
        the ladder, :data:`GPU_GEN_LENS` (paper Sec 4.1, 20K-100K tokens) on CUDA, else
        :data:`CPU_GEN_LENS`, cut to what fits ``window - prefix_len``; when the window
        cuts the ladder, ``window - prefix_len`` itself is added as the longest length
        (the prefix is then trimmed by the harness' 64-token margin, see
        :func:`effective_prefix_len`). SmolLM2 (8,192) with a 2,048-token prefix:
        ``[2048, 4096, 6144]``; with ``--yarn 2``: ``[2048, 4096, 8192, 14336]``.

    Raises:
        ValueError: the prefix leaves no room in the window.
    """
    if cuda is None:
        import torch

        cuda = bool(torch.cuda.is_available())
    ladder = list(GPU_GEN_LENS if cuda else CPU_GEN_LENS)
    if window is None:
        return ladder
    room = int(window) - int(prefix_len)
    if room < 16:
        raise ValueError(f"a {prefix_len}-token prefix leaves no room to generate in the model's "
                         f"{window}-token window; use a shorter --prefix-len or --yarn")
    lens = [g for g in ladder if g <= room]
    if len(lens) < len(ladder) and room not in lens:
        lens.append(room)
    return lens


def effective_prefix_len(prefix_len: int, gen_lens: Sequence[int], max_len: int | None,
                         margin: int = 64) -> int:
    """Prefix length capped so that ``prefix + max(gen_lens) + margin`` fits ``max_len``.

    Raises:
        ValueError: when not even a 16-token prefix fits.
    """
    if max_len is None:
        return prefix_len
    cap = max_len - max(gen_lens) - margin
    if cap < 16:
        raise ValueError(f"gen_len {max(gen_lens)} + {margin} leaves no room for a prompt "
                         f"in the model's {max_len}-token window")
    return min(prefix_len, cap)
