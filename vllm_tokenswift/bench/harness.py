"""Offline vLLM benchmark of AR, TokenSwift (and ablations), n-gram and suffix decoding.

One ``vllm.LLM`` engine is built per method (``engine_scope="method"``, default:
the engine serves every gen_len / batch size / sampling of that method, with
``max_model_len`` sized for the longest run) or per (method, setting)
(``engine_scope="setting"``), warmed up with a short generate, timed over
``repeats`` runs, then torn down before the next one. With
``engine_scope="interleave"`` every method's engine is started first and kept,
and the timed runs go round by round (each setting and repeat: every method once,
in turn), so that drift of a shared machine hits all methods of a round alike;
speedups are then paired with the AR run of the same round.

``engines`` > 1 repeats all of that with fresh engine instances: two instances of
the same engine differ in the speed of their forward by 1-8% (memory placement,
measured in ``matrix/b8-paper-engines``), which repeats on one instance do not
average out. Each record carries its ``engine`` (instance index) and a ``repeat``
numbered across instances, so that an interleaved run is still paired with the AR
run of its own round.

Per timed run the harness records wall time, generated tokens, vLLM's
speculative-decoding Prometheus counters (deltas of ``llm.get_metrics()`` taken
before and after the run: the counters are cumulative), the TokenSwift plugin's
own counters when available (:func:`vllm_tokenswift.metrics.get_engine_stats`),
Distinct-n of the outputs and, for greedy runs, whether the token ids equal the
AR run's. :mod:`vllm_tokenswift.bench.report` turns the records into files.

vLLM is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TextIO

from vllm_tokenswift.bench import report
# re-exported: the benchmarks' names for them since before they moved
from vllm_tokenswift.engine_helpers import (engine_output_to, plugin_stats_after,  # noqa: F401
                                             plugin_stats_before, teardown_engine)

logger = logging.getLogger("vllm_tokenswift.bench")

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Default target: a model name resolved by :func:`vllm_tokenswift.models.resolve_target`
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
                     "accepted length of the settings tried on the CPU box (see harness.py)")

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
                       "that compiles a small C++ extension (see harness.py for a recipe that "
                       "keeps the venv's torch)")

#: ``suffix_decoding_max_cached_requests=0`` disables the global tree of *previous*
#: responses: with it, a repeat (or the warm-up) of the same prompt under greedy
#: decoding is speculated from the earlier identical output, which inflated the
#: smoke run's suffix speedup from ~1x to 1.7x. The per-request tree over the prompt
#: and the response generated so far (what matters for long generation) stays on.
SUFFIX_CONFIG: dict[str, Any] = {"method": "suffix", "num_speculative_tokens": 8,
                                 "suffix_decoding_max_cached_requests": 0}

KNOWN_METHODS = ("ar", *TOKENSWIFT_VARIANTS, *NGRAM_CONFIGS, "suffix")


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
        model: target model folder (resolved; see :func:`vllm_tokenswift.models.resolve_target`).
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
            (``hf_overrides``, :func:`vllm_tokenswift.models.yarn_overrides`); None: off.
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
    """The ``speculative_config`` dict of ``method`` (``None`` for AR).

    Raises:
        ValueError: unknown method.
    """
    if method in cfg.method_configs:
        mc = {k: v for k, v in (cfg.method_configs[method] or {}).items() if k != "engine_args"}
        return copy.deepcopy(mc) if mc else None
    if method == "ar":
        return None
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
    of its ``--method-config`` (over the invocation's ``engine_kwargs``); ``{}`` if none.

    Raises:
        ValueError: ``"engine_args"`` is not a JSON object.
    """
    mc = cfg.method_configs.get(method) or {}
    extra = mc.get("engine_args", {}) if isinstance(mc, dict) else {}
    if not isinstance(extra, dict):
        raise ValueError(f"method {method!r}: \"engine_args\" must be a JSON object of vllm.LLM "
                         f"keyword arguments, got {extra!r}")
    return dict(extra)


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
    from vllm_tokenswift.models import model_window

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


