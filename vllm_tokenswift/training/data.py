"""Training / evaluation text for the draft heads (paper Sec 4.1).

The paper trains the heads on "the first 8K tokens of [PG-19] training books
longer than 8K tokens". This module turns a text corpus into a fixed-shape
``[num_sequences, seq_len]`` ``torch.long`` tensor of token ids:

* every document is tokenized with the base model's tokenizer (its default
  special tokens, i.e. a BOS for Llama-style tokenizers) and cut to its first
  ``seq_len`` tokens; a document with at least ``seq_len`` tokens becomes one
  sequence on its own (the paper's recipe);
* documents *shorter* than ``seq_len`` are, by default (``pack=True``),
  **packed**: concatenated in corpus order, each followed by the tokenizer's
  EOS token (when it has one), and the stream is cut into ``seq_len``-token
  sequences; an incomplete last packed sequence is dropped. The packed
  documents attend to each other (plain causal attention, no per-document
  mask), exactly as in standard LM packing. With ``pack=False`` short
  documents are **skipped** (the paper's behaviour; PG-19 books are all far
  longer than 8K tokens, so both choices give the same data there).

Accepted inputs (:func:`iter_documents`): a JSON Lines file whose lines are
objects with a ``"text"`` string (other fields ignored, blank lines skipped), a
single ``.txt`` file (one document), or a folder of ``*.txt`` files (one
document per file, sorted by name, searched recursively).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class TrainHeadsError(ValueError):
    """Bad input for draft-head training or evaluation (data, model, settings).

    Raised before any training step runs; the message says what to fix.
    """


def check_data_path(data: str | os.PathLike) -> Path:
    """Check that ``data`` names a readable corpus and return it as a :class:`Path`.

    Raises:
        TrainHeadsError: the path does not exist, or is a folder without
            ``*.txt`` files, or a file that is neither ``.jsonl``/``.json``
            (JSON Lines) nor ``.txt``.
    """
    p = Path(data).expanduser()
    if not p.exists():
        raise TrainHeadsError(f"data path {str(p)!r} does not exist")
    if p.is_dir():
        if not any(p.rglob("*.txt")):
            raise TrainHeadsError(f"data folder {str(p)!r} holds no *.txt files")
        return p
    if p.suffix.lower() not in (".jsonl", ".json", ".txt"):
        raise TrainHeadsError(
            f"data file {str(p)!r}: expected JSON Lines (.jsonl) with a \"text\" field per line, "
            f"a .txt file or a folder of .txt files"
        )
    return p


def iter_documents(data: str | os.PathLike, max_docs: int | None = None) -> Iterator[str]:
    """Yield the documents of a corpus, lazily, in file order.

    Args:
        data: ``.jsonl`` file (``{"text": ...}`` per line), ``.txt`` file or a
            folder of ``.txt`` files (see the module docstring).
        max_docs: stop after this many non-empty documents (``None``: all).
    Yields:
        document text (``str``); empty/whitespace-only documents are skipped.
    Raises:
        TrainHeadsError: missing path, a line that is not JSON, or a JSON line
            without a string ``"text"`` field (the line number is given).
    """
    p = check_data_path(data)
    if max_docs is not None and max_docs <= 0:
        return
    n = 0
    if p.is_dir():
        for f in sorted(p.rglob("*.txt")):
            text = f.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield text
                n += 1
                if max_docs is not None and n >= max_docs:
                    return
        return
    if p.suffix.lower() == ".txt":
        text = p.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text
        return
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainHeadsError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TrainHeadsError(f"{p}:{lineno}: expected an object with a string \"text\" field")
            text = obj["text"]
            if text.strip():
                yield text
                n += 1
                if max_docs is not None and n >= max_docs:
                    return


def first_tokens(tokenizer, text: str, n: int) -> list[int]:
    """Token ids of the first ``n`` tokens of ``text`` (fewer if the text is shorter).

    Only a prefix of the text is tokenized (growing geometrically until it
    yields ``n`` tokens plus a safety margin of 32 tokens), so a
    multi-megabyte book costs about as much as its first ``n`` tokens; the
    margin keeps the cut point from changing the last kept token.

    Args:
        tokenizer: a Hugging Face tokenizer (called with its default special tokens).
        text: the document.
        n: number of tokens wanted (> 0).
    Returns:
        ``list[int]`` of length ``min(n, len(tokenize(text)))``.
    """
    margin = 32
    chars = max(256, 8 * (n + margin))
    while True:
        piece = text[:chars]
        ids = tokenizer(piece, add_special_tokens=True, verbose=False)["input_ids"]
        if len(ids) >= n + margin or chars >= len(text):
            return list(ids[:n])
        chars *= 2


def build_sequences(docs: Iterator[str] | list[str], tokenizer, seq_len: int, *,
                    pack: bool = True, windows_per_doc: int = 1) -> torch.Tensor:
    """Tokenize documents into fixed-length training sequences (Sec 4.1 recipe).

    Args:
        docs: document texts (e.g. from :func:`iter_documents`).
        tokenizer: the base model's Hugging Face tokenizer.
        seq_len: L, tokens per sequence (the paper uses 8192).
        pack: ``True`` (default): documents shorter than L are concatenated,
            each followed by EOS, and cut into L-token sequences (a trailing
            incomplete one is dropped). ``False``: shorter documents are
            skipped, as in the paper.
        windows_per_doc: W, how many consecutive L-token windows to take from
            the start of each document: its first ``W·L`` tokens as W sequences
            (e.g. the paper's "first 8K tokens of every book" at L = 2048 is
            W = 4). A document with fewer tokens gives its full windows; its
            remainder (shorter than L) is packed or skipped as above.
    Returns:
        ``torch.long`` tensor ``[num_sequences, seq_len]`` on CPU: long
        documents' first-L-token sequences (W per document) and packed
        sequences, in corpus order (packed ones are emitted as soon as they
        fill up). May have 0 rows.
    Raises:
        TrainHeadsError: ``seq_len`` or ``windows_per_doc`` below 1.
    """
    if seq_len <= 0:
        raise TrainHeadsError(f"seq_len must be positive, got {seq_len}")
    if windows_per_doc < 1:
        raise TrainHeadsError(f"windows_per_doc must be >= 1, got {windows_per_doc}")
    eos = getattr(tokenizer, "eos_token_id", None)
    rows: list[list[int]] = []
    buf: list[int] = []
    for text in docs:
        ids = first_tokens(tokenizer, text, seq_len * windows_per_doc)
        full = len(ids) // seq_len
        rows.extend(ids[w * seq_len: (w + 1) * seq_len] for w in range(full))
        ids = ids[full * seq_len:]
        if full and not ids:
            continue
        if not pack:
            continue
        buf.extend(ids)
        if eos is not None and (not ids or ids[-1] != eos):
            buf.append(int(eos))
        while len(buf) >= seq_len:
            rows.append(buf[:seq_len])
            buf = buf[seq_len:]
    if not rows:
        return torch.empty((0, seq_len), dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long)


def load_token_sequences(data: str | os.PathLike, tokenizer, seq_len: int, *, pack: bool = True,
                         max_docs: int | None = None, windows_per_doc: int = 1) -> torch.Tensor:
    """:func:`iter_documents` + :func:`build_sequences`, with an error on empty results.

    Returns:
        ``torch.long`` ``[num_sequences, seq_len]`` (at least one row).
    Raises:
        TrainHeadsError: bad path/format (see :func:`iter_documents`), no
            documents, or no sequence of ``seq_len`` tokens could be built.
    """
    n_docs = 0

    def counted():
        nonlocal n_docs
        for d in iter_documents(data, max_docs=max_docs):
            n_docs += 1
            yield d

    seqs = build_sequences(counted(), tokenizer, seq_len, pack=pack, windows_per_doc=windows_per_doc)
    if n_docs == 0:
        raise TrainHeadsError(f"data {str(data)!r} holds no non-empty documents")
    if seqs.shape[0] == 0:
        how = ("even after packing all documents together" if pack
               else "and short documents are skipped (packing is off)")
        raise TrainHeadsError(
            f"data {str(data)!r}: {n_docs} document(s) give no sequence of {seq_len} tokens "
            f"{how}; use more text or a smaller --seq-len"
        )
    return seqs
