#!/usr/bin/env python
"""Write the bundled demo prompts: book openings from the public-domain pg-books corpus.

For each selected book the text is taken from the start of its first chapter (front matter
such as title pages and tables of contents is skipped using a per-book marker) and cut at a
line break (preferably a paragraph or sentence end) so that, under the demo model's tokenizer, it is at most:

* ``<id>.txt``        ~3,000 tokens (long prompt; use with a long max_model_len)
* ``<id>-2k.txt``     ~2,048 tokens
* ``<id>-short.txt``  ~512 tokens (leaves room for 4K+ generated tokens inside a 4K-trained model)

Usage::

    python docs/research/make_prompts.py [--data train.jsonl] [--tokenizer vllm_tokenswift/assets/demo-model]
                                         [--out vllm_tokenswift/assets/prompts]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]    # docs/research/ -> the checkout

# (PG id, marker where the prompt starts: the first occurrence followed by prose, so that a
# table-of-contents entry with the same text is skipped, see find_start)
BOOKS = [
    ("1342", "Chapter 1\n"),                          # Pride and Prejudice
    ("84", "Letter 1\n\n_To Mrs. Saville"),           # Frankenstein
    ("2701", "CHAPTER 1. Loomings.\n\nCall me"),      # Moby Dick
    ("1661", "ADVENTURE I. A SCANDAL IN BOHEMIA"),    # The Adventures of Sherlock Holmes
    ("345", "CHAPTER I\n\nJONATHAN HARKER'S JOURNAL"),  # Dracula
    ("19942", "I\n\nHOW CANDIDE WAS BROUGHT UP"),        # Candide (held out from demo-model training)
]
TARGETS = {"": 3000, "-2k": 2048, "-short": 512}


def find_start(text: str, marker: str | None) -> int:
    if marker:
        # body headings come after the contents list: take the first occurrence that is
        # followed by prose (a paragraph of >= 200 characters within the next 2000)
        for m in re.finditer(re.escape(marker), text):
            para = text[m.end(): m.end() + 2000]
            if len(max(para.split("\n\n"), key=len)) >= 200:
                return m.start()
    # fallback: first "CHAPTER I" / "Chapter 1" heading followed by prose, else 0
    for m in re.finditer(r"^(CHAPTER|Chapter) (I|1|ONE)\b.*$", text, flags=re.MULTILINE):
        para = text[m.end(): m.end() + 2000]
        if len(max(para.split("\n\n"), key=len)) >= 200:
            return m.start()
    return 0


def cut(text: str, tok, max_tokens: int) -> str:
    """Prefix of `text` with <= max_tokens tokens, ending at a line break (the books are
    hard-wrapped), preferably at a paragraph or sentence end if that keeps >= 90% of the budget."""
    lines = text.split("\n")

    def n_tok(k):
        return len(tok.encode("\n".join(lines[:k])))

    lo, hi = 1, len(lines)
    while lo < hi:  # binary search: token count is monotone in the number of lines
        mid = (lo + hi + 1) // 2
        if n_tok(mid) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    best = lo
    for k in range(lo, 0, -1):
        last = lines[k - 1].rstrip()
        para_end = k < len(lines) and not lines[k].strip()
        if last and (para_end or last[-1] in ".!?\"\u201d\u2019'_") and n_tok(k) >= 0.9 * max_tokens:
            best = k
            break
        if n_tok(k) < 0.9 * max_tokens:
            break
    return "\n".join(lines[:best]).rstrip() + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="/work/shared/data/pg-books/train.jsonl")
    p.add_argument("--tokenizer", default=str(REPO / "vllm_tokenswift" / "assets" / "demo-model"))
    p.add_argument("--out", default=str(REPO / "vllm_tokenswift" / "assets" / "prompts"))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    want = {bid for bid, _ in BOOKS}
    books = {}
    with open(args.data, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["id"] in want:
                books[d["id"]] = d
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for bid, marker in BOOKS:
        b = books[bid]
        start = find_start(b["text"], marker)
        body = b["text"][start: start + 60000]
        counts = {}
        for suffix, n in TARGETS.items():
            txt = cut(body, tok, n)
            (out / f"{bid}{suffix}.txt").write_text(txt, encoding="utf-8")
            counts[suffix] = len(tok.encode(txt))
        rows.append((bid, b["title"], start, counts))
        print(f"{bid:>6} {b['title'][:40]:40} start@{start:>6}  "
              + "  ".join(f"{bid}{s}.txt={c}" for s, c in counts.items()))

    held_out = {"19942", "28054"}
    lines = [
        "# Bundled demo prompts",
        "",
        "Openings of public-domain books from Project Gutenberg (all first published before 1919),",
        "taken from the pg-books corpus (`/work/shared/data/pg-books/train.jsonl`). Each prompt starts",
        "at the book's first chapter (title pages and tables of contents skipped) and is cut at a",
        "line break, preferably a paragraph or sentence end. Token counts are under the demo model's tokenizer",
        "(`vllm_tokenswift/assets/demo-model`), which adds no BOS token.",
        "",
        "* `<id>.txt`: about 3,000 tokens",
        "* `<id>-2k.txt`: about 2,048 tokens",
        "* `<id>-short.txt`: about 512 tokens (for generating 4K+ tokens with the 4K-trained demo model)",
        "",
        "Regenerate with `python docs/research/make_prompts.py`.",
        "",
        "| PG id | Title | Start (char offset) | `<id>.txt` tokens | `-2k` tokens | `-short` tokens | In demo-model training data |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for bid, title, start, c in rows:
        lines.append(f"| {bid} | {title} | {start} | {c['']} | {c['-2k']} | {c['-short']} | "
                     f"{'no (held-out validation book)' if bid in held_out else 'yes'} |")
    lines += ["", "Source: Project Gutenberg, https://www.gutenberg.org/ebooks/<id> (public domain in the USA).", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