def _read_token_file(path: str) -> list[int]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("prompt_token_ids") or data.get("token_ids") or data.get("ids")
    if data and isinstance(data[0], list):
        data = [t for seq in data for t in seq]
    return [int(t) for t in data]


def load_prompt_tokens(cfg: BenchConfig, tokenizer_loader: Callable[[str], Any] | None = None
                       ) -> list[list[int]]:
    """Token ids of every prompt source (one list per file, or one random stream).

    ``.json`` files hold token ids; other files are text tokenized with the
    model's tokenizer (``transformers.AutoTokenizer``), BOS prepended if defined.
    """
    if cfg.random_prompts:
        import numpy as np
        vocab = 256
        try:
            with open(os.path.join(cfg.model, "config.json"), encoding="utf-8") as f:
                vocab = int(json.load(f).get("vocab_size", vocab))
        except (OSError, ValueError):
            pass
        rng = np.random.RandomState(cfg.seed)
        n = cfg.prefix_len * (max(cfg.batch_sizes) + 1)
        return [rng.randint(3, max(4, vocab), size=n).tolist()]
    if cfg.books:
        if tokenizer_loader is None:
            from transformers import AutoTokenizer
            tokenizer_loader = AutoTokenizer.from_pretrained
        return book_streams(tokenizer_loader(cfg.tokenizer or cfg.model), cfg.books)
    files = list(cfg.prompt_files or sorted(glob.glob(DEFAULT_PROMPT_GLOB)))
    if not files:
        raise FileNotFoundError(
            f"no prompt files: none given and none at {DEFAULT_PROMPT_GLOB}; "
            "pass --prompt-files or --random-prompts")
    tok = None
    streams = []
    for path in files:
        if path.endswith(".json"):
            streams.append(_read_token_file(path))
            continue
        if tok is None:
            if tokenizer_loader is None:
                from transformers import AutoTokenizer
                tokenizer_loader = AutoTokenizer.from_pretrained
            tok = tokenizer_loader(cfg.tokenizer or cfg.model)
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read(), add_special_tokens=False)
        bos = getattr(tok, "bos_token_id", None)
        streams.append(([bos] if bos is not None else []) + list(ids))
    if any(len(s) == 0 for s in streams):
        raise ValueError("a prompt file produced no tokens")
    return streams


def book_prompts(tokenizer: Callable[..., Any], num_prompts: int, prefix_len: int, skip: int = 0,
                 path: str | os.PathLike | None = None) -> list[list[int]]:
    """Prompts of ``prefix_len`` tokens from the first ``num_prompts`` books of the
    Project Gutenberg corpus that are long enough, one per book: tokens
    ``skip .. skip + prefix_len`` of the book's text (``skip`` passes its front matter).

    Args:
        tokenizer: a ``transformers`` tokenizer (called as ``tokenizer(text,
            add_special_tokens=False)["input_ids"]``).
        path: the corpus (JSON lines with ``text``); default ``$TOKENSWIFT_BOOKS`` or
            :data:`DEFAULT_BOOKS`.
    Raises:
        FileNotFoundError: no corpus at ``path``.
        ValueError: fewer than ``num_prompts`` books have ``skip + prefix_len`` tokens.
    """
    path = os.fspath(path or os.environ.get("TOKENSWIFT_BOOKS") or DEFAULT_BOOKS)
    need = skip + prefix_len
    out: list[list[int]] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            text = json.loads(line)["text"]
            # tokenise a prefix of the text (whole books take seconds); all of it if short
            ids = tokenizer(text[: 16 * need], add_special_tokens=False)["input_ids"]
            if len(ids) < need and len(text) > 16 * need:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= need:
                out.append(list(ids[skip:need]))
                if len(out) == num_prompts:
                    return out
    raise ValueError(f"only {len(out)} books of {path} have {need} tokens; {num_prompts} needed")


#: tokens of a book's front matter (title page, contents, preface) left out of its prompts
BOOK_SKIP_TOKENS = 2000


