"""Tiny live indexes for tests: a base built with the tiny DPR encoders (or BM25) over
``word_rows``, adopted as a live index. Nothing here downloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from openbook.index import build_index
from openbook.index.documents import Document
from openbook.index.live import LiveIndex, LiveOptions
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import _WORDS, word_rows, write_jsonl


def make_live_index(
    root: Path,
    index_type: str,
    dpr_dirs: tuple[Path, Path] | None,
    *,
    passages: int = 120,
    seed: int = 0,
    options: LiveOptions | None = None,
) -> LiveIndex:
    """A live index at ``root / "live"`` over ``passages`` one-passage documents ``w<i>``."""
    root = Path(root)
    corpus = write_jsonl(root / "corpus.jsonl", word_rows(passages, seed=seed))
    built = root / "built"
    if index_type == "bm25":
        build_index(
            [corpus],
            built,
            IndexSpec(name="live", index_type="bm25"),
            BuildOptions(progress=False),
        )
    else:
        assert dpr_dirs is not None
        ctx, q = dpr_dirs
        build_index(
            [corpus],
            built,
            IndexSpec(name="live", index_type=index_type, encoder=str(ctx), query_encoder=str(q)),
            BuildOptions(progress=False),
        )
    return LiveIndex.create(root / "live", built, options)


def random_document(rng: np.random.Generator, doc_id: str, words: int | None = None) -> Document:
    """A document of the tiny encoders' words plus a term of its own (``tag<doc_id>``), so a
    BM25 query for that term finds it and nothing else; up to ~3 passages."""
    vocab = _WORDS.split(" ")
    n = int(rng.integers(5, 250)) if words is None else words
    text = " ".join(rng.choice(vocab, n)) + f" tag{doc_id.replace('-', '')}"
    return Document.create(doc_id, str(rng.choice(vocab)).title(), text, {"n": n})
