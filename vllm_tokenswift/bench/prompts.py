"""The benchmark's prompts: token files, the bundled prompt texts, and book prefixes from
the Project Gutenberg corpus (held-out books, one stream per book, cut to the prefix
length), batched per run.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Sequence

from vllm_tokenswift.bench.methods import BenchConfig, DEFAULT_BOOKS, DEFAULT_PROMPT_GLOB


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