def book_streams(tokenizer: Callable[..., Any], book_ids: Sequence[str], skip: int = BOOK_SKIP_TOKENS,
                 path: str | os.PathLike | None = None) -> list[list[int]]:
    """Token ids of whole books of the Project Gutenberg corpus, by ebook id, each
    without its first ``skip`` tokens (prompt sources for long prefixes: the demo model
    never saw 28054, *The Brothers Karamazov*, 480K tokens, nor 19942, *Candide*).

    Raises:
        FileNotFoundError: no corpus at ``path`` (default ``$TOKENSWIFT_BOOKS`` or
            :data:`DEFAULT_BOOKS`).
        ValueError: an id not in the corpus.
    """
    path = os.fspath(path or os.environ.get("TOKENSWIFT_BOOKS") or DEFAULT_BOOKS)
    want = [str(b) for b in book_ids]
    texts: dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            d = json.loads(line)
            if str(d.get("id")) in want:
                texts[str(d["id"])] = d["text"]
    missing = [b for b in want if b not in texts]
    if missing:
        raise ValueError(f"books {missing} are not in {path}")
    return [list(tokenizer(texts[b], add_special_tokens=False)["input_ids"][skip:]) for b in want]


def build_prompts(streams: Sequence[Sequence[int]], batch_size: int, prefix_len: int
                  ) -> list[list[int]]:
    """``batch_size`` prompts of ``prefix_len`` tokens, cycling through the streams.

    Prompt ``i`` uses stream ``i % len(streams)`` starting at offset
    ``(i // len(streams)) * prefix_len // 2`` (different prefixes from the same
    file), wrapping around a stream that is too short.
    """
    out = []
    for i in range(batch_size):
        s = list(streams[i % len(streams)])
        off = ((i // len(streams)) * max(1, prefix_len // 2)) % len(s)
        ids = []
        while len(ids) < prefix_len:
            take = s[off:off + prefix_len - len(ids)]
            ids.extend(take)
            off = 0
        out.append(ids[:prefix_len])
    return out


# ---------------------------------------------------------------------------
# Engine handling
# ---------------------------------------------------------------------------

def build_engine(cfg: BenchConfig, spec: dict[str, Any] | None, max_model_len: int,
                 engine_args: dict[str, Any] | None = None):
    """Create a ``vllm.LLM`` for the benchmark (CPU-friendly defaults), with
    ``cfg.engine_kwargs`` and then ``engine_args`` (one method's, see
    :func:`method_engine_args`) applied last."""
    from vllm import LLM
    kw: dict[str, Any] = dict(
        model=cfg.model, tokenizer=cfg.tokenizer or cfg.model, dtype=cfg.dtype,
        max_model_len=max_model_len, enable_prefix_caching=False, seed=cfg.seed,
        disable_log_stats=False, enforce_eager=cfg.enforce_eager,
        max_num_seqs=max(max(cfg.batch_sizes), 1),
    )
    if cfg.kv_cache_gb:
        kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
    if spec:
        kw["speculative_config"] = spec
    if cfg.yarn:
        from vllm_tokenswift.models import yarn_overrides

        kw["hf_overrides"] = yarn_overrides(cfg.model, cfg.yarn)
    kw.update(cfg.engine_kwargs)
    kw.update(engine_args or {})
    return LLM(**kw)


def empty_proposer(worker: Any) -> bool:
    """Diagnostics, run in a worker through ``llm.collective_rpc(empty_proposer)``: make
    its TokenSwift proposer return no drafts at once, leaving vLLM's speculative path
    (spec-decode scheduling, the plugin's hooks) in place without the proposer's work.
    The examples' ``ts-empty`` mode compares such an engine with plain decoding.

    Returns True (collective_rpc's per-worker result). Raises AttributeError when the
    worker's model runner has no drafter (not a speculative engine)."""
    drafter = worker.model_runner.drafter
    drafter.propose_with_runner = lambda runner, scheduler_output, sampled, *a, **k: [[] for _ in sampled]
    return True


def _spec_counters(llm: Any, collectors: list | None = None) -> dict[str, Any]:
    try:
        if collectors is not None:
            return report.spec_counters_from_collectors(collectors)
        return report.spec_counters_from_metrics(llm.get_metrics())
    except Exception:
        logger.debug("get_metrics failed", exc_info=True)
        return report.spec_counters_from_metrics([])


def snapshot(llm: Any, tokens: int, steps: int, is_ts: bool, collectors: list | None = None) -> dict:
    """The counters of a running engine after ``tokens`` output tokens and ``steps`` steps."""
    from vllm_tokenswift.metrics import get_engine_stats

    snap = {"t": time.perf_counter(), "tokens": int(tokens), "steps": int(steps),
            "spec": _spec_counters(llm, collectors), "plugin": None}
    if is_ts:
        try:
            snap["plugin"] = get_engine_stats(llm)
        except Exception:  # noqa: BLE001 - figures, not the run
            snap["plugin"] = None
    return snap


def spec_metric_collectors() -> list:
    """The Prometheus collectors of vLLM's speculative-decoding counters now in this
    process's registry: those of the engine built last (vLLM unregisters an earlier
    engine's metrics when it builds the next one; the earlier engine keeps updating its
    own collectors). Empty when none are registered or the registry has no index."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return []
    names = getattr(REGISTRY, "_collector_to_names", None) or {}
    return [c for c, ns in list(names.items()) if any(str(n).startswith("vllm:spec_decode") for n in ns)]


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------

def timed_run(llm: Any, prompts: list[list[int]], sp_kwargs: dict[str, Any], gen_len: int,
              k: int | None, plugin_stats: bool = False, collectors: list | None = None
              ) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed ``generate`` of ``prompts``; returns ``(record fields, output ids)``.

    ``plugin_stats``: also collect the TokenSwift plugin's counters (TokenSwift engines).
    ``collectors``: read vLLM's speculative-decoding counters from these Prometheus
    collectors (:func:`spec_metric_collectors` right after this engine was built) instead
    of ``llm.get_metrics()``, which reads the registry of the engine built last.
    """
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=gen_len, ignore_eos=True, **sp_kwargs)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    before = _spec_counters(llm, collectors)
    was_reset, pbefore = plugin_stats_before(llm) if plugin_stats else (False, None)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _spec_counters(llm, collectors)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    ntok = sum(len(x) for x in ids)
    rec: dict[str, Any] = {"num_tokens": ntok, "wall_s": wall}
    rec.update(report.throughput(ntok, wall, len(prompts)))
    ttft = [getattr(getattr(o, "metrics", None), "first_token_latency", None) for o in outs]
    ttft = [t for t in ttft if isinstance(t, (int, float)) and t > 0]
    if ttft and wall > max(ttft) and ntok > len(prompts):
        rec["ttft_s"] = max(ttft)
        rec["decode_tokens_per_s"] = (ntok - len(prompts)) / (wall - max(ttft))
    delta = report.counter_delta(before, after)
    acc = report.acceptance_from_counters(delta, k)
    rec.update({kk: acc[kk] for kk in ("acceptance_rate", "mean_accepted_length", "num_drafts",
                                        "num_draft_tokens", "num_accepted_tokens",
                                        "draft_token_acceptance", "acceptance_per_pos")})
    if plugin_stats:
        rec.update(plugin_stats_after(llm, was_reset, pbefore, k or 0))
    else:
        rec.update({"ngram_acceptance": None, "draft_time_share": None,
                    "time_draft_s": None, "time_verify_s": None, "steps_by_kind": None,
                    "accepted_by_kind": None})
    rec.update(report.distinct_scores(ids))
    return rec, ids


def timed_run_segments(llm: Any, prompt: list[int], sp_kwargs: dict[str, Any], gen_len: int,
                       k: int | None, segment_tokens: int, plugin_stats: bool = False,
                       collectors: list | None = None) -> tuple[dict[str, Any], list[list[int]]]:
    """:func:`timed_run` for one request, stepping the engine itself: a snapshot of the
    counters at the first token and every ``segment_tokens`` output tokens after it (and
    at the end), turned into ``segments`` rows (:mod:`vllm_tokenswift.bench.segments`).
    The snapshots read counters between steps: their cost (an RPC to the worker, less
    than a step) falls outside the segments' wall times only in part."""
    from vllm import SamplingParams

    from vllm_tokenswift.bench import segments as seg

    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=gen_len, ignore_eos=True, **sp_kwargs)
    before = _spec_counters(llm, collectors)
    was_reset, pbefore = plugin_stats_before(llm) if plugin_stats else (False, None)
    rid = f"seg-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    snaps: list[dict] = []
    steps, n, final, t_first = 0, 0, None, None
    next_mark = 1
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        for out in outs:
            if out.request_id != rid:
                continue
            n = len(out.outputs[0].token_ids)
            if out.finished:
                final = out
        if n >= next_mark or (final is not None and (not snaps or snaps[-1]["tokens"] < n)):
            if t_first is None and n:
                t_first = time.perf_counter()
            snaps.append(snapshot(llm, n, steps, plugin_stats, collectors))
            next_mark = (n // segment_tokens + 1) * segment_tokens if n else 1
    wall = time.perf_counter() - t0
    ids = list(final.outputs[0].token_ids)
    rec: dict[str, Any] = {"num_tokens": len(ids), "wall_s": wall}
    rec.update(report.throughput(len(ids), wall, 1))
    if t_first is not None and len(ids) > 1:
        rec["ttft_s"] = t_first - t0
        rec["decode_tokens_per_s"] = (len(ids) - 1) / (t0 + wall - t_first)
    acc = report.acceptance_from_counters(report.counter_delta(before, _spec_counters(llm, collectors)), k)
    rec.update({kk: acc[kk] for kk in ("acceptance_rate", "mean_accepted_length", "num_drafts",
                                        "num_draft_tokens", "num_accepted_tokens",
                                        "draft_token_acceptance", "acceptance_per_pos")})
    if plugin_stats:
        rec.update(plugin_stats_after(llm, was_reset, pbefore, k or 0))
    rec.update(report.distinct_scores([ids]))
    rec["segments"] = seg.segments_from_snapshots(snaps, ids, k)
    return rec, [ids]


def warmup(llm: Any, prompt: list[int], tokens: int = 32,
           sp_kwargs: dict[str, Any] | None = None) -> None:
    """Untimed generate of ``tokens`` tokens (first-call allocations, caches);
    greedy unless ``sp_kwargs`` are given."""
    if tokens <= 0:
        return
    from vllm import SamplingParams
    kw = dict(sp_kwargs) if sp_kwargs else {"temperature": 0.0}
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(max_tokens=tokens, ignore_eos=True, **kw), use_tqdm=False)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fill_identical_to_ar(records: list[dict], outputs: dict[tuple, list[list[int]]]) -> None:
    """Set ``identical_to_ar`` (greedy only) and ``ar_common_prefix_tokens`` in place.

    ``outputs`` maps ``(method, gen_len, batch_size, sampling, repeat)`` to output ids;
    the reference is the first AR repeat of the same gen_len / batch size (so for
    ``ar`` itself the field says whether its repeats are deterministic).
    """
    for r in records:
        r.setdefault("identical_to_ar", None)
        if r.get("sampling") != "greedy" or r.get("status") != "ok":
            continue
        key = (r["method"], r["gen_len"], r["batch_size"], r["sampling"], r["repeat"])
        ref = next((outputs[kk] for kk in sorted(outputs, key=lambda t: t[4])
                    if kk[0] == "ar" and kk[1:4] == key[1:4]), None)
        mine = outputs.get(key)
        if ref is None or mine is None:
            continue
        r["identical_to_ar"] = all(a == b for a, b in zip(mine, ref)) and len(mine) == len(ref)
        r["ar_common_prefix_tokens"] = min(_common_prefix(a, b) for a, b in zip(mine, ref))


def _settings(cfg: BenchConfig) -> list[tuple[int, int, str]]:
    return [(g, b, s) for g in cfg.gen_lens for b in cfg.batch_sizes for s in cfg.samplings]


def _base_record(method: str, g: int, b: int, s: str, rep: int, prefix: int, cfg: BenchConfig,
                 spec: dict | None, engine: int = 0) -> dict[str, Any]:
    rec = {"method": method, "gen_len": g, "batch_size": b, "sampling": s, "repeat": rep, "engine": engine,
           "status": "ok", "prefix_len": prefix, "model": cfg.model, "yarn": cfg.yarn,
           "num_speculative_tokens": (spec or {}).get("num_speculative_tokens"),
           "speculative_config": spec, "note": None}
    for f in report.RECORD_FIELDS:
        rec.setdefault(f, None)
    rec["status"] = "ok"
    return rec


def run_bench(cfg: BenchConfig, progress: bool = True,
              on_records: Callable[[list[dict]], None] | None = None,
              bar_file: TextIO | None = None) -> list[dict]:
    """Run every method and setting of ``cfg``; return the records.

    ``engine_scope`` ``"method"``/``"setting"``: one engine at a time, each running all
    repeats of its settings in a row. ``"interleave"``: every method's engine is started
    first and kept (an idle vLLM engine uses no CPU, only memory), then the runs go
    round by round: for each setting and repeat, every method once in turn. Slow drift
    of a shared machine then hits all methods of a round alike, and each run's speedup
    is taken against the AR run of its own round (``paired_speedup``).

    ``cfg.engines`` > 1 does all of this once per engine instance (fresh engines each
    time; with ``"interleave"`` the methods' order rotates by one per instance), with
    the repeats numbered across instances (instance ``e``'s runs are ``e × repeats`` to
    ``(e + 1) × repeats - 1``) and each record's ``engine`` giving its instance.

    Args:
        cfg: the benchmark settings.
        progress: show tqdm bars (runs and engines).
        on_records: called with all records so far after each engine (``"interleave"``:
            after each round), for incremental saving.
        bar_file: stream of the progress bar (default stderr; see :func:`engine_output_to`).
    """
    from tqdm import tqdm

    max_len = model_max_len(cfg.model, cfg.yarn)
    prefix = effective_prefix_len(cfg.prefix_len, cfg.gen_lens, max_len)
    streams = load_prompt_tokens(cfg)
    prompts_by_b = {b: build_prompts(streams, b, prefix) for b in cfg.batch_sizes}
    settings = _settings(cfg)
    records: list[dict] = []
    outputs: dict[tuple, list[list[int]]] = {}
    n_inst = max(1, int(cfg.engines))
    total_runs = len(cfg.methods) * len(settings) * cfg.repeats * n_inst
    bar = tqdm(total=total_runs, desc="bench runs", disable=not progress, file=bar_file or sys.stderr,
               dynamic_ncols=True)
    tok_dir = os.path.join(cfg.out_dir, "tokens")
    interleave = cfg.engine_scope == "interleave"
    unavailable: set[str] = set()   # recorded once, not per engine instance

    def finish() -> None:
        fill_identical_to_ar(records, outputs)
        report.compute_speedups(records)
        if on_records is not None:
            on_records(records)

    def start(method: str, group: list[tuple[int, int, str]], inst: int) -> dict | None:
        """Start and warm up instance ``inst`` of ``method``'s engine for ``group``; None
        (records written) when the method is unavailable or its engine fails to start."""
        try:
            spec = speculative_config(method, cfg)
            engine_args = method_engine_args(method, cfg)
        except ValueError as e:
            spec, why = None, str(e)
        else:
            why = method_unavailable(method, spec)
        if why:
            if method not in unavailable:
                unavailable.add(method)
                for g, b, s in group:
                    rec = _base_record(method, g, b, s, 0, prefix, cfg, spec)
                    rec.update(status="unavailable", note=f"unavailable: {why}")
                    records.append(rec)
                logger.warning("%s unavailable: %s", method, why)
            bar.update(len(group) * cfg.repeats)
            return None
        is_ts = bool(spec) and spec.get("method") == "tokenswift"
        mml = prefix + max(g for g, _, _ in group) + 64
        budget = ((spec or {}).get("tokenswift") or {}).get("kv_budget") if is_ts else None
        if budget and budget > mml and (max_len is None or budget <= max_len):
            mml = int(budget)  # the plugin refuses kv_budget > max_model_len; no memory cost
        llm = None
        try:
            bar.set_postfix_str(f"{method}: starting engine" + (f" {inst + 1}/{n_inst}" if n_inst > 1 else ""))
            llm = build_engine(cfg, spec, mml, engine_args)
            warmup(llm, prompts_by_b[group[0][1]][0], cfg.warmup_tokens)
            for g, b, s in group:   # untimed: first use of each batch shape / sampling path
                try:
                    warmup(llm, prompts_by_b[b][0], cfg.warmup_tokens, sampling_kwargs(method, s, spec)[0])
                except Exception:
                    logger.debug("warm-up failed", exc_info=True)
        except Exception as e:  # engine cannot start: record and go on
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            logger.exception("%s: engine failed", method)
            for g, b, s in group:
                rec = _base_record(method, g, b, s, inst * cfg.repeats, prefix, cfg, spec, engine=inst)
                rec.update(status="error", note=f"engine start failed: {msg}"[:500])
                records.append(rec)
            bar.update(len(group) * cfg.repeats)
            teardown_engine(llm)
            return None
        return {"llm": llm, "spec": spec, "k": (spec or {}).get("num_speculative_tokens"), "is_ts": is_ts,
                # interleave: read this engine's counters from its own collectors
                "collectors": spec_metric_collectors() if interleave else None}

    def run_one(method: str, eng: dict, g: int, b: int, s: str, inst: int, r: int) -> None:
        """Time repeat ``r`` of engine instance ``inst`` of ``method`` at one setting (its
        record's ``repeat`` is numbered across instances)."""
        rep = inst * cfg.repeats + r
        bar.set_postfix_str(f"{method} gen={g} b={b} {s} r{rep}" + (f" e{inst}" if n_inst > 1 else ""))
        sp_kw, note = sampling_kwargs(method, s, eng["spec"])
        rec = _base_record(method, g, b, s, rep, prefix, cfg, eng["spec"], engine=inst)
        rec["note"] = note
        rec["paired_speedup"] = interleave
        try:
            if cfg.segment_tokens and b == 1:
                fields, ids = timed_run_segments(eng["llm"], prompts_by_b[b][0], sp_kw, g, eng["k"],
                                                 cfg.segment_tokens, plugin_stats=eng["is_ts"],
                                                 collectors=eng["collectors"])
            else:
                fields, ids = timed_run(eng["llm"], prompts_by_b[b], sp_kw, g, eng["k"],
                                        plugin_stats=eng["is_ts"], collectors=eng["collectors"])
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            rec.update(status="error", note=f"{type(e).__name__}: {msg}"[:500])
            logger.exception("%s gen=%d b=%d %s failed", method, g, b, s)
        else:
            rec.update(fields)
            outputs[(method, g, b, s, rep)] = ids
            if cfg.save_tokens:
                os.makedirs(tok_dir, exist_ok=True)
                with open(os.path.join(tok_dir, f"{method}_g{g}_b{b}_{s}_r{rep}.json"),
                          "w", encoding="utf-8") as f:
                    json.dump(ids, f)
        records.append(rec)
        bar.update(1)

    if interleave:
        for inst in range(n_inst):
            shift = inst % len(cfg.methods)
            order = list(cfg.methods[shift:]) + list(cfg.methods[:shift])
            engines: dict[str, dict] = {}
            try:
                for method in order:
                    eng = start(method, settings, inst)
                    if eng is not None:
                        engines[method] = eng
                for g, b, s in settings:
                    for rep in range(cfg.repeats):
                        for method in order:
                            if method in engines:
                                run_one(method, engines[method], g, b, s, inst, rep)
                        finish()
            finally:
                for method, eng in engines.items():
                    bar.set_postfix_str(f"{method}: teardown")
                    teardown_engine(eng["llm"])
    else:
        for method in cfg.methods:
            groups = ([settings] if cfg.engine_scope == "method" else [[st] for st in settings])
            for group in groups:
                for inst in range(n_inst):
                    eng = start(method, group, inst)
                    if eng is None:
                        continue
                    for g, b, s in group:
                        for rep in range(cfg.repeats):
                            run_one(method, eng, g, b, s, inst, rep)
                    bar.set_postfix_str(f"{method}: teardown")
                    teardown_engine(eng["llm"])
            finish()
    bar.close()
    fill_identical_to_ar(records, outputs)
    report.compute_speedups(records)
    return records
